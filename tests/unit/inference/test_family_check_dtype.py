"""The family check in the dtype a peer computes in (issue 36: no copy in a wider dtype): in
bfloat16 and float16 shardnet's block and transformers agree within a unit in the last place
(mostly bit for bit) on the families here, so the check's tolerance there (two units in the last
place at the largest value) refuses only real differences; a 1 % scale error is refused;
verdicts are kept per dtype."""

import json

import pytest
import torch

from shardnet.inference.model import family_check as fc
from shardnet.inference.model.checkpoint import Checkpoint
from shardnet.inference.model.random_model import init_random


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3_moe", "deepseek_v3", "gpt_oss"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_check_in_a_low_precision_dtype_matches_bit_for_bit(tmp_path, family, dtype, caplog):
    ckpt = Checkpoint(init_random(tmp_path / family, family, dtype="bfloat16", hidden=64, layers=4))
    layers = list(fc.representative_layers(ckpt, 0, ckpt.num_layers).values())
    caplog.set_level("INFO", logger=fc.__name__)
    verdicts = fc._compare(ckpt, layers, with_head=True, dtype=dtype)
    assert not any(verdicts.values()), verdicts
    said = [r.getMessage() for r in caplog.records if "matches transformers" in r.getMessage()]
    assert len(said) >= 2 * len(layers) + 2, said


def test_verdicts_are_kept_per_dtype_and_a_wrong_scale_is_refused_in_bfloat16(tmp_path):
    path = init_random(tmp_path / "g", "gemma2", dtype="bfloat16", hidden=64, layers=2)
    ckpt = Checkpoint(path)
    fc.ensure_family_matches(ckpt, (0, 2), dtype=torch.bfloat16)
    kept = json.loads((path / fc.VERDICT_CACHE).read_text())["verdicts"]
    assert kept and all(k.startswith("bfloat16:") for k in kept)
    fc.ensure_family_matches(ckpt, (0, 2), dtype=torch.float32)
    kept = json.loads((path / fc.VERDICT_CACHE).read_text())["verdicts"]
    assert {k.split(":")[0] for k in kept} == {"bfloat16", "float32"}
    # a 1 % error of scale (a missed multiplier's size) is far beyond the bfloat16 tolerance
    from shardnet.inference.model.block import Head

    embedded = Head(ckpt, dtype=torch.bfloat16).embed(fc._check_ids(ckpt))
    tolerance = fc.TOLERANCES[torch.bfloat16][0]
    assert fc._differs(ckpt, "its embeddings", embedded, embedded, tolerance) is None
    assert "differs from transformers" in fc._differs(ckpt, "its embeddings", embedded * 1.01, embedded, tolerance)


@pytest.mark.parametrize("fmt", ["none", "fp8"])
def test_the_check_reads_a_layer_once_and_its_block_computes_from_the_tensors_transformers_ran(tmp_path, monkeypatch,
                                                                                              fmt):
    """No second copy of a checked layer: its tensors are read once, in the checkpoint's own
    format, and the one-layer block holds those very tensors (an FP8 weight's stored bytes)."""
    import shardnet.inference.model.block as block_module
    from shardnet.inference.model.stored import StoredWeight

    path = init_random(tmp_path / "l", "llama", dtype="bfloat16", hidden=64, layers=2)
    if fmt == "fp8":
        from shardnet.testing.fp8 import quantize_checkpoint_fp8

        path = quantize_checkpoint_fp8(path, tmp_path / "l-fp8")
    ckpt = Checkpoint(path)
    read: dict[str, torch.Tensor] = {}
    reads: list[str] = []
    load = ckpt.load

    def counted(names, *args, **kwargs):
        out = load(names, *args, **kwargs)
        reads.extend(names)
        read.update(out)
        return out

    monkeypatch.setattr(ckpt, "load", counted)
    blocks = []

    class Kept(block_module.Block):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            blocks.append(self)

    monkeypatch.setattr(block_module, "Block", Kept)
    assert fc._compare(ckpt, [1], with_head=False, dtype=torch.bfloat16) == {1: None}
    assert sorted(reads) == sorted(ckpt.layer_tensors(1))
    ptrs = {t.data_ptr() for t in read.values()}
    held = [p.parts["weight"] if isinstance(p, StoredWeight) else p for p in blocks[0].layers.parameters()]
    assert held and all(p.data_ptr() in ptrs for p in held)
    assert (fmt == "fp8") == any(isinstance(p, StoredWeight) for p in blocks[0].layers.parameters())
