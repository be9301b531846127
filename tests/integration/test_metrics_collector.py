"""A node's metrics as Prometheus reads them, after a real generation through an in-process
chain: the client's counters and histogram agree with what the generation reports itself."""

from prometheus_client.parser import text_string_to_metric_families

from shardnet.inference.client.client import Client
from shardnet.inference.metrics import exposition
from shardnet.inference.model.local_model import LocalModel
from shardnet.inference.model.random_model import init_random
from shardnet.testing.helpers import local_chain
from shardnet.transport.limits import REFUSED, Refusals


def samples(node) -> dict[tuple[str, tuple], float]:
    body, ctype = exposition(node)
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
