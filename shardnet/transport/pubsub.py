"""gossipsub for overlay-wide topics, with settings that do not drop messages silently.

py-libp2p 0.8.1's defaults: a 120 s heartbeat (meshes form and repair two minutes late), a spam
limit of 10 messages per second per peer and topic (legitimate bursts vanish), and 32-message
subscriber queues (see compat/pubsub.py). Here: 1 s heartbeat, a configurable ceiling far above any
honest rate, large queues, and a counter of anything still dropped.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import trio
from libp2p.peer.id import ID
from libp2p.pubsub.gossipsub import PROTOCOL_ID, PROTOCOL_ID_V11, GossipSub
from libp2p.pubsub.pubsub import Pubsub
from libp2p.tools.anyio_service import background_trio_service

from .config import NodeConfig
from .errors import OverlayTimeout, ShardnetError
from .limits import Refusals, TokenBuckets

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 1 << 20


@dataclass(frozen=True)
class Message:
    topic: str
    sender: ID
    data: bytes
    seqno: bytes


class Subscription:
    def __init__(self, topic: str, raw) -> None:
        self.topic = topic
        self._raw = raw

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> Message:
        try:
            msg = await self._raw.get()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise StopAsyncIteration from None
        return _convert(self.topic, msg)

    async def receive(self, *, timeout: float) -> Message:
        with trio.move_on_after(timeout):
            return await self.__anext__()
        raise OverlayTimeout(f"no message on {self.topic!r} within {timeout:g} s")


def _convert(topic: str, msg) -> Message:
    return Message(topic=topic, sender=ID(msg.from_id), data=bytes(msg.data), seqno=bytes(msg.seqno))


class Mutes:
    """Peers whose gossip keeps failing validation are muted for a while: py-libp2p's pubsub
    blacklist closes their gossip stream and refuses a new one, so their junk stops costing a
    parse and a signature check per message. An honest shardnet peer validates before it
    forwards, so it never relays junk."""

    def __init__(self, raw: Pubsub, limits) -> None:
        self.raw, self.limits = raw, limits
        self.invalid = TokenBuckets(limits.gossip_invalid_rate_per_peer, limits.gossip_invalid_burst_per_peer)
        self.until: dict[ID, float] = {}
        self.refusals = Refusals()

    def checker(self, validate):
        def check(forwarder, msg) -> bool:
            try:
                ok = bool(validate(bytes(msg.data)))
            except Exception:
                ok = False
            if not ok and not self.invalid.take(forwarder):
                self.mute(forwarder)
            return ok

        return check

    def mute(self, peer: ID) -> None:
        if peer in self.until:
            return
        self.until[peer] = trio.current_time() + self.limits.gossip_mute_s
        self.refusals.note("gossip_invalid", peer, f"limit gossip_invalid_rate_per_peer: muting {str(peer)[:16]}'s "
                                                   f"gossip for {self.limits.gossip_mute_s:g} s (invalid messages)")
        self.raw.add_to_blacklist(peer)  # closes our stream to it and refuses new ones
        self.raw.manager.run_task(self._reset_inbound, peer)

    async def _reset_inbound(self, peer: ID) -> None:
        """The blacklist leaves the peer's own stream to us open (and read, parsed, checked)."""
        for conn in self.raw.host.get_network().get_connections(peer):
            for stream in conn.get_streams():
                if str(stream.get_protocol() or "").startswith("/meshsub/"):
                    try:
                        await stream.reset()
                    except Exception:
                        pass

    async def run(self) -> None:
        while True:
            await trio.sleep(1.0)
            now = trio.current_time()
            for peer in [p for p, t in self.until.items() if t <= now]:
                del self.until[peer]
                self.raw.remove_from_blacklist(peer)


class PubSub:
    def __init__(self, pubsub: Pubsub, router: GossipSub, limits) -> None:
        self.raw = pubsub
        self.router = router
        self.mutes = Mutes(pubsub, limits)

    @classmethod
    @asynccontextmanager
    async def start(cls, host, config: NodeConfig) -> AsyncIterator[PubSub]:
        router = GossipSub(
            protocols=[PROTOCOL_ID_V11, PROTOCOL_ID],
            degree=6,
            degree_low=4,
            degree_high=12,
            heartbeat_interval=config.pubsub_heartbeat,
            heartbeat_initial_delay=0.1,
            max_messages_per_topic_per_second=config.pubsub_max_msgs_per_topic_per_s,
        )
        pubsub = Pubsub(host, router, max_inbound_rpc_size=MAX_MESSAGE_BYTES + 4096)
        async with background_trio_service(pubsub), background_trio_service(router):
            with trio.move_on_after(10):
                await pubsub.wait_until_ready()
            self = cls(pubsub, router, config.limits)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self.mutes.run)
                yield self
                nursery.cancel_scope.cancel()

    async def publish(self, topic: str, data: bytes) -> None:
        if len(data) > MAX_MESSAGE_BYTES:
            raise ShardnetError(f"pubsub message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
        with trio.move_on_after(10) as scope:
            await self.raw.publish(topic, data)
        if scope.cancelled_caught:
            raise OverlayTimeout(f"publishing to {topic!r} timed out")

    @asynccontextmanager
    async def subscribe(self, topic: str, validate=None) -> AsyncIterator[Subscription]:
        """Messages on ``topic``. With ``validate`` (data -> bool), a message it rejects is
        neither delivered nor forwarded: junk on a topic stops at the first peer that checks it
        instead of crossing the whole mesh."""
        if validate is not None:
            self.raw.set_topic_validator(topic, self.mutes.checker(validate), False)
        raw = await self.raw.subscribe(topic)
        try:
            yield Subscription(topic, raw)
        finally:
            if validate is not None:
                self.raw.remove_topic_validator(topic)
            with trio.CancelScope(shield=True), trio.move_on_after(5):
                try:
                    await self.raw.unsubscribe(topic)
                except Exception as e:
                    log.debug("unsubscribe %s: %s", topic, e)

    def topic_peers(self, topic: str) -> list[ID]:
        """Peers we know to be subscribed to ``topic``."""
        return list(self.raw.peer_topics.get(topic, ()))
