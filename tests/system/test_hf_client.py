"""The synchronous client in the Hugging Face style (shardnet.DistributedModelForCausalLM) against a
real local swarm (two compute peers, processes): generate returns what transformers' generate
returns on the same weights and dtype, for one row and a batch; sampling is seeded; what it cannot
honour is refused; the example script runs."""

import subprocess
import sys

import pytest
import torch

import shardnet
from shardnet.models import default_model_path
from shardnet.testing.helpers import REPO_ROOT, transformers_generate
from shardnet.testing.localswarm import LocalSwarm

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def swarm():
    with LocalSwarm() as s:
        s.start_bootstrap()
        s.join_spans([(0, 4), (4, 8)], "--threads", "1")
        yield s


def test_generate_is_transformers_generate(swarm):
    ids = torch.tensor([[746, 576, 1004, 40], [496, 480, 35, 301]])
    with shardnet.DistributedModelForCausalLM.from_pretrained(bootstrap=[swarm.bootstrap_addr],
                                                              audit_rate=0) as model:
        for row in (ids[:1], ids):
            got = model.generate(row, max_new_tokens=12)  # speculating (auto) by default
            want = transformers_generate(default_model_path(), row, max_new_tokens=12)  # its dtype, as the peers
            assert torch.equal(got, want), (got, want)
            assert torch.equal(model.generate(row, max_new_tokens=12, speculate="none"), want)
        # by default the shipped model's draft, suffix matching and plain decoding, chosen as it goes
        model.generate(ids, max_new_tokens=4)
        assert [list(d.candidates) for d in model.last_drafters] == [["draft", "suffix", "plain"]] * 2
        # without the end-of-sequence stop: always max_new_tokens new ones
        got = model.generate(ids[:1], max_new_tokens=10, eos_token_id=None)
        assert got.shape == (1, 14) and torch.equal(got[:, :4], ids[:1])

        # sampled: a seed fixes the text; torch.manual_seed fixes the drawn seed
        a = model.generate(ids[:1], max_new_tokens=8, do_sample=True, temperature=0.9, seed=3, eos_token_id=None)
        b = model.generate(ids[:1], max_new_tokens=8, do_sample=True, temperature=0.9, seed=3, eos_token_id=None)
        assert torch.equal(a, b)
        torch.manual_seed(0)
        c = model.generate(ids[:1], max_new_tokens=8, do_sample=True, eos_token_id=None)
        torch.manual_seed(0)
        d = model.generate(ids[:1], max_new_tokens=8, do_sample=True, eos_token_id=None)
        assert torch.equal(c, d)

        # what it cannot honour is refused, naming it
        with pytest.raises(ValueError, match="num_beams=4"):
            model.generate(ids, num_beams=4)
        with pytest.raises(ValueError, match="streamer takes batch size 1"):
            model.generate(ids, streamer=object())
        with pytest.raises(ValueError, match="speculate='beam': one of auto"):
            model.generate(ids, speculate="beam")
    with pytest.raises(shardnet.ShardnetError, match="closed"):
        model.generate(ids)


def test_the_example_script_runs(swarm):
    r = subprocess.run([sys.executable, str(REPO_ROOT / "examples" / "hf_client.py"), "--bootstrap",
                        swarm.bootstrap_addr, "-n", "8"], capture_output=True, text=True, timeout=180, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert lines[0].startswith("greedy: def main(") and len(lines[0]) > len("greedy: def main("), r.stdout
    assert sum(line.startswith("batch: ") for line in lines) == 2, r.stdout
    assert any(line.startswith("sampled: ") and len(line) > len("sampled: ") for line in lines), r.stdout
