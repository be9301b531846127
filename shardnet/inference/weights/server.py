"""``WeightServer``: a node behaviour that serves the models this node holds (whole, or the
parts it fetched) on ``/shardnet/weights/1.0.0`` and keeps their cards in the DHT.

Serving weights must not starve inference: at most ``weights_streams_per_peer`` streams per
peer (more are answered ``busy``), and every chunk sent waits its turn under one pacer of
``weights_mb_per_s`` for the whole node. Files are read with ``pread`` in a worker thread.
"""

from __future__ import annotations

import logging
import os
import random

import trio

from shardnet.errors import ShardnetError

from shardnet.inference.model.checkpoint import Checkpoint
from shardnet.inference.weights.cards import card_of, publish_card, publish_model_list
from shardnet.protocols import weights as wp
from shardnet.transport.behaviour import Behaviour
from shardnet.transport.limits import PeerCounts, Refusals
from shardnet.transport.errors import OverlayTimeout
from shardnet.transport.node import Node
from shardnet.transport.stream import Stream, StreamClosedError

log = logging.getLogger(__name__)

#: seconds between republishing cards and provider records: Kademlia's hourly republication
#: (DHT provider records live 48 h, values 24 h, as long as 20 holders stay; a home swarm's churn
#: would have to take all 20 of a record's within the hour). Each republication walks the DHT
#: once per record (5-7 walks of up to 20 peers): every 40 s, as at first, was a fifth of an idle
#: peer's CPU at 8-24 peers, every 10 minutes (until 2026-12-06) as many DHT requests as the
#: claim's refreshes (docs/performance.md); ``add`` publishes at once when the models change.
REPUBLISH_S = 3600.0
READ_TIMEOUT = 60.0
#: seconds (uniformly at random) before the first cards go out
FIRST_PUBLISH_DELAY = (0.5, 2.0)
#: threads reading chunks from disk at once (all streams together)
READER_THREADS = 2


