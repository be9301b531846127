"""The family mechanism: refusals from the config, from the weights and from the check of every
layer kind against transformers, each one line; the check's verdicts kept per checkpoint."""

import json

import pytest

from shardnet.errors import CheckpointError
from shardnet.inference.model import family_check
from shardnet.inference.model.checkpoint import Checkpoint
from shardnet.inference.model.families import FAMILIES, Family, family_for
from shardnet.inference.model.random_model import init_random
from shardnet.testing.helpers import one_line


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


def test_the_check_passes_and_each_verdict_is_kept(granite, monkeypatch):
    family_check.ensure_family_matches(Checkpoint(granite), (0, 2))
    kept = json.loads((granite / family_check.VERDICT_CACHE).read_text())
    assert kept["key"]["family"].startswith("Family(model_type='granite'")
    assert set(kept["verdicts"]) >= {"float32:head"} and len(kept["verdicts"]) == 2  # the head, one layer kind
    assert not any(kept["verdicts"].values())

    def must_not_run(*args, **kwargs):
        raise AssertionError("a kept verdict was not used")
    monkeypatch.setattr(family_check, "_compare", must_not_run)
    family_check.ensure_family_matches(Checkpoint(granite), (0, 2))


def test_a_family_missing_its_adapter_is_refused_by_the_check(granite, monkeypatch):
    """Granite without its multipliers declared: the head's check sees the difference and refuses."""
    monkeypatch.setitem(FAMILIES, "granite", Family("granite"))
    with pytest.raises(CheckpointError, match=r"on its embeddings shardnet differs from transformers by .*"
                                              r"needs an adapter") as e:
        family_check.ensure_family_matches(Checkpoint(granite))
    one_line(e.value)
    # and the refusal is kept: no second run, same line
    monkeypatch.setattr(family_check, "_compare", None)
    with pytest.raises(CheckpointError, match="needs an adapter"):
        family_check.ensure_family_matches(Checkpoint(granite))


@pytest.fixture
def gemma2(tmp_path):
    """Full attention first, sliding windows (of 6) after: layer 0 alone says nothing of the rest."""
    path = init_random(tmp_path / "gemma2", "gemma2", layers=4, hidden=32, heads=2, kv_heads=1, vocab=128,
                       sliding_window=6)
    cfg = json.loads((path / "config.json").read_text())
    cfg["layer_types"] = ["full_attention", "sliding_attention"] * 2
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_every_layer_kind_of_a_span_is_checked_on_a_peer_without_the_head(gemma2, monkeypatch):
    """A block that masked every layer as full attention: layer 0 matches transformers, a sliding
    layer does not once positions pass its window; a peer serving 1:3 (no layer 0, no head) finds
    it."""
    assert sorted(family_check.representative_layers(Checkpoint(gemma2), 0, 4).values()) == [0, 1]
    full_only = Family("gemma2", "test", logit_softcap="final_logit_softcapping")
    monkeypatch.setattr(Family, "layer_types", lambda self, config: ["full_attention"] * config.num_hidden_layers)
    monkeypatch.setitem(FAMILIES, "gemma2", full_only)
    family_check.ensure_family_matches(Checkpoint(gemma2), (0, 1), head=False)  # layer 0 alone passes
    with pytest.raises(CheckpointError, match=r"on layer 1 \(full_attention\), prefill and cached steps shardnet "
                                              r"differs from transformers") as e:
        family_check.ensure_family_matches(Checkpoint(gemma2), (1, 3), head=False)
    one_line(e.value)


def test_layers_differing_by_index_are_told_apart():
    """Dense first layers then experts (DeepSeek-V3), alternating windows (Gemma 2): one layer of each
    configuration is checked; identical layers (Llama) once."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        for family, want in (("deepseek_v3", [0, 1]), ("gemma2", [0, 1]), ("llama", [0])):
            path = init_random(f"{tmp}/{family}", family, layers=4, hidden=32, heads=2, kv_heads=1, vocab=128)
            assert sorted(family_check.representative_layers(Checkpoint(path), 0, 4).values()) == want, family
            assert sorted(family_check.representative_layers(Checkpoint(path), 2, 4).values()) == \
                ([2, 3] if family == "gemma2" else [2]), family


def test_a_model_that_changes_the_hidden_state_between_layers_is_refused(granite, monkeypatch):
    """What transformers' forward does between two layers, a split cannot do: refused."""
    record = family_check._record_output

    def rescaled_after_recording(run, i):  # as if the model's forward scaled each layer's output
        hook = record(run, i)
        return lambda module, args, output: (hook(module, args, output), output * 2)[1]
    monkeypatch.setattr(family_check, "_record_output", rescaled_after_recording)
    with pytest.raises(CheckpointError, match="changes the hidden state between layers 0 and 1") as e:
        family_check.ensure_family_matches(Checkpoint(granite), (1, 2), head=False)
    one_line(e.value)


def test_a_stored_quantization_not_read_is_refused(granite):
    cfg = json.loads((granite / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (granite / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="stored quantization 'bitsandbytes' is not supported") as e:
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
