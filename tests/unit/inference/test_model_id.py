"""A model's ID commits to every layer's weights."""

from shardnet.inference.model.checkpoint import Checkpoint
from shardnet.inference.model.random_model import init_random


def test_model_id_depends_on_every_layer(tmp_path):
    a = init_random(tmp_path / "a", "llama", layers=2, hidden=32, heads=2, kv_heads=1, vocab=300, seed=1)
    b = init_random(tmp_path / "b", "llama", layers=2, hidden=32, heads=2, kv_heads=1, vocab=300, seed=1)
    c = init_random(tmp_path / "c", "llama", layers=2, hidden=32, heads=2, kv_heads=1, vocab=300, seed=2)
    ma, mb, mc = Checkpoint(a).manifest(), Checkpoint(b).manifest(), Checkpoint(c).manifest()
    assert Checkpoint(a).model_id == Checkpoint(b).model_id != Checkpoint(c).model_id
    name = "model.layers.0.self_attn.q_proj.weight"
    assert ma["tensors"] == mb["tensors"] and ma["tensors"][name] != mc["tensors"][name]
    # each tensor's root commits to its dtype, shape, size and every 1 MiB chunk
    dtype, shape, size, root = ma["tensors"][name]
    assert (dtype, shape, size) == ("F32", [32, 32], 32 * 32 * 4) and len(root) == 64
    assert set(ma["files"]) >= {"config.json"}

