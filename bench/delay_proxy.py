"""A user-space TCP proxy that delays each direction by a fixed one-way latency.

Linux netem is not available in these kernels, so WAN-like paths are emulated here: every chunk
read from one side is released to the other side ``one_way_delay_s`` after it arrived, without
limiting how many bytes are in flight (a long fat pipe). Bandwidth caps and jitter are left to
the WAN emulator of the speculative-decoding work.
"""

from __future__ import annotations

import math

import trio


class DelayProxy:
    def __init__(self, target: tuple[str, int], one_way_delay_s: float) -> None:
        self.target = target
        self.delay = one_way_delay_s

    async def serve(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        task_status.started(listeners[0].socket.getsockname()[1])
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, client: trio.SocketStream) -> None:
        async with client, await trio.open_tcp_stream(*self.target) as upstream:
            async with trio.open_nursery() as n:
                n.start_soon(self._pipe, client, upstream, n.cancel_scope)
                n.start_soon(self._pipe, upstream, client, n.cancel_scope)

    async def _pipe(self, src: trio.SocketStream, dst: trio.SocketStream, scope: trio.CancelScope) -> None:
        send, recv = trio.open_memory_channel[tuple[float, bytes]](math.inf)

        async def release() -> None:
            async for due, data in recv:
                await trio.sleep_until(due)
                try:
                    await dst.send_all(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    break
            scope.cancel()

        async with trio.open_nursery() as n:
            n.start_soon(release)
            async with send:
                while True:
                    try:
                        data = await src.receive_some(1 << 16)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        data = b""
                    if not data:
                        break
                    send.send_nowait((trio.current_time() + self.delay, data))
