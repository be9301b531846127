"""Write random checkpoints of any supported family and size (tests and benchmarks).

The tokenizer is a byte-level BPE trained on a fixed text, so any random model has a real
tokenizer.json that encodes and decodes prompts.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_TOKENIZER_TEXT = (
    "def main():\n    print('hello world')\n    return 0\n\n"
    "class Node:\n    def __init__(self, peer_id, addrs):\n        self.peer_id = peer_id\n"
    "The quick brown fox jumps over the lazy dog. 0123456789 +-*/=<>()[]{}:;,.'\"\n"
) * 20


def make_config(family: str, *, layers: int, hidden: int, heads: int, kv_heads: int | None,
                intermediate: int | None, vocab: int, max_positions: int = 2048,
                sliding_window: int | None = None):
    from transformers import AutoConfig

    kw = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or hidden * 2,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads or heads,
        max_position_embeddings=max_positions, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
        # larger than the usual 0.02, so a random model's output depends on its context (near-zero
        # weights make every prompt continue with one repeated token, a weak test)
        initializer_range=0.25,
    )
    if family == "mistral":
        kw["sliding_window"] = sliding_window
    if family == "qwen3":
        kw["head_dim"] = hidden // heads
    return AutoConfig.for_model(family, **kw)


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
                sliding_window: int | None = None) -> Path:
    """Create a random ``family`` checkpoint in ``out``; returns the directory."""
    from transformers import AutoModelForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = make_config(family, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                      intermediate=intermediate, vocab=vocab, sliding_window=sliding_window)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    if family == "qwen2":
        # qkv biases are zero at init; make them matter, so a block that dropped them would fail
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    model = model.to(getattr(torch, dtype))
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    max_shard = None if shards <= 1 else max(1, size // shards + 1)
    model.save_pretrained(out, safe_serialization=True,
                          **({"max_shard_size": max_shard} if max_shard else {}))
    write_tokenizer(out, vocab)
    log.info("wrote random %s (%d layers, hidden %d) to %s", family, layers, hidden, out)
    return out
