"""``shardnet model distill-draft``: a draft distilled from the shipped tiny-llama, loadable as a
ModelDrafter, closer to its target than where it started; bad sizes refused in one line."""

import json
import random

import torch
from click.testing import CliRunner

from shardnet.cli.model import model
from shardnet.inference.client.speculative import ModelDrafter
from shardnet.inference.model.distill import batches, distill, draft_of
from shardnet.models import default_model_path

CORPUS = "def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n" * 20


def kl_on(draft, target, window: torch.Tensor) -> float:
    with torch.no_grad():
        t = torch.log_softmax(target(input_ids=window).logits, -1)
        d = torch.log_softmax(draft(input_ids=window).logits, -1)
        return float(torch.nn.functional.kl_div(d.flatten(0, 1), t.flatten(0, 1), log_target=True,
                                                reduction="batchmean"))


def test_distilling_brings_the_draft_closer_to_its_target():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_path()
    target = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = torch.tensor(AutoTokenizer.from_pretrained(str(path))(CORPUS)["input_ids"])
    window = next(batches(ids, 1, random.Random(7), seq=32, batch=4))[:, :-1]
    draft = draft_of(target, 1)
    before = kl_on(draft, target, window)
    distill(draft, target, ids, 40, continuations=8, seq=32, batch=4, log=lambda _: None)
    assert kl_on(draft, target, window) < 0.8 * before


def test_the_command_writes_a_draft_a_client_can_use(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(CORPUS)
    out = tmp_path / "draft"
    r = CliRunner().invoke(model, ["distill-draft", str(default_model_path()), str(out), "--steps", "4",
                                   "--corpus", str(corpus), "--continuations", "0", "--seq", "32", "--batch", "2"])
    assert r.exit_code == 0, r.output
    assert r.stdout.strip().startswith("wrote a 1-layer draft of") and len(r.stdout.strip().splitlines()) == 1
    config = json.loads((out / "config.json").read_text())
    target = json.loads((default_model_path() / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["vocab_size"] == target["vocab_size"]
    drafter = ModelDrafter(out, vocab_size=target["vocab_size"])
    assert len(drafter.propose([1, 2, 3], 3)) == 3


def test_a_draft_as_deep_as_its_target_is_refused(tmp_path):
    r = CliRunner().invoke(model, ["distill-draft", str(default_model_path()), str(tmp_path / "d"), "--layers", "8",
                                   "--steps", "1"])
    assert r.exit_code == 1
    assert r.stderr.strip() == "error: a draft of 8 layer(s) from a target of 8: between 1 and 7"
