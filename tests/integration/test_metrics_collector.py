"""A node's metrics as Prometheus reads them, after a real generation through an in-process
chain: the client's counters and histogram agree with what the generation reports itself, and
the clients and the compute peer of one node share its inference services (one set of counters,
one registry)."""

from contextlib import AsyncExitStack

from prometheus_client.parser import text_string_to_metric_families

from shardnet.inference.client.client import Client
from shardnet.inference.model.local_model import LocalModel
from shardnet.inference.model.random_model import init_random
from shardnet.inference.server.compute_peer import serve_block
from shardnet.inference.services import inference_services
from shardnet.testing.helpers import local_chain
from shardnet.transport import open_node
from shardnet.transport.limits import REFUSED, Refusals


def samples(node) -> dict[tuple[str, tuple], float]:
    body, ctype = inference_services(node).metrics.exposition()
    assert ctype.startswith("text/plain; version=")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(body.decode()) for s in f.samples}


async def test_a_generation_shows_in_the_client_nodes_metrics(loopback_config, tmp_path):
    path = init_random(tmp_path / "llama", "llama", layers=2, hidden=64, heads=4, kv_heads=2, vocab=256, seed=1)
    async with local_chain(loopback_config, path, [(0, 1), (1, 2)]) as node:
        client = Client(node, LocalModel(path))
        before = samples(node)
        assert before[("shardnet_client_tokens_total", ())] == 0
        got = [t async for t in client.generate([3, 17, 42], max_new_tokens=6, stop_at_eos=False)]
        Refusals().note("test_kind", "somebody", "a refusal for the test")
        after = samples(node)
    stats = client.last_stats
    assert after[("shardnet_client_sessions_total", ())] == 1
    assert after[("shardnet_client_sessions_active", ())] == 0
    assert after[("shardnet_client_prompt_tokens_total", ())] == 3
    assert after[("shardnet_client_tokens_total", ())] == len(got) == stats.new_tokens
    assert after[("shardnet_client_step_seconds_count", ())] == stats.speculation.verified
    assert after[("shardnet_client_step_seconds_sum", ())] > 0
    buckets = sorted((float(dict(k)["le"]), v) for (name, k), v in after.items()
                     if name == "shardnet_client_step_seconds_bucket")
    assert [v for _, v in buckets] == sorted(v for _, v in buckets)  # cumulative
    assert buckets[-1] == (float("inf"), stats.speculation.verified)
    assert after[("shardnet_client_audits_total", (("outcome", "sampled"),))] == stats.audit.sampled
    assert after[("shardnet_connected_peers", (("link", "direct"),))] >= 2
    assert after[("shardnet_refusals_total", (("kind", "test_kind"),))] == REFUSED["test_kind"] >= 1


async def test_a_nodes_clients_and_compute_peer_share_its_inference_services(loopback_config, tmp_path):
    path = init_random(tmp_path / "llama", "llama", layers=2, hidden=64, heads=4, kv_heads=2, vocab=256, seed=1)
    model = LocalModel(path)
    async with AsyncExitStack() as stack:
        boot = await stack.enter_async_context(open_node(loopback_config()))
        cfg = loopback_config(bootstrap=[str(boot.listen_addrs[0])])
        peers = []
        for a, b in [(0, 1), (1, 2)]:
            peers.append(await stack.enter_async_context(open_node(cfg)))
            await stack.enter_async_context(serve_block(peers[-1], str(path), a, b))
        node = await stack.enter_async_context(open_node(cfg))
        await node.wait_bootstrapped()
        # a gateway's clients on one node: one set of probes, slots, own load, counters
        first, second = Client(node, model, audit_rate=0.0), Client(node, model, audit_rate=0.0)
        assert first.services is second.services is inference_services(node)
        assert first.planner.probes is second.planner.probes is first.request.probes
        assert first.planner.own_load is second.planner.own_load
        assert first.request.session_slots is second.request.session_slots
        for client in (first, second):
            got = [t async for t in client.generate([3, 17, 42], max_new_tokens=4, stop_at_eos=False)]
            assert len(got) == 4
        on_client = samples(node)
        # a compute peer's node that runs a client too: its block and its client in one registry
        on_peer = Client(peers[0], model)
        assert on_peer.services is inference_services(peers[0]) is not first.services
        served = samples(peers[0])
    assert on_client[("shardnet_client_sessions_total", ())] == 2
    assert on_client[("shardnet_client_tokens_total", ())] == 8
    assert not any(name.startswith("shardnet_block_") for name, _ in on_client)  # it serves no block
    assert served[("shardnet_block_sessions_total", ())] >= 2
    assert served[("shardnet_client_sessions_total", ())] == 0
