"""The protobuf wire format and unsigned-varint framing shared by the libp2p NAT protocols
(circuit relay v2, DCUtR, AutoNAT), sans-IO.

A small reader and writer of our own rather than generated code: unknown fields are skipped as
protobuf requires, every length is checked before it is trusted, and every error is a
:class:`MessageError`. :class:`FrameBuffer` hands back the bytes after a frame, because after
some exchanges (a relay CONNECT) the same stream goes on carrying another protocol.
"""

from __future__ import annotations

from shardnet.errors import ShardnetError

MAX_MESSAGE = 4096  # bytes; what go-libp2p accepts for these protocols too


class MessageError(ShardnetError, ValueError):
    """A frame or message that breaks its protocol."""

    code = "message"


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
            raise MessageError("varint longer than 64 bits")
    return None


def fields(data: bytes) -> dict[int, list]:
    """Field number -> values (ints for varints, bytes for length-delimited)."""
    out: dict[int, list] = {}
    pos = 0
    while pos < len(data):
        got = decode_varint(data, pos)
        if got is None:
            raise MessageError("truncated field key")
        key, pos = got
        number, wire = key >> 3, key & 7
        if number == 0:
            raise MessageError("field number 0")
        if wire == 0:
            got = decode_varint(data, pos)
            if got is None:
                raise MessageError("truncated varint field")
            value, pos = got
        elif wire == 2:
            got = decode_varint(data, pos)
            if got is None or got[1] + got[0] > len(data):
                raise MessageError("truncated length-delimited field")
            length, pos = got
            value, pos = bytes(data[pos:pos + length]), pos + length
        elif wire in (1, 5):  # fixed64 / fixed32: skipped (none defined here)
            size = 8 if wire == 1 else 4
            if pos + size > len(data):
                raise MessageError("truncated fixed-width field")
            value, pos = None, pos + size
        else:
            raise MessageError(f"unsupported wire type {wire}")
        out.setdefault(number, []).append(value)
    return out


def one(found: dict[int, list], number: int, kind: type, required: bool = False):
    """The last value of field ``number`` that has the wire type of ``kind`` (protobuf: the last wins)."""
    values = [v for v in found.get(number, []) if isinstance(v, kind)]
    if not values:
        if required:
            raise MessageError(f"missing required field {number}")
        return None
    return values[-1]


def varint_field(number: int, value: int | None) -> bytes:
    return b"" if value is None else encode_varint(number << 3) + encode_varint(int(value))


def bytes_field(number: int, value: bytes | None) -> bytes:
    return b"" if value is None else encode_varint(number << 3 | 2) + encode_varint(len(value)) + value




def frame(body: bytes, max_size: int = MAX_MESSAGE) -> bytes:
    if len(body) > max_size:
        raise MessageError(f"message of {len(body)} bytes exceeds {max_size}")
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
                raise MessageError("malformed length prefix")
            return None
        length, start = got
        if length > self.max_size:
            raise MessageError(f"frame of {length} bytes exceeds {self.max_size}")
        if len(self.buf) < start + length:
            return None
        body = bytes(self.buf[start:start + length])
        del self.buf[:start + length]
        return body

    def take_rest(self) -> bytes:
        rest, self.buf = bytes(self.buf), bytearray()
        return rest
