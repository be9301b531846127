"""Receipts of real runs: peers sign stage receipts when sessions end and serve them; the client
writes a signed run receipt; `shardnet verify` checks it offline (and recomputes the tokens)."""

import json
import subprocess

import pytest

from shardnet.inference.client.client import Client
from shardnet.inference.client.speculative import NGramDrafter
from shardnet.inference.model.local_model import LocalModel
from shardnet.inference.receipt_service import ReceiptService, request
from shardnet.models import default_model_path
from shardnet.protocols import receipt_gossip as rg
from shardnet.protocols import receipts as rc
from shardnet.testing.helpers import local_chain
from shardnet.testing.localswarm import LocalSwarm, shardnet_argv

PROMPT = "def main(args):\n    "


async def test_a_run_receipt_verifies_and_links_every_stage(loopback_config):
    path = default_model_path()
    async with local_chain(loopback_config, path, [(0, 3), (3, 5), (5, 8)], region="lab-1") as node:
        client = Client(node, LocalModel(path))
        got = [t.id async for t in client.generate(PROMPT, max_new_tokens=12, stop_at_eos=False,
                                                    drafter=NGramDrafter(), k=4, depth=2)]
        doc = await client.run_receipt()
    checks = rc.verify_run(doc, manifest_model_id=client.model.model_id)
    assert all(c.ok for c in checks), [c for c in checks if not c.ok]
    body = doc["body"]
    assert body["output_ids"] == got and body["client"] == str(node.peer_id)
    stages = [rc.decode_stage(__import__("base64").b64decode(s)) for s in body["sessions"][-1]["stages"]]
    assert [tuple(s.layers) for s in stages] == [(0, 3), (3, 5), (5, 8)]
    assert all(s.steps_in >= 2 and s.device["kind"] == "cpu" for s in stages)
    # where each peer says it ran: the operator's region, no GPU UUID on a CPU; verify shows the
    # region next to the address the stage before saw the peer at
    assert all(s.region == "lab-1" and s.gpu_uuid is None for s in stages)
    place = next(c.detail for c in checks if c.name == "session 1 stage 2 place")
    assert "region 'lab-1' (declared), seen at 127.0.0.1:" in place, place
    assert body["speculative"]["drafter"] == "ngram"
    # the run says how much of it was cross-checked (here: no second peer for any span)
    assert body["checks"]["rate"] == client.audit_rate and body["checks"]["checked"] == 0
    assert body["checks"]["sampled"] == body["checks"]["no_witness"]


async def test_a_float16_run_batched_with_other_sessions_verifies_teacher_forced(loopback_config):
    """Honest peers batching concurrent sessions round near-ties their own way (float16): the
    receipts say so, and `verify --recompute`'s tolerant check passes every run."""
    import trio

    from shardnet.inference.client.recompute import recompute_check

    path = default_model_path()
    prompts = [PROMPT, "import os\n", "class A:\n    def f(self):", "x = [1, 2, 3]\nfor i in x:"]
    docs: dict[str, dict] = {}
    async with local_chain(loopback_config, path, [(0, 4), (4, 8)]) as node:
        model = LocalModel(path)

        async def one(prompt: str) -> None:
            client = Client(node, model, audit_rate=0.0)
            [t async for t in client.generate(prompt, max_new_tokens=16, stop_at_eos=False)]
            docs[prompt] = await client.run_receipt()

        async with trio.open_nursery() as nursery:
            for p in prompts:
                nursery.start_soon(one, p)
    stages = []
    for prompt, doc in docs.items():
        assert all(c.ok for c in rc.verify_run(doc)), prompt
        assert doc["body"]["dtype"] == "float16"
        stages += [rc.decode_stage(__import__("base64").b64decode(s)) for s in doc["body"]["sessions"][-1]["stages"]]
        check = recompute_check(doc, path, prompt)
        assert check.ok and "teacher-forced" in check.detail and "smallest margin" in check.detail, check.detail
    assert {(s.dtype, s.quant) for s in stages} == {("float16", "none")}
    assert all(s.batched_steps is not None for s in stages)
    assert sum(s.batched_steps for s in stages) > 0, "the sessions were meant to be batched together"


async def test_the_head_peer_commits_to_its_tokens(loopback_config):
    path = default_model_path()
    async with local_chain(loopback_config, path, [(0, 4), (4, 8)], hold_head=True) as node:
        client = Client(node, LocalModel(path, lm_head=False), logits_on_last=True)
        got = [t.id async for t in client.generate(PROMPT, max_new_tokens=6, stop_at_eos=False)]
        doc = await client.run_receipt()
    assert all(c.ok for c in rc.verify_run(doc))
    head = rc.decode_stage(__import__("base64").b64decode(doc["body"]["sessions"][-1]["stages"][-1]))
    assert head.tokens == got  # greedy: one argmax per step, prefill included
    # a client claiming other tokens, even re-signing its receipt, contradicts the head peer
    import copy

    body = copy.deepcopy(doc["body"])
    body["output_ids"][-1] = (body["output_ids"][-1] + 1) % 2048
    body["output_sha256"] = rc.tokens_hash(body["output_ids"])
    bad = rc.seal_run(node.key_pair, body)
    assert [c.name for c in rc.verify_run(bad) if not c.ok] == ["session 1 head tokens"]


