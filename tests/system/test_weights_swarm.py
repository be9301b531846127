"""Joining by model name or ID with no model files, as separate processes: only the first peer
starts with the checkpoint; two more fetch just their spans from the swarm and serve them; a thin
client fetches just the head and generates what transformers generates; `shardnet models` lists
the swarm; a peer serving another model under the name does not take it; a fetch killed halfway
resumes from the chunks it had verified."""

import json
import re
import signal
import struct
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from shardnet.inference.model.checkpoint import Checkpoint
from shardnet.models import default_model_path
from shardnet.inference.model.random_model import init_random
from shardnet.testing.helpers import assert_one_line_failure, shardnet, transformers_greedy
from shardnet.testing.localswarm import LocalSwarm

pytestmark = pytest.mark.slow

PROMPT = "def fibonacci(n):"
NEW = 12
#: what each peer sends of weights, MB/s: slow enough that a fetch can be killed halfway
RATE = "1.5"


def _until_ready(p):
    """A join's events up to "ready": its fetch progress and its "serving" event."""
    events = []
    p.wait_event(lambda e: e.get("event") == "ready", 180, keep=events)
    serving = [e for e in events if e.get("event") == "serving"]
    assert len(serving) == 1, events
    return [e for e in events if e.get("event") == "fetch"], serving[0]


def serving_peer(p) -> str:
    """The peer ID of a join process (from its "ready" event, seen by now)."""
    return next(json.loads(line)["peer_id"] for line in p.seen if '"ready"' in line)


