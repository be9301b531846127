"""``ClaimsView``: one process's view of the claims for a model, shared by all its requests (and by
its compute peer, which has it follow the gossip of its span's neighbourhood)."""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from collections.abc import Iterable

import trio

from shardnet.inference.claims import find_claims
from shardnet.inference.probes import Probes
from shardnet.protocols import block_claim as bc
from shardnet.transport.behaviour import Behaviour, random_phase
from shardnet.transport.node import Node

log = logging.getLogger(__name__)


#: seconds between background lookups of a view: gossip brings news in between (a claim's new
#: version), a lookup brings refreshed claims (a later expiry of the same version, which is not
#: gossiped) and any news a gossip mesh missed
REFRESH_S = 60.0
#: the least time between two lookups, however many requests ask for one
LOOKUP_GAP_S = 2.0
LOOKUP_TIMEOUT = 15.0
#: a followed range whose topic brought news from this many different peers within
#: ``CROWDED_WINDOW_S`` is crowded: the view leaves its topic for ``CROWDED_PAUSE_S`` and knows
#: the range from its lookups (a sample of its providers) and what it heard before, then follows
#: it again (docs/protocols.md, "Crowded ranges"). A topic's news grow with the peers whose
#: claims it carries; this bounds what a peer hears on one in a large swarm at about the news
#: of CROWDED_NEWS peers per CROWDED_WINDOW_S + CROWDED_PAUSE_S (a topic with fewer peers than
#: that is never left, however busy they are). Different peers, so that a small swarm's
#: burst (a dozen peers settling, each with news every few seconds) leaves no topic: placement
#: and routing then want every news
CROWDED_NEWS = 16
CROWDED_WINDOW_S = 120.0
CROWDED_PAUSE_S = 600.0
#: a view looks up again this long before the first of its claims expires (if that comes before
#: its next lookup), and no sooner than MIN_EXPIRY_LOOKUP_S after the last: a dead peer's claim
#: costs at most a lookup or two before it expires
EXPIRY_MARGIN_S = 30.0
MIN_EXPIRY_LOOKUP_S = 60.0