async def test_receipts_are_served_by_id_and_session_and_bad_requests_get_errors(loopback_config):
    path = default_model_path()
    async with local_chain(loopback_config, path, [(0, 8)]) as node:
        client = Client(node, LocalModel(path))
        [t async for t in client.generate(PROMPT, max_new_tokens=3)]
        doc = await client.run_receipt()
        peer = client.last_stats.chain[0].peer
        listed = await request(node, peer, rg.encode_request(list_max=10))
        assert len(listed["digests"]) == 1 and listed["digests"][0]["layers"] == [0, 8]
        rid = listed["digests"][0]["id"]
        got = await request(node, peer, rg.encode_request(get=[rid, "00" * 32]))
        assert [rc.receipt_id(b) for b in got["receipts"]] == [rid]
        assert doc["body"]["sessions"][-1]["stages"][0] == __import__("base64").b64encode(got["receipts"][0]).decode()
        with pytest.raises(rg.GossipError, match="request must be"):
            await request(node, peer, b"\xa1av\x01")  # {v: 1}, nothing asked
        with pytest.raises(rg.GossipError, match="not CBOR|version"):
            await request(node, peer, b"\xff\xfe")
        assert len(ReceiptService.of(node).store) == 0  # the client signs no stage receipts


@pytest.mark.slow
def test_generate_writes_a_receipt_that_shardnet_verify_checks(tmp_path):
    with LocalSwarm() as swarm:
        swarm.start_bootstrap()
        swarm.join_spans([(0, 4), (4, 8)], "--threads", "1", "--region", "lab-1")
        receipt = tmp_path / "run.json"
        r = subprocess.run(shardnet_argv("generate", "--bootstrap", swarm.bootstrap_addr, "-n", "8",
                                         "--speculate", "ngram", "--depth", "2", "--check-speculation",
                                         "--receipt", str(receipt), PROMPT), capture_output=True, text=True,
                           timeout=180)
        assert r.returncode == 0, r.stderr[-2000:]
        assert "speculative output equals plain decoding" in r.stdout, r.stdout
        spec = json.loads(receipt.read_text())["body"]["speculative"]
        assert spec == {"drafter": "ngram", "k": 4, "depth": 2, "greedy_checked_equal_to_plain": True}, spec
        # the peers keep their receipts and list and serve them to anyone
        ls = subprocess.run(shardnet_argv("receipts", "--bootstrap", swarm.bootstrap_addr, "--json"),
                            capture_output=True, text=True, timeout=120)
        assert ls.returncode == 0, ls.stderr[-2000:]
        digests = json.loads(ls.stdout)
        # two sessions (the speculative run and its plain check), each through both peers
        assert sorted(tuple(d["layers"]) for d in digests) == [(0, 4), (0, 4), (4, 8), (4, 8)], digests
        assert {d.get("region") for d in digests} == {"lab-1"} and not any("gpu_uuid" in d for d in digests)
        one = subprocess.run(shardnet_argv("receipts", "--bootstrap", swarm.bootstrap_addr, "--get", digests[0]["id"]),
                             capture_output=True, text=True, timeout=120)
        assert one.returncode == 0 and json.loads(one.stdout)[digests[0]["id"]]["peer"] == digests[0]["peer"]
        missing = subprocess.run(shardnet_argv("receipts", "--bootstrap", swarm.bootstrap_addr, "--get", "00" * 32),
                                 capture_output=True, text=True, timeout=120)
        assert missing.returncode != 0 and "not found" in missing.stderr
        # sampled, with the default speculation (auto, without the draft model: recomputable)
        sampled = tmp_path / "sampled.json"
        r = subprocess.run(shardnet_argv("generate", "--bootstrap", swarm.bootstrap_addr, "-n", "12", "--temperature",
                                         "0.9", "--seed", "5", "--receipt", str(sampled), PROMPT),
                           capture_output=True, text=True, timeout=180)
        assert r.returncode == 0, r.stderr[-2000:]
        spec = json.loads(sampled.read_text())["body"]["speculative"]
        assert spec["drafter"] == "auto" and spec["candidates"] == ["suffix", "plain"], spec
    v = subprocess.run(shardnet_argv("verify", str(sampled), "--recompute", str(default_model_path())),
                       capture_output=True, text=True, timeout=180)
    assert v.returncode == 0 and "regenerated with its seed" in v.stdout, v.stdout + v.stderr[-2000:]
    manifest = tmp_path / "manifest.json"
    subprocess.run(shardnet_argv("model", "manifest", "--json", str(default_model_path())), check=True,
                   stdout=manifest.open("w"), timeout=120)
    v = subprocess.run(shardnet_argv("verify", str(receipt), "--manifest", str(manifest),
                                     "--recompute", str(default_model_path())),
                       capture_output=True, text=True, timeout=180)
    assert v.returncode == 0, v.stdout + v.stderr[-2000:]
    assert "ok    recompute" in v.stdout and "ok    run signature" in v.stdout and "ok    model ID" in v.stdout, v.stdout
    assert "teacher-forced" in v.stdout and "smallest margin" in v.stdout, v.stdout
    assert "region 'lab-1' (declared), seen at 127.0.0.1:" in v.stdout, v.stdout
    exact = subprocess.run(shardnet_argv("verify", str(receipt), "--recompute", str(default_model_path()), "--exact"),
                           capture_output=True, text=True, timeout=180)
    assert exact.returncode == 0 and "identical (exact comparison)" in exact.stdout, exact.stdout + exact.stderr[-2000:]
    # one changed token: the signature no longer holds, and verify says so first
    doc = json.loads(receipt.read_text())
    doc["body"]["output_ids"][0] += 1
    receipt.write_text(json.dumps(doc))
    v = subprocess.run(shardnet_argv("verify", str(receipt)), capture_output=True, text=True, timeout=120)
    assert v.returncode != 0 and "FAIL  run signature" in v.stdout, v.stdout