class Pacer:
    """Spaces out what is sent so that it averages ``rate`` bytes per second (no burst)."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._next = 0.0

    async def take(self, n: int) -> None:
        now = trio.current_time()
        start = max(now, self._next)
        self._next = start + n / self.rate
        await trio.sleep_until(start)


class WeightServer(Behaviour):
    """Serves the blobs of the checkpoints it is given (``add``), and publishes their cards."""

    def __init__(self, node: Node, *, serves_weights: bool = True) -> None:
        self.node = node
        #: model ID -> (checkpoint, extra names, the model ID of the draft its card names, listed)
        self.models: dict[str, tuple[Checkpoint, list[str], str | None, bool]] = {}
        self.serves_weights = serves_weights
        self.open = PeerCounts()
        self.refusals = Refusals(log)
        self.pacer = Pacer(node.config.limits.weights_mb_per_s * 1e6)
        self.readers = trio.CapacityLimiter(READER_THREADS)
        #: chunks and bytes sent (for metrics and tests)
        self.chunks_sent = 0
        self.bytes_sent = 0
        self._wake = trio.Event()
        node.set_stream_handler(wp.PROTOCOL_ID, self._serve_stream)

    def add(self, ckpt: Checkpoint, names: list[str] = (), *, draft: str | None = ..., listed: bool = True) -> None:
        """Serve ``ckpt`` (again, after it holds more) under its ID; publish its card soon. ``draft``:
        the model ID of a draft for it, which its card names (serve that one too; default: as
        before). ``listed``: among the models this peer lists as served (``shardnet models``); a
        draft is served and findable by its ID and names, not listed."""
        if draft is ...:
            draft = self.models.get(ckpt.model_id, (None, None, None, True))[2]
        self.models[ckpt.model_id] = (ckpt, list(names), draft, listed)
        self._wake.set()

    def remove(self, model_id: str) -> None:
        """Stop serving a model (its cards expire from the DHT by themselves)."""
        self.models.pop(model_id, None)

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        # a peer's first moment belongs to its claim, relay reservation and hole punches: its
        # cards follow a little later, and peers started together do not publish all at once
        await trio.sleep(random.uniform(*FIRST_PUBLISH_DELAY))
        while True:
            await publish_model_list(self.node, [i for i, (*_, listed) in self.models.items() if listed])
            for ckpt, names, draft, listed in list(self.models.values()):
                try:
                    card = card_of(ckpt, names, draft=draft)
                except ShardnetError as e:  # a config that names no dtype we know, say
                    log.warning("no model card for %s: %s", ckpt.path.name, e)
                    continue
                await publish_card(self.node, card, serves_weights=self.serves_weights, listed=listed)
            with trio.move_on_after(REPUBLISH_S):
                await self._wake.wait()
            self._wake = trio.Event()

    # -- the protocol ----------------------------------------------------------------------------
    async def _serve_stream(self, stream: Stream) -> None:
        peer = str(stream.remote_peer)
        conn = wp.WeightsServer()
        limit = self.node.config.limits.weights_streams_per_peer
        if self.open[peer] >= limit:
            await self._refuse_busy(stream, conn, peer, limit)
            return
        self.open[peer] += 1
        try:
            while True:
                data = await stream.read_some(65536, timeout=READ_TIMEOUT)
                if not data:
                    return
                for request in conn.receive_data(data):
                    reply = await self._answer(request)
                    out = conn.send(reply)
                    await stream.write(out)
                    if reply.ok and request.op == "chunk":
                        self.chunks_sent += 1
                        self.bytes_sent += len(reply.data)
        except wp.WeightsError as e:
            log.info("weights request from %s refused: %s", peer[:16], e)
            await stream.reset()
        except (StreamClosedError, OverlayTimeout) as e:  # the fetcher went away, gave up, or idles
            log.debug("weights stream from %s ended: %s", peer[:16], e)
        finally:
            self.open.release(peer)

    async def _refuse_busy(self, stream: Stream, conn: wp.WeightsServer, peer: str, limit: int) -> None:
        """Answer the first request ``busy`` and close: the stream never counts against the limit."""
        self.refusals.note("weights_streams_per_peer", peer, f"limit weights_streams_per_peer: {peer[:16]} has "
                                                             f"{self.open[peer]} weight streams open; answering busy")
        try:
            with trio.fail_after(10):
                while True:
                    data = await stream.read_some(65536, timeout=10)
                    if not data:
                        return
                    if conn.receive_data(data):
                        break
            await stream.write(conn.send(wp.Reply.failure(
                "busy", f"this peer serves at most {limit} weight streams per peer at once")))
        except (wp.WeightsError, StreamClosedError, OverlayTimeout, trio.TooSlowError) as e:
            log.debug("busy weights stream from %s: %s", peer[:16], e)

    async def _answer(self, request: wp.Request) -> wp.Reply:
        held = self.models.get(request.model)
        if held is None:
            return wp.Reply.failure("unknown_model", f"this peer serves no model {request.model[:16]}…")
        ckpt = held[0]
        if request.op == "have":
            return wp.Reply(True, prefixes=tuple(ckpt.held_prefixes()))
        if request.op == "manifest":
            raw = ckpt.manifest_bytes()
            data = raw[request.index: request.index + request.length]
            await self.pacer.take(len(data))
            return wp.Reply(True, data=data, total=len(raw))
        where = ckpt.blob_location(request.blob)
        hashes = ckpt.blob_hashes(request.blob) if where else None
        if where is None or hashes is None:
            return wp.Reply.failure("not_held", f"this peer does not hold {request.blob[:200]}")
        if request.op == "hashes":
            return wp.Reply(True, data=hashes)
        path, start, end = where
        if request.index >= wp.chunk_count(end - start):
            return wp.Reply.failure("bad_request", f"{request.blob[:200]} has no chunk {request.index}")
        a, b = wp.chunk_span(end - start, request.index)
        # paced before it is read (a waiting stream holds no chunk in memory), and read on a few
        # threads of its own: inference's forward passes use trio's default thread limiter
        await self.pacer.take(b - a)
        data = await trio.to_thread.run_sync(_pread, path, start + a, b - a, limiter=self.readers)
        return wp.Reply(True, data=data)


def _pread(path, offset: int, length: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, length, offset)
    finally:
        os.close(fd)
