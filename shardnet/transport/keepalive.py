"""Keepalive: a node behaviour that closes connections whose keepalive ping went unanswered.

py-libp2p pings every connection every ``keepalive_interval`` s (the interval is set on the host,
``compat.set_keepalive_interval``); this behaviour watches the answers."""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import trio

from . import compat, identity
from .behaviour import Behaviour
from .config import NodeConfig

log = logging.getLogger(__name__)

#: the longest keepalive interval of an idle connection while this node is behind NAT (seconds)
PRIVATE_MAX_INTERVAL_S = 60.0
#: the keepalive behaviours of this process whose node is behind NAT (the interval is process-wide)
_PRIVATE: weakref.WeakSet = weakref.WeakSet()


@dataclass(frozen=True)
class KeepaliveStatus:
    timeout: float  # seconds a ping may go unanswered before its connection is closed
    closed: int  # connections closed so far because their ping went unanswered


class Keepalive(Behaviour):
    """Close connections whose keepalive ping went unanswered for ``keepalive_timeout``: the
    path died silently (NAT mapping gone, relay gone). Closing them is what lets bootstrap
    supervision redial, relay slots be reserved again and new streams pick a live path. Ready at
    once."""

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        #: whether this node is behind NAT (AutoNAT says private, or it holds relay slots it was
        #: given): its idle connections are then pinged at most every PRIVATE_MAX_INTERVAL_S
        self.private = False
        # py-libp2p sends the next ping 10 s + interval after an unanswered one, which resets
        # the age we watch: a longer timeout would never fire.
        self.timeout = min(config.keepalive_timeout, config.keepalive_interval + 9.0)
        #: connections closed because their keepalive went unanswered
        self.closed = 0

    def snapshot(self) -> KeepaliveStatus:
        return KeepaliveStatus(self.timeout, self.closed)

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        look_at = 0.0  # when the connections are looked at next
        while True:
            await trio.sleep(min(1.0, self.timeout / 4))
            self._mind_the_nat()
            if trio.current_time() >= look_at:
                look_at = trio.current_time() + await self._close_dead()

    async def _close_dead(self) -> float:
        """Close the connections whose ping went unanswered for longer than the timeout; return
        the seconds until another could: when the oldest ping still unanswered would pass it, or
        a whole timeout (a ping sent after this look is found at the look after next). Once a
        timeout rather than every second: going over every connection each second grew with
        the swarm."""
        wait = self.timeout
        for conn in list(self.node.host.get_network().get_connections()):
            age = compat.unanswered_ping_age(conn.muxed_conn)
            if age is None:
                continue
            if age <= self.timeout:
                wait = min(wait, self.timeout - age)
                continue
            peer = conn.muxed_conn.peer_id
            log.warning("connection to %s%s is dead (keepalive unanswered for %.0f s); closing it",
                        identity.short(peer), " (relayed)" if compat.swarm.is_relayed(conn) else "", age)
            self.closed += 1
            with trio.move_on_after(5):
                try:
                    await conn.close()
                except Exception as e:
                    log.debug("closing a dead connection: %s", e)
        return wait

    def _mind_the_nat(self) -> None:
        """Behind NAT, ping idle connections at most every ``PRIVATE_MAX_INTERVAL_S``: the NAT
        keeps an idle TCP mapping for minutes on some routers (RFC 5382 asks 2 h 4 min; not all
        comply), and it is our side's packets that keep it. A public node's idle connections
        go up to ``keepalive_max_interval`` (300 s). The interval is process-wide, so it is the
        short one while any node of the process is private (and set again if a node started
        since reset it); connections already asleep on the long one are woken."""
        autonat = self.node.autonat
        private = bool(self.config.relays) or (autonat is not None and autonat.status == "private")
        if private:
            _PRIVATE.add(self)
        else:
            _PRIVATE.discard(self)
        longest = self.config.keepalive_max_interval
        want = min(longest, PRIVATE_MAX_INTERVAL_S) if _PRIVATE else longest
        if private != self.private or (private and compat.yamux.QUIET_MAX_INTERVAL > want):
            self.private = private
            if compat.yamux.QUIET_MAX_INTERVAL != want:
                lower = want < compat.yamux.QUIET_MAX_INTERVAL
                compat.set_keepalive_interval(self.config.keepalive_interval, want)
                log.info("%s: idle connections pinged at most every %g s",
                         "behind NAT" if private else "reachable", want)
                if lower:  # loops asleep on the long interval take the short one now
                    for conn in self.node.host.get_network().get_connections():
                        compat.wake_keepalive(conn.muxed_conn)
