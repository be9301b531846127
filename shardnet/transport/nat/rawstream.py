"""The two stream chores every NAT protocol driver shares: read one framed message, close
without caring whether the other side is still there."""

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
    """Close a stream whose peer may be gone; never raises, never waits long."""
    with trio.move_on_after(timeout):
        try:
            await raw.close()
        except Exception:
            pass
