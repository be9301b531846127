"""``/shardnet/echo/1.0.0``: a diagnostic protocol that returns each frame it receives.

Used by ``shardnet node`` to prove that two peers can open a custom-protocol stream, and by the
benchmarks. Frames are length-prefixed (see framing.py); at most 1 MiB each.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .framing import FrameDecoder, encode_frame

if TYPE_CHECKING:
    from shardnet.transport.stream import Stream

PROTOCOL_ID = "/shardnet/echo/1.0.0"
MAX_FRAME = 1 << 20


async def serve(stream: Stream) -> None:
    decoder = FrameDecoder(MAX_FRAME)
    while True:
        data = await stream.read_some(1 << 16, timeout=60)
        if not data:
            if decoder.pending:
                raise ValueError(f"echo stream ended inside a frame ({decoder.pending} bytes held)")
            return
        for frame in decoder.feed(data):
            await stream.write(encode_frame(frame, MAX_FRAME))


async def echo_once(stream: Stream, payload: bytes, *, timeout: float = 10.0) -> bytes:
    await stream.write(encode_frame(payload, MAX_FRAME), timeout=timeout)
    decoder = FrameDecoder(MAX_FRAME)
    while True:
        data = await stream.read_some(1 << 16, timeout=timeout)
        if not data:
            raise ConnectionError("echo peer closed the stream before answering")
        frames = decoder.feed(data)
        if frames:
            return frames[0]
