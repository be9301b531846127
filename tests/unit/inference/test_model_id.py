"""A model's ID commits to every layer's weights."""

from shardnet.inference.model.checkpoint import Checkpoint
from shardnet.inference.model.random_model import init_random


def test_model_id_depends_on_every_layer(tmp_path):
    a = init_random(tmp_path / "a", "llama", layers=2, hidden=32, heads=2, kv_heads=1, vocab=300, seed=1)
    b = init_random(tmp_path / "b", "llama", layers=2, hidden=32, heads=2, kv_heads=1, vocab=300, seed=1)
    c = init_random(tmp_path / "c", "llama", layers=2, hidden=32, heads=2, kv_heads=1, vocab=300, seed=2)
    ma, mb, mc = Checkpoint(a).manifest(), Checkpoint(b).manifest(), Checkpoint(c).manifest()
    assert Checkpoint(a).model_id == Checkpoint(b).model_id != Checkpoint(c).model_id
    assert ma["layers"] == mb["layers"] and ma["layers"][0] != mc["layers"][0]
