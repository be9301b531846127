"""shardnet Streams over trio's in-memory streams, for unit tests of drivers and deadlines
(no host, no sockets; with ``trio.testing.MockClock`` timeouts cost no real time)."""

from __future__ import annotations

from types import SimpleNamespace

import trio
import trio.testing

from shardnet.transport.stream import Stream


class MemoryRawStream:
    """The part of a py-libp2p stream that :class:`Stream` uses, over one end of a trio stream.
    ``read`` returns ``b""`` once the other end has closed its side."""

    def __init__(self, end: trio.abc.HalfCloseableStream, remote_peer: str = "remote") -> None:
        self.end = end
        self.muxed_conn = SimpleNamespace(peer_id=remote_peer)

    def get_protocol(self) -> str | None:
        return None

    async def read(self, n: int) -> bytes:
        return await self.end.receive_some(n)

    async def write(self, data: bytes) -> None:
        await self.end.send_all(data)

    async def close(self) -> None:
        await self.end.send_eof()

    async def reset(self) -> None:
        await self.end.aclose()


def stream_pair(*, lockstep: bool = False, timeout: float = 30.0) -> tuple[Stream, Stream]:
    """Two connected Streams. ``lockstep``: a write waits until the other end reads it (a peer
    that does not read blocks its writer, as a full TCP window does)."""
    a, b = trio.testing.lockstep_stream_pair() if lockstep else trio.testing.memory_stream_pair()
    return Stream(MemoryRawStream(a, "b"), timeout), Stream(MemoryRawStream(b, "a"), timeout)
