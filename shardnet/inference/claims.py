"""Publishing and finding block claims (through the DHT, gossipsub and direct requests), and
``ClaimsView``: one process's view of the claims for a model, shared by all its requests."""

from __future__ import annotations

import logging
import time

import cbor2
import trio

from shardnet.protocols import block_claim as bc
from shardnet.transport.errors import ShardnetError
from shardnet.transport.node import Node
from shardnet.transport.stream import Stream

from .probes import Probes

log = logging.getLogger(__name__)

CLAIM_TTL = 120.0
MAX_CLAIMS_PER_REPLY = 16


class NoRouteError(ShardnetError):
    """No set of live claims covers every layer."""


def claim_record_name(model_id: str) -> str:
    return f"claim/{model_id}"


def provider_name(model_id: str) -> str:
    return f"model/{model_id}"


class ClaimPublisher:
    """Keeps one peer's claim fresh in the DHT and on the gossip topic, and answers requests."""

    def __init__(self, node: Node, claim_fn) -> None:
        self.node = node
        self.claim_fn = claim_fn  # (expires) -> Claim, built fresh each round (span, addresses, load)
        self.current: bytes | None = None
        self._wake = trio.Event()
        node.set_stream_handler(bc.PROTOCOL_ID, self._answer)

    def refresh(self) -> None:
        """Publish again now (the span or what the claim reports changed)."""
        self._wake.set()

    async def _answer(self, stream: Stream) -> None:
        await stream.write(cbor2.dumps([self.current] if self.current else []))

    async def run(self, *, ttl: float = CLAIM_TTL, task_status=trio.TASK_STATUS_IGNORED) -> None:
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
            with trio.move_on_after(ttl / 3):
                async with trio.open_nursery() as nursery:
                    for event in (self.node.relay_client.changed, self._wake):
                        nursery.start_soon(_wait_then_cancel, event, nursery.cancel_scope)
            self._wake = trio.Event()


