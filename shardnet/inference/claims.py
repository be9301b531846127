"""Publishing and finding block claims (through the DHT, gossipsub and direct requests)."""

from __future__ import annotations

import logging
import random
import time

import cbor2
import trio

from shardnet.protocols import block_claim as bc
from shardnet.transport.errors import ShardnetError
from shardnet.transport.node import Node
from shardnet.transport.stream import Stream

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
        self.claim_fn = claim_fn  # () -> Claim, built fresh each round (expiry, addresses)
        self.current: bytes | None = None
        node.set_stream_handler(bc.PROTOCOL_ID, self._answer)

    async def _answer(self, stream: Stream) -> None:
        await stream.write(cbor2.dumps([self.current] if self.current else []))

    async def run(self, *, ttl: float = CLAIM_TTL, task_status=trio.TASK_STATUS_IGNORED) -> None:
        first = True
        while True:
            claim = self.claim_fn(time.time() + ttl)
            self.current = bc.encode(self.node.key_pair, claim)
            for what, coro in (("DHT record", self.node.dht.put(claim_record_name(claim.model), self.current)),
                               ("provider record", self.node.dht.provide(provider_name(claim.model))),
                               ("gossip", self.node.pubsub.publish(bc.topic(claim.model), self.current))):
                try:
                    await coro
                except Exception as e:  # best effort; the next round retries
                    log.info("publishing claim (%s) failed: %s", what, e)
            if first:
                log.info("claimed layers %d:%d of model %s…", claim.start, claim.end, claim.model[:16])
                task_status.started()
                first = False
            with trio.move_on_after(ttl / 3):  # or at once when our relay addresses change
                await self.node.relay_client.changed.wait()


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


def plan_route(claims: list[bc.Claim], num_layers: int, *, rng: random.Random | None = None,
               link_cost=None) -> list[bc.Claim]:
    """A chain of claims covering layers 0..num_layers-1 exactly, fewest hops first.

    Routing by latency and throughput comes with the swarm placement work; this picks, at each
    layer, the claim that starts there and reaches furthest; among those, the lowest
    ``link_cost(claim)`` (e.g. a peer we reach directly before one behind a relay), then at random.
    """
    rng = rng or random.Random()
    chain, pos = [], 0
    while pos < num_layers:
        starting = [c for c in claims if c.start == pos and c.end <= num_layers]
        if not starting:
            raise NoRouteError(f"no live peer serves layers starting at {pos} (model has {num_layers} layers; "
                               f"claims: {sorted((c.start, c.end) for c in claims)})")
        best = max(c.end for c in starting)
        furthest = [c for c in starting if c.end == best]
        if link_cost is not None:
            cheapest = min(link_cost(c) for c in furthest)
            furthest = [c for c in furthest if link_cost(c) == cheapest]
        pick = rng.choice(furthest)
        chain.append(pick)
        pos = pick.end
    return chain
