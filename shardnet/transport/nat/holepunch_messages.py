"""DCUtR messages (libp2p spec relay/DCUtR.md), sans-IO.

``/libp2p/dcutr`` carries two kinds of ``HolePunch`` message, each framed by an unsigned-varint
length: CONNECT (with the sender's public addresses, binary multiaddrs) and SYNC (no addresses).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

from .pbwire import MessageError, bytes_field, fields, frame, one, varint_field

DCUTR_PROTOCOL = "/libp2p/dcutr"


class HolePunchType(IntEnum):
    CONNECT = 100
    SYNC = 300


@dataclass
class HolePunch:
    type: HolePunchType
    addrs: list[bytes] = field(default_factory=list)


def encode_holepunch(m: HolePunch) -> bytes:
    return frame(varint_field(1, int(m.type)) + b"".join(bytes_field(2, a) for a in m.addrs))


def decode_holepunch(body: bytes) -> HolePunch:
    f = fields(body)
    kind = one(f, 1, int, required=True)
    if kind not in HolePunchType._value2member_map_:
        raise MessageError(f"unknown hole punch message type {kind}")
    return HolePunch(HolePunchType(kind), [a for a in f.get(2, []) if isinstance(a, bytes)])
