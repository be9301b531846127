"""Prometheus metrics of real processes: two compute peers started with --metrics-port and a
gateway (its /metrics), scraped after completions and parsed with prometheus_client's own parser."""

import http.client
import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from shardnet.testing.helpers import free_port, http_request, wait_healthy
from shardnet.testing.localswarm import LocalSwarm

pytestmark = pytest.mark.slow

PROMPTS = ["def main(args):\n    ", "import os\n", "class Point:\n"]
MAX = 8


def scrape(host: str, port: int, path: str = "/metrics") -> dict[str, list]:
    """{family name: its samples}, as Prometheus would read them."""
    conn = http.client.HTTPConnection(host, port, timeout=30)
    conn.request("GET", path)
    resp = conn.getresponse()
    text = resp.read().decode()
    assert resp.status == 200, text
    assert resp.getheader("content-type").startswith("text/plain; version="), resp.getheader("content-type")
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def value(families: dict, name: str, **labels) -> float:
    family, sample = name.removesuffix("_total"), name
    found = [s.value for s in families[family] if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (name, labels, families.get(family))
    return found[0]


def histogram_count(families: dict, name: str) -> float:
    return next(s.value for s in families[name] if s.name == name + "_count")


def test_compute_peers_and_the_gateway_serve_metrics_prometheus_parses():
    with LocalSwarm() as swarm:
        swarm.start_bootstrap()
        ports = [free_port(), free_port()]
        spans = [(0, 4), (4, 8)]
        procs = [swarm.spawn_node(f"join{i}", "--layers", f"{a}:{b}", "--threads", "1",
                                  "--metrics-port", str(port), command="join")
                 for i, ((a, b), port) in enumerate(zip(spans, ports))]
        peer_ids = [swarm.wait_ready(p, 120)["peer_id"] for p in procs]
        url, _ = swarm.start_gateway()
        wait_healthy(url)
        completion_tokens = 0
        for prompt in PROMPTS:
            status, data = http_request(url, "POST", "/v1/completions",
                                        json.dumps({"model": "tiny-llama", "prompt": prompt, "max_tokens": MAX}),
                                        {"content-type": "application/json"})
            assert status == 200, data
            completion_tokens += json.loads(data)["usage"]["completion_tokens"]

        peers = [scrape("127.0.0.1", port) for port in ports]
        host, port = url.removeprefix("http://").split(":")
        gateway = scrape(host, int(port))
        # a path beside /metrics is a clear 404
        conn = http.client.HTTPConnection("127.0.0.1", ports[0], timeout=30)
        conn.request("GET", "/")
        assert conn.getresponse().status == 404

    for families, peer_id, (a, b) in zip(peers, peer_ids, spans):
        assert value(families, "shardnet_node_info", peer_id=peer_id) == 1
        assert value(families, "shardnet_block_info", start=str(a), end=str(b)) == 1
        assert value(families, "shardnet_connected_peers", link="direct") >= 2  # the bootstrap, the gateway...
        # every request opened a session here, and each of its tokens went through as a step
        assert value(families, "shardnet_block_sessions_total") >= len(PROMPTS)
        steps = value(families, "shardnet_block_steps_total")
        assert steps >= completion_tokens
        assert histogram_count(families, "shardnet_block_step_seconds") == steps
        assert value(families, "shardnet_block_tokens_total") >= steps
        assert value(families, "shardnet_block_activation_bytes_total", direction="in") > 0
        assert value(families, "shardnet_block_activation_bytes_total", direction="out") > 0
        assert value(families, "shardnet_block_sessions_open") == 0
        assert value(families, "shardnet_block_kv_bytes", state="limit") > 0
        assert value(families, "shardnet_dht_records", kind="value") >= 0
        assert value(families, "shardnet_weights_bytes_total", direction="sent") == 0  # nobody fetched
    # the last peer's output (logits) is larger than what came in: hidden states of one position
    # the gateway's client: every request and token, and a round trip per step
    assert value(gateway, "shardnet_client_sessions_total") == len(PROMPTS)
    assert value(gateway, "shardnet_client_sessions_failed_total") == 0
    assert value(gateway, "shardnet_client_sessions_active") == 0
    assert value(gateway, "shardnet_client_tokens_total") == completion_tokens
    assert value(gateway, "shardnet_client_tokens_per_second") > 0
    assert value(gateway, "shardnet_client_heals_total") == 0
    assert histogram_count(gateway, "shardnet_client_step_seconds") > 0
    assert value(gateway, "shardnet_connected_peers", link="direct") >= 3
