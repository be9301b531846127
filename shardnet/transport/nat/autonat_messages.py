"""AutoNAT v1 messages (libp2p spec autonat/autonat-v1.md), sans-IO.

``/libp2p/autonat/1.0.0``: the client sends one DIAL naming its peer ID and the addresses it wants
checked; the server dials them back on a fresh connection and answers one DIAL_RESPONSE, with the
address that worked or an error status. Both are protobuf framed by an unsigned-varint length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

from .pbwire import MessageError, bytes_field, fields, frame, one, varint_field

AUTONAT_PROTOCOL = "/libp2p/autonat/1.0.0"


class AutoNATType(IntEnum):
    DIAL = 0
    DIAL_RESPONSE = 1


class DialStatus(IntEnum):
    OK = 0
    E_DIAL_ERROR = 100
    E_DIAL_REFUSED = 101
    E_BAD_REQUEST = 200
    E_INTERNAL_ERROR = 300


@dataclass
class Dial:
    peer_id: bytes
    addrs: list[bytes] = field(default_factory=list)  # binary multiaddrs


@dataclass
class DialResponse:
    status: int
    text: str | None = None
    addr: bytes | None = None  # the address that answered (status OK)


@dataclass
class AutoNATMessage:
    type: AutoNATType
    dial: Dial | None = None
    response: DialResponse | None = None


def encode_autonat(m: AutoNATMessage) -> bytes:
    body = varint_field(1, int(m.type))
    if m.dial is not None:
        peer = bytes_field(1, m.dial.peer_id) + b"".join(bytes_field(2, a) for a in m.dial.addrs)
        body += bytes_field(2, bytes_field(1, peer))
    if m.response is not None:
        r = m.response
        text = r.text.encode() if r.text is not None else None
        body += bytes_field(3, varint_field(1, int(r.status)) + bytes_field(2, text) + bytes_field(3, r.addr))
    return frame(body)


def decode_autonat(body: bytes) -> AutoNATMessage:
    f = fields(body)
    kind = one(f, 1, int, required=True)
    if kind not in AutoNATType._value2member_map_:
        raise MessageError(f"unknown AutoNAT message type {kind}")
    dial = response = None
    raw_dial = one(f, 2, bytes)
    if raw_dial is not None:
        raw_peer = one(fields(raw_dial), 1, bytes, required=True)
        pf = fields(raw_peer)
        dial = Dial(one(pf, 1, bytes, required=True), [a for a in pf.get(2, []) if isinstance(a, bytes)])
    raw_response = one(f, 3, bytes)
    if raw_response is not None:
        rf = fields(raw_response)
        text = one(rf, 2, bytes)
        try:
            text = text.decode() if text is not None else None
        except UnicodeDecodeError:
            raise MessageError("status text is not UTF-8") from None
        response = DialResponse(one(rf, 1, int, required=True), text, one(rf, 3, bytes))
    if kind == AutoNATType.DIAL and dial is None:
        raise MessageError("DIAL without a peer")
    if kind == AutoNATType.DIAL_RESPONSE and response is None:
        raise MessageError("DIAL_RESPONSE without a response")
    return AutoNATMessage(AutoNATType(kind), dial, response)