def test_peers_join_by_name_and_id_and_a_thin_client_generates(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # names are not looked up on a hub (none is reachable here)
    model = default_model_path()
    model_id = Checkpoint(model).model_id
    limit = ["--limit", f"weights_mb_per_s={RATE}", "--threads", "1"]
    with LocalSwarm(tmp_path / "swarm") as swarm:
        boot = swarm.start_bootstrap()
        swarm.join_spans([(0, 4)], "--model", str(model), *limit)  # the only peer with files
        by_name = swarm.spawn_node("by-name", "--model", "tiny-llama", "--layers", "4:8", "--hold-head",
                                   "--cache-dir", str(tmp_path / "c-name"), *limit, command="join")
        by_id = swarm.spawn_node("by-id", "--model", model_id, "--layers", "0:4",
                                 "--cache-dir", str(tmp_path / "c-id"), *limit, command="join")
        fetches, serving = _until_ready(by_name)
        assert _until_ready(by_id)[1]["layers"] == [0, 4]
        assert serving["model"] == model_id and serving["layers"] == [4, 8]
        assert fetches and fetches[-1]["done"] + fetches[-1]["reused"] == fetches[-1]["total"]
        # it holds its span, the config and tokenizer, and nothing else of the model
        held = tmp_path / "c-name" / model_id
        # (the last span keeps the final norm and LM head too: tiny-llama ties its LM head to the embedding)
        assert sorted(p.name for p in held.glob("model-*.safetensors")) == sorted(
            [f"model-layer-{i:05d}.safetensors" for i in range(4, 8)] + ["model-embed.safetensors",
                                                                          "model-norm.safetensors"])

        # a peer whose files went bad on disk serves bad chunks: a joiner catches it at the first
        # chunk, drops it, names it, and completes from the first peer
        good = {f: f.read_bytes() for f in held.glob("model-layer-*.safetensors")}
        for f, data in good.items():  # every tensor of its layers: whichever chunks it is asked for
            start = 8 + struct.unpack("<Q", data[:8])[0]
            f.write_bytes(data[:start] + bytes(b ^ 0x5A for b in data[start:]))
        checker = swarm.spawn_node("checker", "--model", "tiny-llama", "--layers", "4:8",
                                   "--cache-dir", str(tmp_path / "c-check"), "--threads", "1", command="join")
        fetches, serving = _until_ready(checker)
        liar = serving_peer(by_name)
        assert liar in fetches[-1]["bad"] and serving["layers"] == [4, 8], fetches[-1]
        log_line = "dropping weights source " + liar[:16]
        assert log_line in checker.log_path.read_text()
        checker.stop()
        for f, data in good.items():
            f.write_bytes(data)

        # the first peer leaves: the two that fetched serve the whole model on their own
        swarm.procs[1].stop()
        r = shardnet("generate", "--model", "tiny-llama", "--bootstrap", boot, "--cache-dir", str(tmp_path / "thin"),
                     "-n", str(NEW), PROMPT, timeout=180, env={"HF_HUB_OFFLINE": "1"})
        assert r.returncode == 0, r.stderr
        tok = Tokenizer.from_file(str(model / "tokenizer.json"))
        assert r.stdout.partition("\n-- ")[0] == tok.decode(tok.encode(PROMPT).ids + transformers_greedy(model, PROMPT, NEW))
        thin = tmp_path / "thin" / model_id
        assert not list(thin.glob("model-layer-*")), "a thin client never fetches a layer"
        assert (thin / "model-embed.safetensors").is_file() and (thin / "tokenizer.json").is_file()

        # with the LM head applied by the last peer, the client fetches the embedding alone
        r = shardnet("generate", "--model", model_id, "--bootstrap", boot, "--cache-dir", str(tmp_path / "thinner"),
                     "--logits-on-last", "-n", "4", PROMPT, timeout=180, env={"HF_HUB_OFFLINE": "1"})
        assert r.returncode == 0, r.stderr
        assert sorted(p.name for p in (tmp_path / "thinner" / model_id).glob("model-*")) == ["model-embed.safetensors"]

        # a client of a model nobody serves is told what the swarm does serve
        other = init_random(tmp_path / "other", "llama", layers=2, hidden=32, heads=2, kv_heads=1, vocab=300)
        r = shardnet("generate", "--model", str(other), "--bootstrap", boot, "--route-timeout", "2", "hi", timeout=120)
        assert_one_line_failure(r, rf"no live peer serves layers 0-1 .*the swarm serves: tiny-llama "
                                   rf"\({model_id[:16]}…, 2 peers\)")

        # what the swarm serves
        r = shardnet("models", "--bootstrap", boot, "--json", timeout=120)
        assert r.returncode == 0, r.stderr
        listed = json.loads(r.stdout)
        assert [(m["model_id"], m["covered"], m["family"]) for m in listed] == [(model_id, [[0, 8]], "llama")]
        assert "tiny-llama" in listed[0]["names"] and listed[0]["peers"] == 2
        r = shardnet("models", "--bootstrap", boot, timeout=120)
        assert r.returncode == 0 and "tiny-llama" in r.stdout and "0-7/8" in r.stdout, r.stdout

        # a peer serves another model as "tiny-llama": `shardnet models` shows the conflict, a node
        # that never bound the name is refused in one line; the nodes here, which bound it when they
        # joined, keep meaning the model first seen (the resumed join below fetches it, not this one)
        impostor = init_random(tmp_path / "impostor" / "tiny-llama", "llama", layers=2, hidden=32, heads=2,
                               kv_heads=1, vocab=300)
        swarm.join_spans([(0, 2)], "--model", str(impostor), "--threads", "1")
        for _ in range(20):
            r = shardnet("models", "--bootstrap", boot, "--wait", "5", timeout=120)
            if "conflict:" in r.stdout:
                break
        assert "conflict: 'tiny-llama' is claimed by 2 models: " in r.stdout, r.stdout
        assert re.search(rf"{model_id[:12]} \(\d+ publishers: ", r.stdout), r.stdout
        r = shardnet("generate", "--model", "tiny-llama", "--bootstrap", boot, "-n", "2", PROMPT, timeout=120,
                     env={"HF_HUB_OFFLINE": "1", "SHARDNET_MODEL_NAMES": str(tmp_path / "fresh-names.json")})
        assert_one_line_failure(r, rf"model name 'tiny-llama' is claimed by 2 models: .*{model_id[:12]}.*"
                                   rf"{Checkpoint(impostor).model_id[:12]}.*give tiny-llama@ID-PREFIX")

        # a fetch killed halfway resumes without fetching its verified chunks again
        cache = tmp_path / "c-resume"
        first = swarm.spawn_node("resume", "--model", "tiny-llama", "--layers", "0:8", "--cache-dir", str(cache),
                                 *limit, command="join")
        while True:
            e = first.next_event(120)
            if e.get("event") == "fetch" and e["what"] == "layers" and e["done"] > e["total"] // 3:
                total, verified = e["total"], e["done"]  # bytes written, each checked, before this event
                break
        first.stop(signal.SIGKILL)
        again = swarm.spawn_node("resumed", "--model", "tiny-llama", "--layers", "0:8", "--cache-dir", str(cache),
                                 *limit, command="join")
        fetches, serving = _until_ready(again)
        layer_fetches = [e for e in fetches if e["what"] == "layers"]
        last = layer_fetches[-1]
        assert last["done"] <= total - verified and last["done"] + last["reused"] == last["total"], layer_fetches
        assert serving["layers"] == [0, 8]
        assert not any(Path(cache, model_id, ".partial").glob("*.chunks"))
