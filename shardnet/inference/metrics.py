"""A node's Prometheus metrics: read at scrape time from the counters the node's parts keep
anyway (connections, the DHT store, the served block and its batcher, weight transfers, the
clients' activity, refusals), so serving metrics costs nothing between scrapes and no code
path carries a metrics object around.

``NodeMetrics`` (one per node, in its ``InferenceServices``) keeps the node's own registry (not
prometheus_client's global one: tests and embedding apps run several nodes in one process); it
reads the clients' activity it was given and the block endpoint the node's ``ComputePeer`` hands
it (``watch_block``). Its ``exposition()`` is what the gateway's ``/metrics`` and
``--metrics-port`` serve.

Names follow Prometheus' conventions: ``shardnet_`` prefix, ``_total`` counters, base units
(seconds, bytes). Refusals and fetched weight bytes are counted per process (one node per
deployed process).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from shardnet._version import __version__
from shardnet.inference.client.activity import ClientActivity
from shardnet.inference.receipt_service import ReceiptService
from shardnet.inference.weights.fetcher import FETCHED
from shardnet.inference.weights.server import WeightServer
from shardnet.transport.limits import REFUSED
from shardnet.transport.node import Node

if TYPE_CHECKING:
    from shardnet.inference.server.block_endpoint import BlockEndpoint


class NodeCollector(Collector):
    """Every metric of one node, collected when scraped: the overlay's, the node's clients'
    (``activity``) and, while it has one, its block endpoint's."""

    def __init__(self, node: Node, activity: ClientActivity) -> None:
        self.node = node
        self.activity = activity
        #: the block this node serves (set by its ComputePeer; None: it serves none)
        self.block_endpoint: BlockEndpoint | None = None
        self.started = time.time()

    def collect(self) -> Iterator[Metric]:
        yield from self._overlay()
        yield from self._block()
        yield from self._weights()
        yield from self._client()
        refused = CounterMetricFamily("shardnet_refusals", "requests refused, by the limit or check that refused "
                                      "them (this process)", labels=["kind"])
        for kind, n in sorted(REFUSED.items()):
            refused.add_metric([kind], n)
        yield refused

    def _overlay(self) -> Iterator[Metric]:
        node = self.node
        info = GaugeMetricFamily("shardnet_node_info", "this node (always 1)", labels=["peer_id", "version"])
        info.add_metric([str(node.peer_id), __version__], 1)
        yield info
        yield GaugeMetricFamily("shardnet_node_start_time_seconds", "when this node's metrics began (unix time)",
                                value=self.started)
        links = {"direct": 0, "relayed": 0}
        for peer in node.peers():
            link = node.link(peer)
            if link in links:
                links[link] += 1
        conns = GaugeMetricFamily("shardnet_connected_peers", "peers with an open connection, by how they are "
                                  "reached (relayed: only through relays)", labels=["link"])
        for link, n in links.items():
            conns.add_metric([link], n)
        yield conns
        kad = node.dht.kad
        records = GaugeMetricFamily("shardnet_dht_records", "DHT records this node stores for the swarm",
                                    labels=["kind"])
        records.add_metric(["value"], len(kad.value_store.store))
        records.add_metric(["provider"], sum(len(p) for p in kad.provider_store.providers.values()))
        yield records
        receipts = node.behaviour(ReceiptService)
        if receipts is not None:
            yield GaugeMetricFamily("shardnet_reports_kept", "reports of peers computing wrong this node keeps",
                                    value=len(receipts.reports))

    def _block(self) -> Iterator[Metric]:
        endpoint = self.block_endpoint
        if endpoint is None:
            return
        act = endpoint.activity
        sb = endpoint.served
        if sb is not None:
            served = GaugeMetricFamily("shardnet_block_info", "the block this peer serves (always 1)",
                                       labels=["model_id", "start", "end", "dtype", "device"])
            served.add_metric([sb.model_id, str(sb.block.start), str(sb.block.end), str(sb.block.dtype),
                               str(sb.block.device)], 1)
            yield served
            kv = GaugeMetricFamily("shardnet_block_kv_bytes", "KV cache bytes reserved by sessions, and the budget",
                                   labels=["state"])
            kv.add_metric(["used"], sb.kv.used)
            kv.add_metric(["prefix_pages"], sb.kv.prefixes.nbytes)
            kv.add_metric(["limit"], sb.kv.limit)
            yield kv
            pages = CounterMetricFamily("shardnet_block_prefix_pages", "prefix pages (64 positions) reused instead "
                                        "of computed, stored, evicted", labels=["event"])
            ps = sb.kv.prefixes.stats
            for event, n in (("reused", ps.hit_pages), ("stored", ps.stored_pages), ("evicted", ps.evicted_pages)):
                pages.add_metric([event], n)
            yield pages
            # the block scheduler's passes (since this span was loaded: a peer that moves starts anew)
            st = sb.scheduler.stats
            yield CounterMetricFamily("shardnet_block_batches", "forward passes of the block scheduler", st.passes)
            yield CounterMetricFamily("shardnet_block_batched_steps", "steps (and prompt chunks) run in those passes",
                                      st.steps)
            yield GaugeMetricFamily("shardnet_block_batch_largest", "most steps in one pass so far", st.largest)
        yield GaugeMetricFamily("shardnet_block_sessions_open", "sessions open at this block now",
                                value=sum(endpoint.sessions_by_peer.values()))
        yield CounterMetricFamily("shardnet_block_sessions", "sessions opened at this block", act.sessions_total)
        yield CounterMetricFamily("shardnet_block_steps", "steps computed and sent on", act.steps_total)
        yield CounterMetricFamily("shardnet_block_tokens", "token positions computed (or reused from prefix pages)", act.tokens_total)
        traffic = CounterMetricFamily("shardnet_block_activation_bytes", "activation payload bytes through this "
                                      "block", labels=["direction"])
        traffic.add_metric(["in"], act.bytes_in_total)
        traffic.add_metric(["out"], act.bytes_out_total)
        yield traffic
        yield from act.step_seconds.collect()

    def _weights(self) -> Iterator[Metric]:
        server = self.node.behaviour(WeightServer)
        sent = CounterMetricFamily("shardnet_weights_bytes", "weight bytes transferred (sent: served to peers; "
                                   "fetched: received and verified by this process)", labels=["direction"])
        sent.add_metric(["sent"], server.bytes_sent if server is not None else 0)
        sent.add_metric(["fetched"], FETCHED.verified_bytes)
        yield sent
        if server is not None:
            yield CounterMetricFamily("shardnet_weights_chunks_sent", "weight chunks served", server.chunks_sent)

    def _client(self) -> Iterator[Metric]:
        act = self.activity
        yield GaugeMetricFamily("shardnet_client_sessions_active", "generations running now", act.sessions_active)
        yield CounterMetricFamily("shardnet_client_sessions", "generations started", act.sessions_total)
        yield CounterMetricFamily("shardnet_client_sessions_failed", "generations that ended in an error",
                                  act.sessions_failed)
        yield CounterMetricFamily("shardnet_client_prompt_tokens", "prompt tokens sent", act.prompt_tokens_total)
        yield CounterMetricFamily("shardnet_client_tokens", "tokens generated", act.tokens_total)
        yield CounterMetricFamily("shardnet_client_retracted_tokens", "tokens withdrawn after a peer was caught "
                                  "computing wrong", act.retracted_total)
        yield GaugeMetricFamily("shardnet_client_tokens_per_second", "tokens generated per second over the last "
                                "minute", act.tokens_per_s())
        yield CounterMetricFamily("shardnet_client_heals", "recoveries from a failed or convicted peer",
                                  act.heals_total)
        yield CounterMetricFamily("shardnet_client_convictions", "peers caught computing wrong",
                                  act.convictions_total)
        audits = CounterMetricFamily("shardnet_client_audits", "honest-compute checks, by outcome",
                                     labels=["outcome"])
        for outcome, n in sorted(act.audits.items()):
            audits.add_metric([outcome], n)
        yield audits
        yield from act.step_seconds.collect()


class NodeMetrics:
    """The node's metrics registry (one per node, in its ``InferenceServices``)."""

    def __init__(self, node: Node, activity: ClientActivity) -> None:
        self.collector = NodeCollector(node, activity)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)

    def watch_block(self, endpoint: BlockEndpoint) -> None:
        """Report ``endpoint``'s block from now on (the node's ComputePeer calls it)."""
        self.collector.block_endpoint = endpoint

    def exposition(self) -> tuple[bytes, str]:
        """The node's metrics in Prometheus' text format, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
