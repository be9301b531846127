"""User errors found by trying shardnet as a new user would: each is one `error:` line and a
non-zero exit (never "unexpected ... (a bug)"), and the manifest is never stale or wrong."""

import json
import os
import shutil

import pytest

from shardnet.inference.model.checkpoint import Checkpoint, CheckpointError
from shardnet.inference.model.random_model import init_random
from shardnet.testing.helpers import FAKE_ID, assert_one_line_failure, shardnet
from shardnet.transport.errors import ShardnetError


@pytest.fixture
def model(tmp_path):
    return init_random(tmp_path / "m", "llama", layers=4, hidden=32, heads=2, kv_heads=1, vocab=300, seed=4)


def set_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("layers, pattern", [
    (6, r"num_hidden_layers = 6 but the weights hold layers 0-3; missing 2 \(first: 4\)"),
    (2, r"num_hidden_layers = 2 but the weights hold layers 0-3; 2 beyond it"),
])
def test_a_config_that_disagrees_with_the_tensors_fails_the_manifest(model, layers, pattern):
    set_config(model, num_hidden_layers=layers)
    with pytest.raises(CheckpointError, match=pattern):
        Checkpoint(model).manifest()
    r = shardnet("model", "manifest", str(model))
    assert_one_line_failure(r, pattern)


def test_a_layer_missing_a_tensor_or_a_wrong_hidden_size_fails_the_manifest(model, tmp_path):
    set_config(model, hidden_size=48)
    with pytest.raises(CheckpointError, match=r"hidden_size = 48 but model.embed_tokens.weight has shape \[300, 32\]"):
        Checkpoint(model).manifest()
    set_config(model, hidden_size=32)
    Checkpoint(model).manifest()  # as written: fine
    from safetensors.torch import load_file, save_file

    tensors = load_file(model / "model.safetensors")
    del tensors["model.layers.2.mlp.up_proj.weight"]
    save_file(tensors, model / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"layer 2 of m does not have the tensors layer 0 has"):
        Checkpoint(model).manifest()


def test_weights_edited_in_place_get_a_new_model_id(model):
    before = Checkpoint(model).model_id  # hashed, and cached on disk
    assert Checkpoint(model).model_id == before
    weights = model / "model.safetensors"
    st = os.stat(weights)
    entry = Checkpoint(model).entries["model.layers.1.self_attn.q_proj.weight"]
    with open(weights, "r+b") as f:  # same size, then the same mtime again: what the old cache trusted
        f.seek(entry.start)
        old = f.read(4)
        f.seek(entry.start)
        f.write(bytes(b ^ 0xFF for b in old))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (os.stat(weights).st_size, os.stat(weights).st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    after = Checkpoint(model).model_id
    assert after != before
    r = shardnet("model", "manifest", str(model))
    assert r.returncode == 0 and after in r.stdout, r.stderr


def test_checkpoint_errors_are_user_errors(model, tmp_path):
    assert issubclass(CheckpointError, ShardnetError)
    other = tmp_path / "gpt2"
    shutil.copytree(model, other)
    set_config(other, model_type="gpt2")
    boot = f"/ip4/127.0.0.1/tcp/9/p2p/{FAKE_ID}"
    for cmd in (["generate", "--model", str(other), "--bootstrap", boot, "hi"],
                ["serve", "--model", str(other), "--bootstrap", boot, "--port", "0"]):
        r = shardnet(*cmd)
        assert_one_line_failure(r, r"model_type 'gpt2' is not supported: its transformers model has no layers")
        assert "unexpected" not in r.stderr
    set_config(other, model_type="llama", num_hidden_layers="four")
    r = shardnet("model", "manifest", str(other))
    assert_one_line_failure(r, r"num_hidden_layers must be a positive integer, not 'four'")


def test_cuda_is_refused_before_joining_on_a_machine_without_it(model, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    # an unreachable bootstrap: had it tried to join first, the error would name the bootstrap
    r = shardnet("join", "--model", str(model), "--identity", str(tmp_path / "k"), "--device", "cuda",
                 "--bootstrap", f"/ip4/127.0.0.1/tcp/9/p2p/{FAKE_ID}")
    assert_one_line_failure(r, r"--device cuda: no CUDA device is available on this machine.*use --device cpu")
    assert r.returncode == 2 and "bootstrap" not in r.stderr
    r = shardnet("join", "--model", str(model), "--identity", str(tmp_path / "k"), "--device", "gpu7")
    assert_one_line_failure(r, r"--device 'gpu7' is not a torch device")
