"""Length-prefixed frames (sans-IO): a 4-byte big-endian length, then that many bytes.

The decoder is fed whatever bytes arrive and hands back complete frames; it checks a declared
length against the limit *before* buffering the body, so a hostile length costs nothing.
"""

from __future__ import annotations

import struct

from shardnet.errors import ShardnetError

HEADER = struct.Struct(">I")
DEFAULT_MAX_FRAME = 16 << 20


class FrameError(ShardnetError, ValueError):
    """The byte stream is not a valid frame sequence."""

    code = "frame"


def encode_frame(payload: bytes, max_frame: int = DEFAULT_MAX_FRAME) -> bytes:
    if len(payload) > max_frame:
        raise FrameError(f"frame of {len(payload)} bytes exceeds the limit of {max_frame}")
    return HEADER.pack(len(payload)) + payload


class FrameDecoder:
    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()
        self._need: int | None = None

    def feed(self, data: bytes) -> list[bytes]:
        """Add bytes; return every frame now complete (possibly none)."""
        self._buf += data
        frames: list[bytes] = []
        while True:
            if self._need is None:
                if len(self._buf) < HEADER.size:
                    return frames
                (n,) = HEADER.unpack_from(self._buf)
                if n > self.max_frame:
                    raise FrameError(f"declared frame length {n} exceeds the limit of {self.max_frame}")
                del self._buf[: HEADER.size]
                self._need = n
            if len(self._buf) < self._need:
                return frames
            frames.append(bytes(self._buf[: self._need]))
            del self._buf[: self._need]
            self._need = None
            if not self._buf:  # (a bytearray keeps its capacity: a large frame's megabytes go now)
                self._buf = bytearray()

    @property
    def pending(self) -> int:
        """Bytes held toward an incomplete frame (0 at a frame boundary)."""
        return len(self._buf) + (HEADER.size if self._need is not None else 0)
