"""Chores on raw byte streams: read one framed message, close without caring whether the other
side is still there, and hand on a stream with bytes already read from it put back in front."""

from __future__ import annotations

import trio

from .pbwire import FrameBuffer, MessageError


async def read_message(raw, fb: FrameBuffer, decode, *, chunk: int = 4096):
    """The next varint-framed message on ``raw``, decoded; bytes past it stay in ``fb``."""
    while True:
        body = fb.next_body()
        if body is not None:
            return decode(body)
        data = await raw.read(chunk)
        if not data:
            raise MessageError("stream closed before a whole message")
        fb.feed(data)


async def close_quietly(raw, timeout: float = 1.0) -> None:
    """Close a stream whose peer may be gone; never raises, never waits long, and finishes
    even when the caller is being cancelled (a stream left half-closed would linger)."""
    with trio.move_on_after(timeout) as scope:
        scope.shield = True
        try:
            await raw.close()
        except Exception:
            pass


class PrefixedStream:
    """A byte pipe for py-libp2p's RawConnection (read, write, close, get_remote_address) over
    ``stream``, whose first reads return ``pending``: bytes already taken from it, e.g. past the
    last message a protocol driver parsed."""

    def __init__(self, stream, pending: bytes) -> None:
        self.stream, self.pending = stream, pending

    async def read(self, n: int | None = None) -> bytes:
        if self.pending:
            n = len(self.pending) if n is None else n
            out, self.pending = self.pending[:n], self.pending[n:]
            return out
        return await self.stream.read(n)

    async def write(self, data: bytes) -> None:
        await self.stream.write(data)

    async def close(self) -> None:
        await self.stream.close()

    def get_remote_address(self):
        return self.stream.get_remote_address()
