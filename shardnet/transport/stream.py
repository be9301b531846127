"""A stream as shardnet's protocols see it: bytes in order, every wait bounded by a deadline."""

from __future__ import annotations

import trio
from libp2p.abc import INetStream
from libp2p.peer.id import ID

from .errors import OverlayTimeout, ShardnetError

#: Default seconds any single read or write may wait.
DEFAULT_IO_TIMEOUT = 30.0


class StreamClosedError(ShardnetError):
    """The remote side closed or reset the stream."""

    code = "stream_closed"


class Stream:
    """Wraps a libp2p stream with timeouts and exact reads."""

    def __init__(self, raw: INetStream, timeout: float = DEFAULT_IO_TIMEOUT) -> None:
        self.raw = raw
        self.timeout = timeout
        self._buf = bytearray()

    @property
    def protocol(self) -> str | None:
        return self.raw.get_protocol()

    @property
    def remote_peer(self) -> ID:
        return self.raw.muxed_conn.peer_id

    @property
    def relayed(self) -> bool:
        """Whether this stream's connection runs through a relay."""
        from .compat.swarm import is_relayed

        return is_relayed(self.raw.muxed_conn)

    async def write(self, data: bytes, *, timeout: float | None = None) -> None:
        with _deadline(self.timeout if timeout is None else timeout, "write"):
            try:
                await self.raw.write(data)
            except trio.Cancelled:
                raise
            except Exception as e:
                raise StreamClosedError(f"write failed: {type(e).__name__}: {e}") from None

    async def read_some(self, max_bytes: int = 65536, *, timeout: float | None = None) -> bytes:
        """Up to ``max_bytes`` bytes; ``b""`` at end of stream."""
        if self._buf:
            out = bytes(self._buf[:max_bytes])
            del self._buf[:max_bytes]
            return out
        with _deadline(self.timeout if timeout is None else timeout, "read"):
            try:
                data = await self.raw.read(max_bytes)
            except trio.Cancelled:
                raise
            except EOFError:
                return b""
            except Exception as e:
                if type(e).__name__ in ("StreamEOF", "MuxedStreamEOF"):
                    return b""
                raise StreamClosedError(f"read failed: {type(e).__name__}: {e}") from None
        return data or b""

    async def read_exactly(self, n: int, *, timeout: float | None = None) -> bytes:
        """Exactly ``n`` bytes, or StreamClosedError if the stream ends first."""
        with _deadline(self.timeout if timeout is None else timeout, f"read of {n} bytes"):
            while len(self._buf) < n:
                try:
                    chunk = await self.raw.read(max(n - len(self._buf), 65536))
                except trio.Cancelled:
                    raise
                except Exception as e:
                    if isinstance(e, EOFError) or type(e).__name__ in ("StreamEOF",):
                        chunk = b""
                    else:
                        raise StreamClosedError(
                            f"read failed: {type(e).__name__}: {e}"
                        ) from None
                if not chunk:
                    raise StreamClosedError(
                        f"stream ended after {len(self._buf)} of {n} bytes"
                    )
                self._buf += chunk
            out = bytes(self._buf[:n])
            del self._buf[:n]
            return out

    async def close(self) -> None:
        with trio.move_on_after(5):
            try:
                await self.raw.close()
            except Exception:
                pass

    async def reset(self) -> None:
        with trio.move_on_after(5):
            try:
                await self.raw.reset()
            except Exception:
                pass

    async def __aenter__(self) -> Stream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class _deadline:
    """``trio.fail_after`` that raises OverlayTimeout with a message saying what timed out."""

    def __init__(self, seconds: float, what: str) -> None:
        self.what = what
        self.seconds = seconds
        self.scope = trio.CancelScope(deadline=trio.current_time() + seconds)

    def __enter__(self) -> trio.CancelScope:
        return self.scope.__enter__()

    def __exit__(self, *exc: object) -> bool:
        swallowed = self.scope.__exit__(*exc)  # type: ignore[arg-type]
        if self.scope.cancelled_caught:
            raise OverlayTimeout(f"{self.what} timed out after {self.seconds:g} s")
        return swallowed
