"""Honest-compute checks against real misbehaving peers (separate processes running the test
double tests/system/doubles/cheating_peer.py): the client catches them at the default sample rate within
the bound the schedule gives, excludes them, reports them on gossip with signed receipts, and
its output still equals plain single-process transformers."""

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from shardnet.inference.client.audit import DEFAULT_AUDIT_RATE
from shardnet.inference.client.client import Client
from shardnet.inference.model.local_model import LocalModel
from shardnet.inference.receipt_service import ReceiptService
from shardnet.models import default_model_path
from shardnet.testing.localswarm import LocalSwarm, shardnet_argv
from shardnet.transport import open_node
from shardnet.transport.config import NodeConfig

pytestmark = pytest.mark.slow

PROMPT = "def main(args):\n    "
NEW = 40
CHEATER = [sys.executable, str(Path(__file__).parent / "doubles" / "cheating_peer.py")]
WINDOW = round(1 / DEFAULT_AUDIT_RATE)
#: only layers 4:8 have a second (and third) peer, so every check is of that span: the cheater
#: is checked once in every window, and the step convicting it is sampled in the first two
#: (one more window in case a first check is superseded). When that check finishes is timing:
#: it runs beside decoding, later on a busy machine, so it is only required before the end.
BOUND = 2 * WINDOW


def start_peers(swarm: LocalSwarm, cheat_mode: str) -> tuple[str, str, set[str]]:
    """Layers 0:4 on one honest peer; 4:8 on two honest peers and a cheater (all holding the head).
    Returns the cheater's peer ID, the 0:4 peer's address and the honest 4:8 peers' IDs."""
    swarm.start_bootstrap()
    common = ("--threads", "1", "--hold-head")
    cheater = swarm.spawn_node("cheater", "--layers", "4:8", *common, command="join",
                               program=[*CHEATER, cheat_mode])
    honest = swarm.join_spans([(0, 4), (4, 8), (4, 8)], *common)  # (loading while the cheater loads)
    return (swarm.wait_ready(cheater, 120)["peer_id"], honest[0]["addrs"][0],
            {h["peer_id"] for h in honest[1:]})


async def generate_with_cheater(bootstrap, cheater, honest_peer, other_witnesses, *, logits_on_last):
    cfg = NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"], bootstrap=[bootstrap], dial_timeout=5.0)
    async with open_node(cfg) as node, open_node(cfg) as observer:
        await node.wait_bootstrapped()
        await observer.wait_bootstrapped()
        heard = ReceiptService.of(observer)  # another swarm member, listening for reports
        await observer.connect(honest_peer)
        client = Client(node, LocalModel(default_model_path(), lm_head=not logits_on_last),
                        logits_on_last=logits_on_last, route_timeout=20)
        assert client.audit_rate == DEFAULT_AUDIT_RATE
        first_route, caught_after, ids = [], [], []

        def progress(event, info):
            if event == "route":
                first_route[:] = [c[0] for c in info["chain"]]
            if event == "heal" and info["phase"] == "audit":
                caught_after.append(results)

        # the cheater's claimed throughput (1e6 tokens/s) no longer draws the route (routing
        # counts it as its layers' typical peer: peer_speeds.py): its first chain is chosen here
        route = await client.planner.find_route(avoid=other_witnesses)
        results = 0
        async for tok in client.generate(PROMPT, max_new_tokens=NEW, stop_at_eos=False, progress=progress,
                                         route=route):
            tok.apply(ids)
            results += 1
        report = None
        with trio.move_on_after(30):
            while report is None:
                report = next((r for r in heard.reports.values() if r["accused"] == cheater), None)
                await trio.sleep(0.2)
        return ids, client, first_route, caught_after, report


def check_caught(client, cheater, first_route, caught_after, report):
    assert cheater in first_route
    st = client.last_stats
    assert st.audit.convictions == 1, st.audit
    assert report is not None, "no report heard on gossip"
    # results are numbered from 0 (the prefill's); result k > 0 fed the token at position L + k - 1
    sampled_at = max(0, report["step_pos"] - len(client.model.encode(PROMPT)) + 1)
    assert sampled_at < BOUND, (report["step_pos"], st.audit)
    assert caught_after and caught_after[0] < NEW, (caught_after, st.audit)  # while generating
    print(f"convicted on result {sampled_at}, {caught_after[0] - sampled_at} results after it was computed")
    assert client.reputation.excluded() == {cheater}
    assert cheater not in {c.peer for c in st.chain}
    record = client.reputation.to_json()[cheater]
    assert record["convictions"][0]["layers"] == [4, 8]
    # the report reached another member of the swarm, signed, with the peers' own receipts
    assert report["reporter"] == str(client.node.peer_id) and report["layers"] == [4, 8]
    assert report["divergence"] > report["tolerance"]
    signers = {r.peer for r in report["receipts"]}
    witnesses = {w["peer"] for w in report["witnesses"]}
    assert signers & witnesses and cheater in signers


def test_a_peer_perturbing_its_activations_is_caught_excluded_and_reported(reference):
    with LocalSwarm() as swarm:
        # scaling by 1 + EPS moves the divergence by exactly EPS: a 1 % error clears the float16
        # tolerance (5e-3) by twice, while honest batched float16 steps differ by 1.4e-3 at most
        # (bench/logit_tolerance.py)
        cheater, honest, witnesses = start_peers(swarm, "perturb:0.01")
        ids, client, first_route, caught_after, report = trio.run(
            functools.partial(generate_with_cheater, logits_on_last=False), swarm.bootstrap_addr, cheater, honest,
            witnesses)
        # the compute peers heard the report too, and serve it to anyone who asks
        listed = subprocess.run(shardnet_argv("receipts", "--bootstrap", swarm.bootstrap_addr, "--reports", "--json"),
                                capture_output=True, text=True, timeout=60)
    assert ids == reference
    check_caught(client, cheater, first_route, caught_after, report)
    assert listed.returncode == 0, listed.stderr[-2000:]
    heard = json.loads(listed.stdout)
    assert [r["accused"] for r in heard] == [cheater], heard
    assert heard[0]["reporter"] == str(client.node.peer_id) and cheater in heard[0]["evidence"]


def test_a_head_peer_lying_about_tokens_is_caught_and_its_tokens_withdrawn(reference):
    liar_token = 7
    with LocalSwarm() as swarm:
        cheater, honest, witnesses = start_peers(swarm, f"boost:{liar_token}")
        ids, client, first_route, caught_after, report = trio.run(
            functools.partial(generate_with_cheater, logits_on_last=True), swarm.bootstrap_addr, cheater, honest,
            witnesses)
    assert ids == reference, "the liar's tokens must be withdrawn and replaced"
    assert client.last_stats.retracted > 0
    check_caught(client, cheater, first_route, caught_after, report)
