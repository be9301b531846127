"""``ClaimPublisher``: keeps one compute peer's block claim fresh in the DHT and on the gossip topic,
and answers direct requests for it."""

from __future__ import annotations

import dataclasses
import logging
import math
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
    answers requests. Ready once the first claim is out (``node.add_behaviour`` returns then).

    The rules (docs/protocols.md, "Claim dissemination"): each time it looks (at ``refresh()``,
    when the relay addresses change, and every third of the TTL) it builds the claim anew; when
    that is news against the last claim it published (``block_claim.news``: another span,
    addresses, a step of load...) it raises the claim's version (``seq``) and publishes it on
    gossip and in the DHT; otherwise it only puts the same version, expiring later, in the DHT
    once a third of the TTL has passed since the last put (and announces itself as a provider
    again then). A direct request always gets the claim as built last, signed."""

    def __init__(self, node: Node, claim_fn, *, ttl: float = CLAIM_TTL) -> None:
        self.node = node
        self.claim_fn = claim_fn  # (expires) -> Claim, built fresh each round (span, addresses, load)
        self.ttl = ttl
        self.current: bytes | None = None
        #: the last claim published as news (its ``seq`` is the version others hold)
        self.published: bc.Claim | None = None
        #: publications so far: news (gossip and DHT) and refreshes (DHT only)
        self.counts = {"news": 0, "refresh": 0}
        self._last_put = -math.inf  # trio time
        self._wake = trio.Event()
        node.set_stream_handler(bc.PROTOCOL_ID, self._answer)

    def refresh(self) -> None:
        """Look again now (the span or what the claim reports may have changed): published if news."""
        self._wake.set()

    async def _answer(self, stream: Stream) -> None:
        await stream.write(cbor2.dumps([self.current] if self.current else []))

    async def run(self, node: Node | None = None, *, ttl: float | None = None,
                  task_status=trio.TASK_STATUS_IGNORED) -> None:
        """As a behaviour (``run(node, task_status=...)``), or on its own (``run(ttl=...)``)."""
        if ttl is not None:
            self.ttl = ttl
        await super().run(node or self.node, task_status=task_status)

    def next_claim(self, now: float) -> tuple[bc.Claim, str | None]:
        """The claim to hold now and why it is news (None: it is not), its version set."""
        fresh = self.claim_fn(now + self.ttl)
        reason = bc.news(self.published, fresh)
        seq = self.published.seq if self.published is not None else 0
        if reason is not None:
            seq = max(seq + 1, int(now * 1000))  # a restarted peer's versions go on rising too
        return dataclasses.replace(fresh, seq=seq), reason

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        first = True
        while True:
            claim, reason = self.next_claim(time.time())
            self.current = blob = bc.encode(self.node.key_pair, claim)
            refresh_due = trio.current_time() - self._last_put >= self.ttl / 3
            steps = []
            if reason is not None or refresh_due:
                steps.append(("DHT record", lambda: self.node.dht.put(claim_record_name(claim.model), blob)))
            if refresh_due:
                steps.append(("provider record", lambda: self.node.dht.provide(provider_name(claim.model))))
            if reason is not None:
                steps.append(("gossip", lambda: self.node.pubsub.publish(bc.topic(claim.model), blob)))
                self.published = claim
                self.counts["news"] += 1
                log.debug("claim version %d published (%s)", claim.seq, reason)
            elif refresh_due:
                self.counts["refresh"] += 1
            if steps:
                self._last_put = trio.current_time()
            for what, publish in steps:
                try:
                    await publish()
                except Exception as e:  # best effort; the next round retries
                    log.info("publishing claim (%s) failed: %s", what, e)
            if first:
                log.info("claimed layers %d:%d of model %s…", claim.start, claim.end, claim.model[:16])
                task_status.started()
                first = False
            # again when the next refresh is due, or at once when our relay addresses or span change
            relay_client = self.node.relay_client
            events = [self._wake] if relay_client is None else [relay_client.changed, self._wake]
            with trio.move_on_after(max(0.0, self._last_put + self.ttl / 3 - trio.current_time())):
                async with trio.open_nursery() as nursery:
                    for event in events:
                        nursery.start_soon(_wait_then_cancel, event, nursery.cancel_scope)
            self._wake = trio.Event()


async def _wait_then_cancel(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()