async def _wait_then_cancel(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


# Round trips are the least of a few pings: one sample can land behind a busy moment at either
# end (a loaded event loop adds tens of ms), and routing compares them across peers.
RTT_SAMPLES = 3


async def live_claims(node: Node, claims: list[bc.Claim], *, timeout: float = 3.0) -> list[bc.Claim]:
    """The claims whose peers answer a ping now (a claim outlives its peer until it expires)."""
    pings = await node.ping_many([c.peer for c in claims], timeout=timeout)
    for peer, p in pings.items():
        if p.rtt is None:
            log.debug("claim of %s ignored: no answer to a ping (%s)", peer[:16], p.error)
    return [c for c in claims if pings[c.peer].rtt is not None]


async def fetch_claims(node: Node, peer: str, *, timeout: float = 10.0) -> list[bc.Claim]:
    """Ask one peer directly for its current claims."""
    async with await node.new_stream(peer, bc.PROTOCOL_ID, timeout=timeout) as s:
        data = b""
        with trio.fail_after(timeout):
            while chunk := await s.read_some(65536, timeout=timeout):
                data += chunk
                if len(data) > MAX_CLAIMS_PER_REPLY * bc.MAX_CLAIM_BYTES:
                    raise ShardnetError("claim reply too large")
    blobs = cbor2.loads(data) if data else []
    out = []
    for blob in blobs[:MAX_CLAIMS_PER_REPLY] if isinstance(blobs, list) else []:
        try:
            c = bc.decode(blob)
        except bc.ClaimError as e:
            log.info("ignoring claim from %s: %s", peer[:16], e)
            continue
        if c.peer == peer:
            out.append(c)
    return out


async def find_claims(node: Node, model_id: str, *, timeout: float = 15.0) -> list[bc.Claim]:
    """Every live claim for ``model_id`` that the DHT knows of, verified."""
    claims: dict[str, bc.Claim] = {}
    with trio.move_on_after(timeout):
        providers = await node.dht.find_providers(provider_name(model_id), count=64)

        async def one(info) -> None:
            pid = str(info.peer_id)
            if info.addrs:
                node.host.get_peerstore().add_addrs(info.peer_id, info.addrs, 600)
            try:
                blob = await node.dht.get(pid, claim_record_name(model_id))
                got = [bc.decode(blob)] if blob else []
            except (ShardnetError, bc.ClaimError) as e:
                log.debug("DHT claim of %s: %s", pid[:16], e)
                got = []
            if not got:
                try:
                    got = await fetch_claims(node, pid, timeout=timeout / 2)
                except (ShardnetError, trio.TooSlowError) as e:
                    log.debug("direct claim request to %s: %s", pid[:16], e)
            for c in got:
                if c.model == model_id and c.peer == pid:
                    claims[c.peer] = c

        async with trio.open_nursery() as nursery:
            for info in providers:
                nursery.start_soon(one, info)
    return list(claims.values())


#: seconds between background lookups of a view (gossip brings changes in between)
REFRESH_S = 10.0
#: the least time between two lookups, however many requests ask for one
LOOKUP_GAP_S = 2.0
LOOKUP_TIMEOUT = 15.0


class ClaimsView:
    """The claims for one model as this process knows them, kept fresh in the background
    (``ClaimsView.of(node, model_id)``; one per node and model, shared by every client).

    A request reads the view instead of looking the claims up itself: lookups cost DHT requests
    that compute peers rate-limit per peer (``dht_requests_per_peer``), so a request per lookup
    had concurrent requests refused and their empty answers read as "nothing is served". The view
    looks up every ``REFRESH_S`` and when a request finds no route (``kick``; one lookup at a time
    and at most one per ``LOOKUP_GAP_S``, whoever asks), and takes every claim published on the
    model's gossip topic as it arrives. A lookup only adds: a peer's claim is replaced by a newer
    one (later expiry) and dropped when it expires, so a refused or failed lookup keeps the last
    known view. Whether a claim's peer is alive is the prober's business (probes.py); a newer
    claim from a peer clears its probe verdict (a peer that restarted and claimed again is
    probed afresh, not taken for dead)."""

    def __init__(self, node: Node, model_id: str) -> None:
        self.node, self.model_id = node, model_id
        self._claims: dict[str, bc.Claim] = {}
        self.lookups = 0  # finished
        self.first_lookup = trio.Event()  # set once a lookup has finished, found or not
        self.last_lookup_error: str | None = None
        self.from_gossip = 0  # claims taken from gossip
        self._changed = trio.Event()
        self._kick = trio.Event()
        self._last_lookup = -LOOKUP_GAP_S
        self._running = False

    @classmethod
    def of(cls, node: Node, model_id: str) -> ClaimsView:
        views = getattr(node, "_shardnet_claims_views", None)
        if views is None:
            views = node._shardnet_claims_views = {}
        view = views.get(model_id)
        if view is None:
            view = views[model_id] = cls(node, model_id)
        return view

    def start(self) -> None:
        """Start the background work in the node's nursery (no-op if running or no nursery)."""
        if not self._running and self.node.nursery is not None:
            self._running = True
            self.node.nursery.start_soon(self._run)

    @property
    def running(self) -> bool:
        return self._running

    def current(self) -> list[bc.Claim]:
        """The unexpired claims, one per peer."""
        now = time.time()
        for peer in [p for p, c in self._claims.items() if c.expires <= now]:
            del self._claims[peer]
        return list(self._claims.values())

    def get(self, peer: str) -> bc.Claim | None:
        return self._claims.get(peer)

    def note(self, claim: bc.Claim) -> bool:
        """Take a verified claim; True when it is new or newer than what we had for its peer."""
        if claim.model != self.model_id or claim.expires <= time.time():
            return False
        old = self._claims.get(claim.peer)
        if old is not None and claim.expires <= old.expires:
            return False
        self._claims[claim.peer] = claim
        if old is not None:
            Probes.of(self.node).forget(claim.peer)
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
            found = await find_claims(self.node, self.model_id, timeout=timeout)
            self.last_lookup_error = None if found else "the last lookup found no claims"
        except Exception as e:  # whatever it was, the view (and the node it runs in) carries on
            found = []
            self.last_lookup_error = f"the last lookup failed: {e}"
            log.info("claims lookup failed (keeping the %d claims known): %s: %s", len(self._claims),
                     type(e).__name__, e)
        for c in found:
            self.note(c)
        self.lookups += 1
        self.first_lookup.set()
        self._changed.set()
        self._changed = trio.Event()

    async def _run(self) -> None:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._gossip)
                while True:
                    await self.lookup()
                    with trio.move_on_after(REFRESH_S):
                        await self._kick.wait()
                    self._kick = trio.Event()
                    await trio.sleep(max(0.0, self._last_lookup + LOOKUP_GAP_S - trio.current_time()))
        finally:
            self._running = False

    async def _gossip(self) -> None:
        def valid(data: bytes) -> bool:
            try:
                return bc.decode(data).model == self.model_id
            except bc.ClaimError:
                return False

        while True:
            try:
                async with self.node.pubsub.subscribe(bc.topic(self.model_id), validate=valid) as sub:
                    async for msg in sub:
                        try:
                            claim = bc.decode(msg.data)
                        except bc.ClaimError:
                            continue
                        if self.note(claim):
                            self.from_gossip += 1
            except Exception as e:  # the view still has its lookups; the node carries on
                log.info("following claims on gossip failed (again in %g s): %s: %s", REFRESH_S,
                         type(e).__name__, e)
            await trio.sleep(REFRESH_S)