class ClaimsView:
    """The claims for one model as this process knows them, kept fresh in the background
    (``ClaimsView.of(node, model_id, probes, num_layers=...)``; one per node and model, shared by
    every client and the node's compute peer).

    A request reads the view instead of looking the claims up itself: lookups cost DHT requests
    that compute peers rate-limit per peer (``dht_requests_per_peer``), so a request per lookup
    had concurrent requests refused and their empty answers read as "nothing is served". The view
    looks up every ``REFRESH_S`` and when a request finds no route (``kick``; one lookup at a time
    and at most one per ``LOOKUP_GAP_S``, whoever asks); a lookup covers every layer range of the
    model. Between lookups it takes the claims published on the gossip topics of the layer ranges
    it follows (``follow``: a compute peer follows its span's neighbourhood,
    ``block_claim.neighbourhood``, and follows again when its span changes; a gateway's view
    follows every range, ``follow_all``; a Python client's follows none and relies on its
    lookups; news only: docs/protocols.md), leaving a crowded range's topic for a while
    (news from ``CROWDED_NEWS`` peers within ``CROWDED_WINDOW_S``). A
    lookup only adds: a peer's claim is replaced by a newer one (a higher version, or the same one
    expiring later) and dropped when it expires, so a refused or failed lookup keeps the last
    known view. Whether a claim's peer is alive is the prober's business (probes.py); a new
    version of a peer's claim clears its probe verdict (a peer that restarted and claimed again
    is probed afresh, not taken for dead) and gives the node its addresses (it may listen on
    another port now): ``probes`` are the node's. Used by clients (routing) and compute peers
    (placement)."""

    def __init__(self, node: Node, model_id: str, probes: Probes, owner: ClaimsViews | None = None,
                 refresh_s: float = REFRESH_S, *, num_layers: int) -> None:
        self.node, self.model_id = node, model_id
        #: the model's layers, which its layer ranges (lookups, gossip topics) are cut from
        self.num_layers = num_layers
        #: seconds between background lookups (the least any user of the view asked for)
        self.refresh_s = refresh_s
        self.probes = probes
        self._owner = owner  # whose nursery the background work runs in
        self._table = bc.ClaimTable(model_id)  # which claims are kept: the protocol's rules
        self.lookups = 0  # finished
        self.first_lookup = trio.Event()  # set once a lookup has finished, found or not
        self.last_lookup_error: str | None = None
        self.from_gossip = 0  # claims taken from gossip
        #: the layer ranges whose gossip topics the view follows (``follow``)
        self.following: frozenset[int] = frozenset()
        #: followed ranges whose topics it left for being crowded: range -> trio time it follows again
        self.paused: dict[int, float] = {}
        #: whether it leaves crowded ranges' topics for a while (a compute peer's view does; a
        #: gateway's, following every range, does not), when a range counts as crowded, and for
        #: how long the view then leaves it
        self.leave_crowded = True
        self.crowded_news, self.crowded_window_s, self.crowded_pause_s = \
            CROWDED_NEWS, CROWDED_WINDOW_S, CROWDED_PAUSE_S
        self._topics: dict[int, trio.CancelScope] = {}  # the ranges subscribed to while running
        self._nursery: trio.Nursery | None = None
        self._changed = trio.Event()
        self._kick = trio.Event()
        self._last_lookup = -LOOKUP_GAP_S
        self._refreshed: set[str] = set()  # the peers that answered the last lookup themselves
        self._running = False

    @classmethod
    def of(cls, node: Node, model_id: str, probes: Probes, *, num_layers: int,
           refresh_s: float = REFRESH_S) -> ClaimsView:
        """The node's view of ``model_id`` (its ``ClaimsViews`` behaviour, made on first use),
        looking the claims up at least every ``refresh_s``."""
        view = node.ensure_behaviour(ClaimsViews, lambda: ClaimsViews(node, probes)).view(model_id, num_layers)
        view.refresh_s = min(view.refresh_s, refresh_s)
        return view

    def start(self) -> None:
        """Start the background work, in the node's ``ClaimsViews`` behaviour (no-op if running
        or if the view belongs to no node behaviour)."""
        if not self._running and self._owner is not None:
            self._running = True
            self._owner.spawn(self._run)

    def follow(self, ranges: Iterable[int], *, leave_crowded: bool = True) -> None:
        """From now on take the news gossiped on these layer ranges' topics (indices into
        ``block_claim.layer_ranges(num_layers)``), and on no others; subscribed to while the view
        runs. ``leave_crowded``: leave a crowded range's topic for a while (``CROWDED_NEWS``)."""
        self.following = frozenset(ranges)
        self.leave_crowded = leave_crowded
        if not leave_crowded:  # the ranges it left for being crowded: followed again now
            for index in [i for i in self.paused if i in self._topics]:
                self._topics.pop(index).cancel()
        self._subscribe()

    def follow_all(self) -> None:
        """Follow every layer range's topic, crowded or not: a gateway routes through all of them,
        and hearing every news keeps each peer's load in its view fresh (at 8 gateways, what they
        hear adds little per compute peer: each news reaches each gateway once per mesh link,
        docs/scale.md)."""
        self.follow(range(len(bc.layer_ranges(self.num_layers))), leave_crowded=False)

    def _subscribe(self) -> None:
        if self._nursery is None:
            return
        for index in [i for i in self._topics if i not in self.following]:
            self._topics.pop(index).cancel()
        for index in sorted(self.following - self._topics.keys()):
            self._topics[index] = scope = trio.CancelScope()
            self._nursery.start_soon(self._gossip, index, scope)

    @property
    def running(self) -> bool:
        return self._running

    def current(self) -> list[bc.Claim]:
        """The unexpired claims, one per peer."""
        return self._table.current(time.time())

    def get(self, peer: str) -> bc.Claim | None:
        return self._table.get(peer)

    def note(self, claim: bc.Claim) -> bool:
        """Take a verified claim; True when it is new or newer than what we had for its peer."""
        old = self._table.get(claim.peer)
        if not self._table.note(claim, time.time()):
            return False
        if old is not None and claim.seq and claim.seq == old.seq:
            return True  # a refresh: the same news, expiring later
        self.node.learn_addrs(claim.peer, claim.addrs, max(1.0, claim.expires - time.time()))
        if old is not None:
            self.probes.forget(claim.peer)
        self._changed.set()
        self._changed = trio.Event()
        return True

    def kick(self) -> None:
        """Ask for a lookup soon (a request found no route)."""
        self._kick.set()

    async def wait_changed(self, timeout: float) -> None:
        """Until a claim changes or a lookup finishes, at most ``timeout`` seconds."""
        with trio.move_on_after(max(0.0, timeout)):
            await self._changed.wait()

    async def lookup(self, timeout: float = LOOKUP_TIMEOUT) -> None:
        """One lookup through the DHT (and direct requests), merged into the view."""
        self._last_lookup = trio.current_time()
        try:
            answered: set[str] = set()
            found = await find_claims(self.node, self.model_id, num_layers=self.num_layers, timeout=timeout,
                                      answered=answered)
            self.last_lookup_error = None if found else "the last lookup found no claims"
        except Exception as e:  # whatever it was, the view (and the node it runs in) carries on
            found = []
            self.last_lookup_error = f"the last lookup failed: {e}"
            log.info("claims lookup failed (keeping the %d claims known): %s: %s", len(self._table),
                     type(e).__name__, e)
        for c in found:
            self.note(c)
        if found:  # (a failed lookup keeps the last set: it says nothing of who is live)
            # the peers that answered themselves: a claim read from the DHT may be a gone peer's
            self._refreshed = {c.peer for c in found if c.peer in answered}
        self.lookups += 1
        self.first_lookup.set()
        self._changed.set()
        self._changed = trio.Event()

    def next_lookup_in(self, *, first: bool = False) -> float:
        """Seconds from a lookup to the next: ``refresh_s``, the first time a random share of it
        (a node that just started looks again soon; nodes started together do not look together
        ever after), and sooner when the claim of a peer that answered the last lookup itself
        expires before then (``EXPIRY_MARGIN_S`` ahead of it, at least ``MIN_EXPIRY_LOOKUP_S``
        on): claims of peers of dissemination 2 live 600 s and are refreshed only by lookups. (A
        claim of a peer that did not answer, read from the DHT or held from before, is its
        peer's last: the peer is gone or silent, and a lookup would not keep it.)"""
        wait = random_phase(self.refresh_s) if first else self.refresh_s
        now = time.time()
        earliest = min((c.expires for c in self.current() if c.peer in self._refreshed), default=math.inf)
        return min(wait, max(MIN_EXPIRY_LOOKUP_S, earliest - EXPIRY_MARGIN_S - now))

    async def _run(self) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self._subscribe()
                first = True
                while True:
                    await self.lookup()
                    with trio.move_on_after(self.next_lookup_in(first=first)):
                        await self._kick.wait()
                    first = False
                    self._kick = trio.Event()
                    await trio.sleep(max(0.0, self._last_lookup + LOOKUP_GAP_S - trio.current_time()))
        finally:
            self._nursery = None
            self._topics.clear()
            self._running = False

    async def _gossip(self, index: int, scope: trio.CancelScope) -> None:
        """Take the claims gossiped on one layer range's topic, until ``scope`` is cancelled."""
        def valid(data: bytes) -> bool:
            # a claim belongs on the topic of the range holding its first layer (or that of the span it loads)
            try:
                c = bc.decode(data)
            except bc.ClaimError:
                return False
            return c.model == self.model_id and index in bc.claim_ranges(c, self.num_layers)

        try:
            with scope:
                while True:
                    try:
                        crowded = await self._follow(index, valid)
                    except Exception as e:  # the view still has its lookups; the node carries on
                        log.info("following claims of range %d on gossip failed (again in %g s): %s: %s", index,
                                 REFRESH_S, type(e).__name__, e)
                        crowded = False
                    if not crowded:
                        await trio.sleep(REFRESH_S)
                        continue
                    log.info("claims of range %d: news from %d peers within %g s, the topic is crowded: leaving it for "
                             "%g s (the view's lookups cover the range)", index, self.crowded_news,
                             self.crowded_window_s, self.crowded_pause_s)
                    self.paused[index] = trio.current_time() + self.crowded_pause_s
                    await trio.sleep(self.crowded_pause_s)
                    del self.paused[index]
        finally:
            self.paused.pop(index, None)

    async def _follow(self, index: int, valid) -> bool:
        """Take one range's news until its topic is crowded (True) or the subscription ends."""
        recent: OrderedDict[str, float] = OrderedDict()  # publisher -> its last news, oldest first
        async with self.node.pubsub.subscribe(bc.range_topic(self.model_id, index), validate=valid) as sub:
            async for msg in sub:
                try:
                    claim = bc.decode(msg.data)
                except bc.ClaimError:
                    continue
                if self.note(claim):
                    self.from_gossip += 1
                now = trio.current_time()
                recent.pop(claim.peer, None)
                recent[claim.peer] = now
                while next(iter(recent.values())) < now - self.crowded_window_s:
                    recent.popitem(last=False)
                if self.leave_crowded and len(recent) >= self.crowded_news:
                    return True
        return False


class ClaimsViews(Behaviour):
    """A node behaviour: the node's claims views, one per model; their background lookups and
    gossip subscriptions run in its nursery. ``probes``: the node's, which every view tells of
    newer claims."""

    def __init__(self, node: Node, probes: Probes) -> None:
        self.node = node
        self.probes = probes
        self.views: dict[str, ClaimsView] = {}

    def view(self, model_id: str, num_layers: int) -> ClaimsView:
        v = self.views.get(model_id)
        if v is None:
            v = self.views[model_id] = ClaimsView(self.node, model_id, self.probes, self, refresh_s=math.inf,
                                                  num_layers=num_layers)
        return v
