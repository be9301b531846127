"""``ClaimPublisher``: keeps one compute peer's block claim fresh in the DHT and on the gossip topic,
and answers direct requests for it."""

from __future__ import annotations

import logging
import time

import cbor2
import trio

from shardnet.inference.claims import CLAIM_TTL, claim_record_name, provider_name
from shardnet.protocols import block_claim as bc
from shardnet.transport.behaviour import Behaviour
from shardnet.transport.node import Node
from shardnet.transport.stream import Stream

log = logging.getLogger(__name__)


class ClaimPublisher(Behaviour):
    """A node behaviour: keeps one peer's claim fresh in the DHT and on the gossip topic, and
    answers requests. Ready once the first claim is out (``node.add_behaviour`` returns then)."""

    def __init__(self, node: Node, claim_fn, *, ttl: float = CLAIM_TTL) -> None:
        self.node = node
        self.claim_fn = claim_fn  # (expires) -> Claim, built fresh each round (span, addresses, load)
        self.ttl = ttl
        self.current: bytes | None = None
        self._wake = trio.Event()
        node.set_stream_handler(bc.PROTOCOL_ID, self._answer)

    def refresh(self) -> None:
        """Publish again now (the span or what the claim reports changed)."""
        self._wake.set()

    async def _answer(self, stream: Stream) -> None:
        await stream.write(cbor2.dumps([self.current] if self.current else []))

    async def run(self, node: Node | None = None, *, ttl: float | None = None,
                  task_status=trio.TASK_STATUS_IGNORED) -> None:
        """As a behaviour (``run(node, task_status=...)``), or on its own (``run(ttl=...)``)."""
        if ttl is not None:
            self.ttl = ttl
        await super().run(node or self.node, task_status=task_status)

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        ttl = self.ttl
        first = True
        while True:
            claim = self.claim_fn(time.time() + ttl)
            self.current = bc.encode(self.node.key_pair, claim)
            blob = self.current
            for what, publish in (("DHT record", lambda: self.node.dht.put(claim_record_name(claim.model), blob)),
                                  ("provider record", lambda: self.node.dht.provide(provider_name(claim.model))),
                                  ("gossip", lambda: self.node.pubsub.publish(bc.topic(claim.model), blob))):
                try:
                    await publish()
                except Exception as e:  # best effort; the next round retries
                    log.info("publishing claim (%s) failed: %s", what, e)
            if first:
                log.info("claimed layers %d:%d of model %s…", claim.start, claim.end, claim.model[:16])
                task_status.started()
                first = False
            # again after a third of the TTL, or at once when our relay addresses or span change
            relay_client = self.node.relay_client
            events = [self._wake] if relay_client is None else [relay_client.changed, self._wake]
            with trio.move_on_after(ttl / 3):
                async with trio.open_nursery() as nursery:
                    for event in events:
                        nursery.start_soon(_wait_then_cancel, event, nursery.cancel_scope)
            self._wake = trio.Event()


async def _wait_then_cancel(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()
