"""The family mechanism: refusals from the config, from the weights and from the first-layer
check, each one line; the check's verdict kept per checkpoint."""

import json

import pytest

from shardnet.errors import CheckpointError
from shardnet.inference.model import family_check
from shardnet.inference.model.checkpoint import Checkpoint
from shardnet.inference.model.families import FAMILIES, Family, family_for
from shardnet.inference.model.random_model import init_random


def one_line(e):
    assert "\n" not in str(e)
    return str(e)


@pytest.mark.parametrize("config, reason", [
    ({}, "config.json has no model_type"),
    ({"model_type": "t5"}, "no causal language model for it"),
    ({"model_type": "qwen3_next", "layer_types": ["linear_attention", "full_attention"]}, "'linear_attention'"),
    ({"model_type": "gemma3_text", "use_bidirectional_attention": True}, "causal attention only"),
])
def test_what_the_config_alone_refuses(config, reason):
    with pytest.raises(CheckpointError, match=reason) as e:
        family_for(config)
    one_line(e.value)


def test_a_family_without_an_adapter_runs_generically():
    fam = family_for({"model_type": "olmoe"})
    assert fam.generic and fam.model_type == "olmoe"
    assert not FAMILIES["deepseek_v3"].generic


def test_weights_without_the_standard_stack_are_refused(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", vocab_size=64, n_embd=32, n_layer=1, n_head=2)
                                     ).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="no model.layers.N decoder stack") as e:
        Checkpoint(tmp_path)
    one_line(e.value)


@pytest.fixture
def granite(tmp_path):
    return init_random(tmp_path / "granite", "granite", layers=2, hidden=32, heads=2, kv_heads=1, vocab=128)


def test_the_first_layer_check_passes_and_is_kept(granite, monkeypatch):
    family_check.ensure_family_matches(Checkpoint(granite))
    kept = json.loads((granite / family_check.VERDICT_CACHE).read_text())
    assert kept["refused"] is None and kept["key"]["family"].startswith("Family(model_type='granite'")

    def must_not_run(ckpt):
        raise AssertionError("the kept verdict was not used")
    monkeypatch.setattr(family_check, "_compare_first_layer", must_not_run)
    family_check.ensure_family_matches(Checkpoint(granite))


def test_a_family_missing_its_adapter_is_refused_by_the_check(granite, monkeypatch):
    """Granite without its multipliers declared: the check sees the difference and refuses."""
    monkeypatch.setitem(FAMILIES, "granite", Family("granite"))
    with pytest.raises(CheckpointError, match=r"logits differ from transformers' by .*needs an adapter") as e:
        family_check.ensure_family_matches(Checkpoint(granite))
    one_line(e.value)
    # and the refusal is kept: no second run, same line
    with pytest.raises(CheckpointError, match="needs an adapter"):
        family_check.ensure_family_matches(Checkpoint(granite))


def test_stored_quantization_other_than_fp8_blocks_is_refused(granite):
    cfg = json.loads((granite / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (granite / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="stored quantization 'awq' is not supported") as e:
        Checkpoint(granite)
    one_line(e.value)


def test_a_config_transformers_rejects_is_one_line(tmp_path):
    path = init_random(tmp_path / "llama", "llama", layers=1, hidden=32, heads=2, kv_heads=1, vocab=128)
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_attention_heads"] = 5  # hidden 32 is not a multiple of it
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="transformers refuses it") as e:
        Checkpoint(path).config
    one_line(e.value)


def test_multi_token_prediction_layers_after_the_stack_are_allowed(tmp_path):
    """DeepSeek-V3 ships model.layers.61 (MTP) after 61 layers; transformers skips it, so do we."""
    from safetensors.torch import load_file, save_file

    path = init_random(tmp_path / "ds", "deepseek_v3", layers=2, hidden=32, heads=2, vocab=128)
    tensors = load_file(path / "model.safetensors")
    tensors.update({n.replace("model.layers.1.", "model.layers.2."): t.clone()
                    for n, t in tensors.items() if n.startswith("model.layers.1.")})
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    for mtp in (0, 1):
        cfg["num_nextn_predict_layers"] = mtp
        (path / "config.json").write_text(json.dumps(cfg))
        if mtp:
            assert Checkpoint(path).manifest()["num_layers"] == 2
        else:
            with pytest.raises(CheckpointError, match="1 beyond it"):
                Checkpoint(path).manifest()
