"""gossipsub for overlay-wide topics, with settings that do not drop messages silently.

py-libp2p 0.8.1's defaults: a 120 s heartbeat (meshes form and repair two minutes late), a spam
limit of 10 messages per second per peer and topic (legitimate bursts vanish), and 32-message
subscriber queues (see compat.py). Here: 1 s heartbeat, a configurable ceiling far above any
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


class PubSub:
    def __init__(self, pubsub: Pubsub, router: GossipSub) -> None:
        self.raw = pubsub
        self.router = router

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
            yield cls(pubsub, router)

    async def publish(self, topic: str, data: bytes) -> None:
        if len(data) > MAX_MESSAGE_BYTES:
            raise ShardnetError(f"pubsub message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
        with trio.move_on_after(10) as scope:
            await self.raw.publish(topic, data)
        if scope.cancelled_caught:
            raise OverlayTimeout(f"publishing to {topic!r} timed out")

    @asynccontextmanager
    async def subscribe(self, topic: str) -> AsyncIterator[Subscription]:
        raw = await self.raw.subscribe(topic)
        try:
            yield Subscription(topic, raw)
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(5):
                try:
                    await self.raw.unsubscribe(topic)
                except Exception as e:
                    log.debug("unsubscribe %s: %s", topic, e)

    def topic_peers(self, topic: str) -> list[ID]:
        """Peers we know to be subscribed to ``topic``."""
        return list(self.raw.peer_topics.get(topic, ()))
