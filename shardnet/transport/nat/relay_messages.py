"""Circuit relay v2 messages (libp2p spec relay/circuit-v2.md), sans-IO.

Hop (``/libp2p/circuit/relay/0.2.0/hop``, client <-> relay) and stop
(``/libp2p/circuit/relay/0.2.0/stop``, relay <-> target) messages are protobuf, each framed by an
unsigned-varint length. This module encodes and decodes them with a small protobuf reader and
writer of its own (no generated code, unknown fields skipped as protobuf requires) and a frame
buffer that hands back the bytes after a frame: after a successful CONNECT the same stream
carries the relayed connection, and bytes already read past the status message belong to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

HOP_PROTOCOL = "/libp2p/circuit/relay/0.2.0/hop"
STOP_PROTOCOL = "/libp2p/circuit/relay/0.2.0/stop"
MAX_MESSAGE = 4096  # bytes; what go-libp2p accepts too


class RelayProtocolError(ValueError):
    """A frame or message that breaks the protocol."""


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


# -- protobuf wire format -----------------------------------------------------------------------

def encode_varint(n: int) -> bytes:
    if n < 0:
        raise ValueError("varints here are unsigned")
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def decode_varint(buf: bytes | bytearray | memoryview, pos: int = 0) -> tuple[int, int] | None:
    """(value, position after it), or None if ``buf`` ends inside it."""
    value = shift = 0
    while pos < len(buf):
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift >= 64:
            raise RelayProtocolError("varint longer than 64 bits")
    return None


def _fields(data: bytes) -> dict[int, list]:
    """Field number -> values (ints for varints, bytes for length-delimited)."""
    out: dict[int, list] = {}
    pos = 0
    while pos < len(data):
        got = decode_varint(data, pos)
        if got is None:
            raise RelayProtocolError("truncated field key")
        key, pos = got
        number, wire = key >> 3, key & 7
        if number == 0:
            raise RelayProtocolError("field number 0")
        if wire == 0:
            got = decode_varint(data, pos)
            if got is None:
                raise RelayProtocolError("truncated varint field")
            value, pos = got
        elif wire == 2:
            got = decode_varint(data, pos)
            if got is None or got[1] + got[0] > len(data):
                raise RelayProtocolError("truncated length-delimited field")
            length, pos = got
            value, pos = bytes(data[pos:pos + length]), pos + length
        elif wire in (1, 5):  # fixed64 / fixed32: skipped (none defined here)
            size = 8 if wire == 1 else 4
            if pos + size > len(data):
                raise RelayProtocolError("truncated fixed-width field")
            value, pos = None, pos + size
        else:
            raise RelayProtocolError(f"unsupported wire type {wire}")
        out.setdefault(number, []).append(value)
    return out


def _one(fields: dict[int, list], number: int, kind: type, required: bool = False):
    values = [v for v in fields.get(number, []) if isinstance(v, kind)]
    if not values:
        if required:
            raise RelayProtocolError(f"missing required field {number}")
        return None
    return values[-1]  # protobuf: the last occurrence wins


def _varint_field(number: int, value: int | None) -> bytes:
    return b"" if value is None else encode_varint(number << 3) + encode_varint(int(value))


def _bytes_field(number: int, value: bytes | None) -> bytes:
    return b"" if value is None else encode_varint(number << 3 | 2) + encode_varint(len(value)) + value


def _encode_peer(p: Peer) -> bytes:
    return _bytes_field(1, p.id) + b"".join(_bytes_field(2, a) for a in p.addrs)


def _decode_peer(data: bytes) -> Peer:
    f = _fields(data)
    return Peer(_one(f, 1, bytes, required=True), [a for a in f.get(2, []) if isinstance(a, bytes)])


def _encode_reservation(r: Reservation) -> bytes:
    return (_varint_field(1, r.expire) + b"".join(_bytes_field(2, a) for a in r.addrs)
            + _bytes_field(3, r.voucher))


def _decode_reservation(data: bytes) -> Reservation:
    f = _fields(data)
    return Reservation(_one(f, 1, int), [a for a in f.get(2, []) if isinstance(a, bytes)], _one(f, 3, bytes))


def _encode_limit(lim: Limit) -> bytes:
    return _varint_field(1, lim.duration) + _varint_field(2, lim.data)


def _decode_limit(data: bytes) -> Limit:
    f = _fields(data)
    return Limit(_one(f, 1, int), _one(f, 2, int))


def encode_hop(m: HopMessage) -> bytes:
    body = (_varint_field(1, int(m.type)) + (_bytes_field(2, _encode_peer(m.peer)) if m.peer else b"")
            + (_bytes_field(3, _encode_reservation(m.reservation)) if m.reservation else b"")
            + (_bytes_field(4, _encode_limit(m.limit)) if m.limit else b"") + _varint_field(5, m.status))
    return _frame(body)


def encode_stop(m: StopMessage) -> bytes:
    body = (_varint_field(1, int(m.type)) + (_bytes_field(2, _encode_peer(m.peer)) if m.peer else b"")
            + (_bytes_field(3, _encode_limit(m.limit)) if m.limit else b"") + _varint_field(4, m.status))
    return _frame(body)


def decode_hop(body: bytes) -> HopMessage:
    f = _fields(body)
    kind = _one(f, 1, int, required=True)
    if kind not in HopType._value2member_map_:
        raise RelayProtocolError(f"unknown hop message type {kind}")
    peer, rsvp, limit = _one(f, 2, bytes), _one(f, 3, bytes), _one(f, 4, bytes)
    return HopMessage(HopType(kind), _decode_peer(peer) if peer is not None else None,
                      _decode_reservation(rsvp) if rsvp is not None else None,
                      _decode_limit(limit) if limit is not None else None, _one(f, 5, int))


def decode_stop(body: bytes) -> StopMessage:
    f = _fields(body)
    kind = _one(f, 1, int, required=True)
    if kind not in StopType._value2member_map_:
        raise RelayProtocolError(f"unknown stop message type {kind}")
    peer, limit = _one(f, 2, bytes), _one(f, 3, bytes)
    return StopMessage(StopType(kind), _decode_peer(peer) if peer is not None else None,
                       _decode_limit(limit) if limit is not None else None, _one(f, 4, int))


def _frame(body: bytes) -> bytes:
    if len(body) > MAX_MESSAGE:
        raise RelayProtocolError(f"message of {len(body)} bytes exceeds {MAX_MESSAGE}")
    return encode_varint(len(body)) + body


class FrameBuffer:
    """Bytes in, complete message bodies out; what follows the last frame stays available."""

    def __init__(self, max_size: int = MAX_MESSAGE) -> None:
        self.buf = bytearray()
        self.max_size = max_size

    def feed(self, data: bytes) -> None:
        self.buf += data

    def next_body(self) -> bytes | None:
        """The next complete frame's body, or None until more bytes arrive."""
        got = decode_varint(self.buf)
        if got is None:
            if len(self.buf) > 10:
                raise RelayProtocolError("malformed length prefix")
            return None
        length, start = got
        if length > self.max_size:
            raise RelayProtocolError(f"frame of {length} bytes exceeds {self.max_size}")
        if len(self.buf) < start + length:
            return None
        body = bytes(self.buf[start:start + length])
        del self.buf[:start + length]
        return body

    def take_rest(self) -> bytes:
        rest, self.buf = bytes(self.buf), bytearray()
        return rest
