"""A user-space WAN emulator: a TCP proxy adding one-way delay, jitter and a bandwidth cap.

Linux netem is not available in these kernels, so each direction of a proxied connection is a
`Link`: a chunk read at time t leaves the link's bandwidth queue after its serialization time
(len / rate, behind earlier chunks) and is delivered ``delay`` (plus up to ``jitter``) later,
never before the chunk ahead of it (TCP delivers in order). Benchmarks and tests put one proxy in
front of each peer (the peer announces the proxy's address), so every connection to it crosses
one emulated WAN edge in each direction.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import trio


@dataclass(frozen=True)
class Link:
    delay: float = 0.0  # seconds, one way
    jitter: float = 0.0  # seconds, uniform in [0, jitter) added per chunk
    rate: float = math.inf  # bytes per second


class WanProxy:
    """Listens on 127.0.0.1:<port>; forwards to ``target`` through ``up`` (client -> target)
    and ``down`` (target -> client) links."""

    def __init__(self, target: tuple[str, int], up: Link, down: Link | None = None, *,
                 seed: int = 0, port: int = 0) -> None:
        self.target, self.up, self.down = target, up, down or up
        self.rng = random.Random(seed)
        self.port = port

    async def serve(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(self.port, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started(self.port)
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, client: trio.SocketStream) -> None:
        try:
            upstream = await trio.open_tcp_stream(*self.target)
        except OSError:
            await client.aclose()
            return
        async with client, upstream, trio.open_nursery() as n:
            n.start_soon(self._pipe, client, upstream, self.up, n.cancel_scope)
            n.start_soon(self._pipe, upstream, client, self.down, n.cancel_scope)

    async def _pipe(self, src: trio.SocketStream, dst: trio.SocketStream, link: Link,
                    scope: trio.CancelScope) -> None:
        send, recv = trio.open_memory_channel[tuple[float, bytes]](math.inf)

        async def release() -> None:
            async for due, data in recv:
                await trio.sleep_until(due)
                try:
                    await dst.send_all(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    break
            scope.cancel()

        free_at = last_due = 0.0
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
                    now = trio.current_time()
                    free_at = max(free_at, now) + len(data) / link.rate
                    due = free_at + link.delay + (self.rng.random() * link.jitter if link.jitter else 0.0)
                    last_due = max(last_due, due)  # in order, as TCP delivers
                    send.send_nowait((last_due, data))


def DelayProxy(target: tuple[str, int], one_way_delay_s: float) -> WanProxy:  # noqa: N802
    """Delay only, no jitter or bandwidth cap (a long fat pipe)."""
    return WanProxy(target, Link(delay=one_way_delay_s))
