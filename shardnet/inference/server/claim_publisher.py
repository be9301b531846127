"""``ClaimPublisher``: keeps one compute peer's block claim fresh in the DHT and on the gossip topic
of the layer range holding its first layer, and answers direct requests for it."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from functools import partial

import cbor2
import trio

from shardnet.inference.claims import CLAIM_TTL, claim_record_name, range_provider_name
from shardnet.protocols import block_claim as bc
from shardnet.transport.behaviour import Behaviour, random_phase, wait_any
from shardnet.transport.node import Node
from shardnet.transport.stream import Stream

log = logging.getLogger(__name__)

#: seconds between two provider records of the same ranges: Kademlia's hourly republication (a
#: record lives 48 h, py-libp2p's PROVIDER_RECORD_TTL; a range's key that a peer left names it
#: until then, and a lookup finds its current claim elsewhere). Providing with every refresh of
#: the claim (every 200 s) was a walk and 20 stores per range, half a small swarm's DHT work
PROVIDE_REFRESH_S = 3600.0
#: the least seconds between two DHT puts of the claim: news goes on gossip at once, and into the
#: DHT once this long has passed since the last put (a peer settling has news every few seconds,
#: and a put is a walk and 20 stores; the DHT record is read only when a peer does not answer)
NEWS_PUT_GAP_S = 30.0
#: the label of the DHT put among a look's publication steps (a failed one is put again)
PUT_STEP = "DHT record"
#: a news gossiped on a topic before this node knew any follower of it (a peer just started: its
#: connections have not told it their subscriptions yet) reached nobody, and the topic's
#: followers heard of it only from a lookup. Such a topic is checked every UNHEARD_POLL_S for
#: this long, and the claim gossiped again there once a follower is known
UNHEARD_WATCH_S = 60.0
UNHEARD_POLL_S = 1.0


class ClaimPublisher(Behaviour):
    """A node behaviour: keeps one peer's claim fresh in the DHT and on the gossip topic of its
    layer range (``block_claim.claim_ranges``), and answers requests. Ready once the first claim
    is out (``node.add_behaviour`` returns then).

    The rules (docs/protocols.md, "Claim dissemination"): each time it looks (at ``refresh()``,
    when the relay addresses change, and every third of the TTL) it builds the claim anew; when
    that is news against the last claim it published (``block_claim.news``: another span,
    addresses, a step of load...) it raises the claim's version (``seq``) and publishes it on
    the topic of the layer range holding the claim's first layer (and that of the span it is loading)
    (``block_claim.range_topic``) and in the DHT, and provides those ranges' keys
    (``range_provider_name``) that it did not provide last; otherwise it only puts the same
    version, expiring later, in the DHT once a third of the TTL has passed since the last put
    (until the first refresh, a random share of that: ``behaviour.random_phase``).
    A news goes into the DHT no sooner than ``NEWS_PUT_GAP_S`` after the last put (at once when
    that has passed). A news gossiped on a topic while no follower of it was known (a peer just
    started) is gossiped there again once one is (``UNHEARD_WATCH_S``). Its ranges' keys are
    provided again every ``PROVIDE_REFRESH_S``. A direct
    request always gets the claim as built last, signed. ``num_layers``: the model's, which its ranges are cut from."""

    def __init__(self, node: Node, claim_fn, *, num_layers: int, ttl: float = CLAIM_TTL) -> None:
        self.node = node
        self.claim_fn = claim_fn  # (expires) -> Claim, built fresh each round (span, addresses, load)
        self.num_layers = num_layers
        self.ttl = ttl
        self.current: bytes | None = None
        #: the last claim published as news (its ``seq`` is the version others hold)
        self.published: bc.Claim | None = None
        #: publications so far: news (gossip and DHT) and refreshes (DHT only)
        self.counts = {"news": 0, "refresh": 0}
        #: the layer ranges provided since the provider records were last refreshed (their keys)
        self.provided: frozenset[int] = frozenset()
        self.provide_refresh_s = PROVIDE_REFRESH_S
        self._last_put = -math.inf  # trio time
        #: a put's refresh is due this share of a third of the TTL after it: 1, but until the
        #: first refresh a random share (``behaviour.random_phase``), so that peers started
        #: together do not all refresh together ever after
        self._refresh_share = random_phase(1.0)
        self._put_pending = False  # news not in the DHT yet (NEWS_PUT_GAP_S)
        self._last_provide = -math.inf
        #: range -> until when (trio time) its topic is watched for a first follower: the last
        #: news went out there while none was known (``UNHEARD_WATCH_S``)
        self._unheard: dict[int, float] = {}
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

    async def _gossip(self, model: str, index: int, blob: bytes) -> None:
        """The claim on range ``index``'s topic; watched for a first follower if none is known."""
        topic = bc.range_topic(model, index)
        followed = bool(self.node.pubsub.topic_peers(topic))
        await self.node.pubsub.publish(topic, blob)
        if followed:
            self._unheard.pop(index, None)
        else:
            self._unheard.setdefault(index, trio.current_time() + UNHEARD_WATCH_S)

    async def _watch_unheard(self, model: str, ranges, events: list[trio.Event]) -> None:
        """While a topic of ``ranges`` is watched (its news went out with no follower known),
        look every ``UNHEARD_POLL_S`` whether one is known now and gossip the current claim there
        (the same version: nothing is built or signed anew); returns once none is watched, or
        when one of ``events`` is set (``refresh``, relay addresses)."""
        while not any(e.is_set() for e in events):
            now = trio.current_time()
            self._unheard = {i: until for i, until in self._unheard.items() if i in ranges and until > now}
            if not self._unheard:
                return
            for i in [i for i in self._unheard if self.node.pubsub.topic_peers(bc.range_topic(model, i))]:
                try:
                    await self._gossip(model, i, self.current)
                except Exception as e:  # (best effort, as every publication: looked at again)
                    log.info("publishing claim (gossip on range %d again) failed: %s", i, e)
            with trio.move_on_after(UNHEARD_POLL_S):
                await wait_any(*events)

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        first = True
        while True:
            claim, reason = self.next_claim(time.time())
            self.current = blob = bc.encode(self.node.key_pair, claim)
            since_put = trio.current_time() - self._last_put
            refresh_due = since_put >= self.ttl / 3 * self._refresh_share
            ranges = bc.claim_ranges(claim, self.num_layers)
            steps = []  # news on gossip first (the peers following those ranges), then the DHT
            if reason is not None:
                for i in ranges:
                    steps.append((f"gossip on range {i}", partial(self._gossip, claim.model, i, blob), None))
                self.published = claim
                self.counts["news"] += 1
                log.debug("claim version %d published on ranges %s (%s)", claim.seq, ranges, reason)
            elif refresh_due:
                self.counts["refresh"] += 1
            self._put_pending = self._put_pending or reason is not None
            if refresh_due or (self._put_pending and since_put >= NEWS_PUT_GAP_S):
                steps.append((PUT_STEP, lambda: self.node.dht.put(claim_record_name(claim.model), blob), None))
                self._put_pending = False
                if refresh_due and self._last_put > -math.inf:
                    self._refresh_share = 1.0  # (the first put, news and retries keep the random share)
                self._last_put = trio.current_time()
            # every range's key hourly; else those of ranges new to the claim (a move, loading)
            provide_due = trio.current_time() - self._last_provide >= self.provide_refresh_s
            to_provide = ranges if provide_due else [i for i in ranges if i not in self.provided]
            for i in to_provide:
                steps.append((f"provider record of range {i}",
                              partial(self.node.dht.provide, range_provider_name(claim.model, i)), i))
            self.provided = frozenset(ranges) if provide_due else self.provided | set(to_provide)
            if provide_due:
                self._last_provide = trio.current_time()
            for what, publish, provided_range in steps:
                try:
                    await publish()
                except Exception as e:  # best effort: retried when the publisher looks again
                    log.info("publishing claim (%s) failed: %s", what, e)
                    if what is PUT_STEP:
                        self._put_pending = True  # again once NEWS_PUT_GAP_S has passed
                    elif provided_range is not None:
                        self.provided -= {provided_range}  # again at the next look, not in an hour
            if first:
                log.info("claimed layers %d:%d of model %s…", claim.start, claim.end, claim.model[:16])
                task_status.started()
                first = False
            # again when the next refresh is due, or at once when our relay addresses or span change
            relay_client = self.node.relay_client
            events = [self._wake] if relay_client is None else [relay_client.changed, self._wake]
            due = self._last_put + (NEWS_PUT_GAP_S if self._put_pending else self.ttl / 3 * self._refresh_share)
            with trio.move_on_after(max(0.0, due - trio.current_time())):
                await self._watch_unheard(claim.model, ranges, events)
                await wait_any(*events)
            self._wake = trio.Event()
