"""Circuit relay v2 messages (libp2p spec relay/circuit-v2.md), sans-IO.

Hop (``/libp2p/circuit/relay/0.2.0/hop``, client <-> relay) and stop
(``/libp2p/circuit/relay/0.2.0/stop``, relay <-> target) messages are protobuf, each framed by an
unsigned-varint length (pbwire). After a successful CONNECT the same stream carries the relayed
connection, and bytes already read past the status message belong to it (``take_rest``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

HOP_PROTOCOL = "/libp2p/circuit/relay/0.2.0/hop"
STOP_PROTOCOL = "/libp2p/circuit/relay/0.2.0/stop"
from .pbwire import (  # noqa: F401 (re-exported: the relay's users frame and read with these)
    MAX_MESSAGE, FrameBuffer, MessageError, bytes_field, decode_varint, encode_varint, fields, frame, one,
    varint_field)

RelayProtocolError = MessageError


class HopType(IntEnum):
    RESERVE = 0
    CONNECT = 1
    STATUS = 2


class StopType(IntEnum):
    CONNECT = 0
    STATUS = 1


class Status(IntEnum):
    OK = 100
    RESERVATION_REFUSED = 200
    RESOURCE_LIMIT_EXCEEDED = 201
    PERMISSION_DENIED = 202
    CONNECTION_FAILED = 203
    NO_RESERVATION = 204
    MALFORMED_MESSAGE = 400
    UNEXPECTED_MESSAGE = 401


@dataclass
class Peer:
    id: bytes
    addrs: list[bytes] = field(default_factory=list)


@dataclass
class Reservation:
    expire: int | None = None  # Unix time, seconds
    addrs: list[bytes] = field(default_factory=list)  # the relay's addresses, binary multiaddrs
    voucher: bytes | None = None


@dataclass
class Limit:
    duration: int | None = None  # seconds
    data: int | None = None  # bytes, per direction


@dataclass
class HopMessage:
    type: HopType
    peer: Peer | None = None
    reservation: Reservation | None = None
    limit: Limit | None = None
    status: int | None = None


@dataclass
class StopMessage:
    type: StopType
    peer: Peer | None = None
    limit: Limit | None = None
    status: int | None = None


def _encode_peer(p: Peer) -> bytes:
    return bytes_field(1, p.id) + b"".join(bytes_field(2, a) for a in p.addrs)


def _decode_peer(data: bytes) -> Peer:
    f = fields(data)
    return Peer(one(f, 1, bytes, required=True), [a for a in f.get(2, []) if isinstance(a, bytes)])


def _encode_reservation(r: Reservation) -> bytes:
    return (varint_field(1, r.expire) + b"".join(bytes_field(2, a) for a in r.addrs)
            + bytes_field(3, r.voucher))


def _decode_reservation(data: bytes) -> Reservation:
    f = fields(data)
    return Reservation(one(f, 1, int), [a for a in f.get(2, []) if isinstance(a, bytes)], one(f, 3, bytes))


def _encode_limit(lim: Limit) -> bytes:
    return varint_field(1, lim.duration) + varint_field(2, lim.data)


def _decode_limit(data: bytes) -> Limit:
    f = fields(data)
    return Limit(one(f, 1, int), one(f, 2, int))


def encode_hop(m: HopMessage) -> bytes:
    body = (varint_field(1, int(m.type)) + (bytes_field(2, _encode_peer(m.peer)) if m.peer else b"")
            + (bytes_field(3, _encode_reservation(m.reservation)) if m.reservation else b"")
            + (bytes_field(4, _encode_limit(m.limit)) if m.limit else b"") + varint_field(5, m.status))
    return frame(body)


def encode_stop(m: StopMessage) -> bytes:
    body = (varint_field(1, int(m.type)) + (bytes_field(2, _encode_peer(m.peer)) if m.peer else b"")
            + (bytes_field(3, _encode_limit(m.limit)) if m.limit else b"") + varint_field(4, m.status))
    return frame(body)


def decode_hop(body: bytes) -> HopMessage:
    f = fields(body)
    kind = one(f, 1, int, required=True)
    if kind not in HopType._value2member_map_:
        raise RelayProtocolError(f"unknown hop message type {kind}")
    peer, rsvp, limit = one(f, 2, bytes), one(f, 3, bytes), one(f, 4, bytes)
    return HopMessage(HopType(kind), _decode_peer(peer) if peer is not None else None,
                      _decode_reservation(rsvp) if rsvp is not None else None,
                      _decode_limit(limit) if limit is not None else None, one(f, 5, int))


def decode_stop(body: bytes) -> StopMessage:
    f = fields(body)
    kind = one(f, 1, int, required=True)
    if kind not in StopType._value2member_map_:
        raise RelayProtocolError(f"unknown stop message type {kind}")
    peer, limit = one(f, 2, bytes), one(f, 3, bytes)
    return StopMessage(StopType(kind), _decode_peer(peer) if peer is not None else None,
                       _decode_limit(limit) if limit is not None else None, one(f, 4, int))
