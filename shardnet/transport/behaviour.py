"""Node behaviours: the services a node runs, composed instead of built into it (rust-libp2p's
NetworkBehaviour idea, in trio's style).

A behaviour is any object with ``async def run(self, node, *, task_status)``: it registers its
stream handlers and subscriptions, calls ``task_status.started()`` once it is ready (what ready
means is its own business: the relay client, for instance, once it holds its first slot), then
serves until cancelled. The node starts each one with ``await nursery.start(...)`` in its own
nursery, in order, and finds them by type (``node.behaviour(Cls)``). Background work a behaviour
needs runs in its own ``run``, never in a borrowed nursery. A behaviour may offer ``snapshot()``:
a small frozen dataclass of what it knows, which ``Node.status`` (and ``nat_status``) read instead
of its internals.

Node-wide state with no work of its own is not a behaviour: the registry of behaviours holds
only things that run (the inference layer keeps its node-wide state in ``Node.inference``,
assembled by ``shardnet/inference/services.py``).

``Behaviour`` is an optional base: its ``run`` gives the behaviour a nursery of its own
(``spawn``) and serves forever; a subclass overrides ``attach`` (register handlers) and
``serve`` (its own readiness and loop).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar, runtime_checkable

import trio

log = logging.getLogger(__name__)

B = TypeVar("B")


@runtime_checkable
class NodeBehaviour(Protocol):
    """What ``open_node(behaviours=[...])`` and ``Node.add_behaviour`` accept."""

    async def run(self, node: Any, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None: ...


class Behaviour:
    """A base for behaviours: ``attach`` (once, before serving), a nursery of its own for
    background work (``spawn``), and ``serve`` (ready at once and idle, unless overridden)."""

    node: Any = None
    _tasks: trio.Nursery | None = None
    _pending: list[tuple[Callable[..., Awaitable[Any]], tuple]] | None = None
    _stopped = False

    def attach(self, node: Any) -> None:
        """Register handlers on ``node`` (synchronous: a caller may use the behaviour at once)."""
        self.node = node

    async def run(self, node: Any, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        if self.node is None:
            self.attach(node)
        try:
            async with trio.open_nursery() as nursery:
                self._tasks = nursery
                for fn, args in self._pending or ():
                    nursery.start_soon(fn, *args)
                self._pending = None
                await self.serve(task_status=task_status)
                nursery.cancel_scope.cancel()  # serve returned: so does the behaviour's work
        finally:
            self._tasks = None
            self._stopped = True

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Ready at once; then nothing but the spawned work, until cancelled."""
        task_status.started()
        await trio.sleep_forever()

    def spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Run ``fn(*args)`` in the behaviour's own nursery (queued until ``run`` starts it;
        dropped once the behaviour has stopped: its work ends with it)."""
        if self._tasks is not None:
            self._tasks.start_soon(fn, *args)
        elif not self._stopped:
            if self._pending is None:
                self._pending = []
            self._pending.append((fn, args))
        else:
            log.debug("%s has stopped; not starting %s", type(self).__name__, getattr(fn, "__name__", fn))


def random_phase(period: float) -> float:
    """Seconds to the first round of a duty that then runs every ``period``: a random 5-100 % of
    it. Nodes started together (a swarm restarted, a test, a benchmark) would otherwise do it
    together ever after; with a random phase their rounds spread over the period, and a window
    shorter than the period sees each at its long-run rate on average."""
    return period * random.uniform(0.05, 1.0)


async def wait_any(*events: trio.Event) -> None:
    """Until any of ``events`` is set."""
    async with trio.open_nursery() as nursery:
        async def wait_then_cancel(event: trio.Event) -> None:
            await event.wait()
            nursery.cancel_scope.cancel()

        for event in events:
            nursery.start_soon(wait_then_cancel, event)
