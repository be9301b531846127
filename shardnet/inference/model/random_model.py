"""Write random checkpoints of any supported family and size (tests and benchmarks).

The tokenizer is a byte-level BPE trained on a fixed text, so any random model has a real
tokenizer.json that encodes and decodes prompts.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from shardnet.errors import CheckpointError
from shardnet.inference.model.families import FAMILIES

log = logging.getLogger(__name__)

_TOKENIZER_TEXT = (
    "def main():\n    print('hello world')\n    return 0\n\n"
    "class Node:\n    def __init__(self, peer_id, addrs):\n        self.peer_id = peer_id\n"
    "The quick brown fox jumps over the lazy dog. 0123456789 +-*/=<>()[]{}:;,.'\"\n"
) * 20


def _alternating(layers: int) -> list[str]:
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]


def _family_extras(family: str, *, layers: int, hidden: int, heads: int, intermediate: int,
                   sliding_window: int | None, experts: int, active_experts: int) -> dict:
    """What a small random checkpoint of ``family`` sets beyond the common shape: every feature
    its adapter or transformers' layers handle is switched on (a sliding window short enough to
    matter, non-trivial multipliers, experts with shared experts and dense first layers), so a
    block that dropped one would not match."""
    head_dim = hidden // heads
    window = sliding_window or 5
    n, k = experts, active_experts
    moe = dict(num_experts_per_tok=k, moe_intermediate_size=max(8, intermediate // 4))
    return {
        "mistral": dict(sliding_window=sliding_window),
        "qwen3": dict(head_dim=head_dim),
        "gemma2": dict(head_dim=head_dim, sliding_window=window, tie_word_embeddings=True,
                       query_pre_attn_scalar=head_dim),
        "gemma3_text": dict(head_dim=head_dim, sliding_window=window, tie_word_embeddings=True,
                            query_pre_attn_scalar=head_dim, layer_types=_alternating(layers)),
        "phi3": dict(),
        "olmo2": dict(),
        "granite": dict(embedding_multiplier=3.0, logits_scaling=4.0, residual_multiplier=0.5,
                        attention_multiplier=0.5 / head_dim ** 0.5),
        "mixtral": dict(num_local_experts=n, num_experts_per_tok=k, sliding_window=window),
        "qwen2_moe": dict(num_experts=n, shared_expert_intermediate_size=intermediate, mlp_only_layers=[0],
                          **moe),
        "qwen3_moe": dict(num_experts=n, head_dim=head_dim, mlp_only_layers=[0], **moe),
        # its YaRN rope expects the long context its real config has
        "gpt_oss": dict(num_local_experts=n, num_experts_per_tok=k, head_dim=head_dim, sliding_window=window,
                        layer_types=_alternating(layers), max_position_embeddings=131072),
        # MLA expands its latent into one key and value per query head, as DeepSeek-V3 ships
        "deepseek_v3": dict(num_key_value_heads=heads, n_routed_experts=n, n_shared_experts=1,
                            first_k_dense_replace=1, n_group=2 if n % 2 == 0 and n >= 4 else 1, topk_group=1, q_lora_rank=hidden // 2, kv_lora_rank=hidden // 4,
                            qk_rope_head_dim=head_dim // 2, qk_nope_head_dim=head_dim, v_head_dim=head_dim,
                            **moe),
        "glm4_moe": dict(n_routed_experts=n, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
                         topk_group=1, head_dim=head_dim, use_qk_norm=True, **moe),
    }.get(family, {})


def make_config(family: str, *, layers: int, hidden: int, heads: int, kv_heads: int | None,
                intermediate: int | None, vocab: int, max_positions: int = 2048,
                sliding_window: int | None = None, experts: int = 4, active_experts: int = 2):
    from transformers import AutoConfig

    intermediate = intermediate or hidden * 2
    kw = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads or heads,
        max_position_embeddings=max_positions, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
        # larger than the usual 0.02, so a random model's output depends on its context (near-zero
        # weights make every prompt continue with one repeated token, a weak test)
        initializer_range=0.25,
    )
    kw.update(_family_extras(family, layers=layers, hidden=hidden, heads=heads, intermediate=intermediate,
                             sliding_window=sliding_window, experts=experts, active_experts=active_experts))
    try:
        config = AutoConfig.for_model(family, **kw)
    except ValueError as e:
        if "Unrecognized model identifier" in str(e):
            raise CheckpointError(f"model_type {family!r}: the installed transformers has no such model") from None
        raise
    if not (family in FAMILIES and FAMILIES[family].tested):
        # a family without shapes of its own here (_family_extras covers the tested ones): its
        # config's other sizes made small as well
        small = _generic_small(config, hidden=hidden, heads=heads, intermediate=intermediate, experts=experts,
                               active_experts=active_experts, sliding_window=sliding_window)
        if small:
            config = AutoConfig.for_model(family, **{**kw, **small})
    return config


def _generic_small(config, *, hidden: int, heads: int, intermediate: int, experts: int, active_experts: int,
                   sliding_window: int | None) -> dict:
    """Small values for the size attributes ``config`` has beyond the common ones (expert counts
    and widths, MLA ranks, head widths, windows), so that any family's random checkpoint is tiny and
    still exercises what it has (experts, a window shorter than a prompt)."""
    head_dim = hidden // heads
    wanted = {
        "head_dim": head_dim,
        "num_experts": experts, "n_routed_experts": experts, "num_local_experts": experts,
        "moe_num_experts": experts, "num_experts_per_tok": active_experts, "moe_k": active_experts,
        "moe_topk": active_experts, "moe_intermediate_size": max(8, intermediate // 4),
        "shared_expert_intermediate_size": intermediate, "expert_intermediate_size": max(8, intermediate // 4),
        "n_shared_experts": 1, "num_shared_experts": 1, "n_group": 1, "topk_group": 1,
        "first_k_dense_replace": 1,
        "q_lora_rank": hidden // 2, "kv_lora_rank": hidden // 4, "qk_rope_head_dim": head_dim // 2,
        "qk_nope_head_dim": head_dim, "v_head_dim": head_dim,
        "sliding_window": sliding_window or 5,
    }
    return {k: v for k, v in wanted.items()
            if isinstance(getattr(config, k, None), int) and not isinstance(getattr(config, k), bool)
            and getattr(config, k) != v}


def write_tokenizer(out: Path, vocab: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min(vocab, 400), special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_TOKENIZER_TEXT], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                            bos_token="<|endoftext|>").save_pretrained(out)


def init_random(out: str | Path, family: str = "llama", *, layers: int = 4, hidden: int = 64,
                heads: int = 4, kv_heads: int | None = 2, intermediate: int | None = None,
                vocab: int = 512, seed: int = 0, dtype: str = "float32", shards: int = 1,
                sliding_window: int | None = None, experts: int = 4, active_experts: int = 2,
                max_positions: int = 2048) -> Path:
    """Create a random ``family`` checkpoint in ``out``; returns the directory. ``max_positions``:
    the context its config allows (``max_position_embeddings``)."""
    from transformers import AutoModelForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = make_config(family, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                      intermediate=intermediate, vocab=vocab, max_positions=max_positions,
                      sliding_window=sliding_window, experts=experts, active_experts=active_experts)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        # biases and routers' correction terms are zero at init; make them matter, so a block
        # that dropped one would fail
        for name, p in model.named_parameters():
            if name.endswith("bias") or "sinks" in name:
                p.normal_(0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    model = model.to(getattr(torch, dtype))
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    max_shard = None if shards <= 1 else max(1, size // shards + 1)
    model.save_pretrained(out, safe_serialization=True,
                          **({"max_shard_size": max_shard} if max_shard else {}))
    write_tokenizer(out, vocab)
    log.info("wrote random %s (%d layers, hidden %d) to %s", family, layers, hidden, out)
    return out
