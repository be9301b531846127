"""Publishing and finding block claims (through the DHT, gossipsub and direct requests)."""

from __future__ import annotations

import logging
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
