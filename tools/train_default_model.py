"""Train shardnet's embedded default models, reproducibly, on an offline corpus.

    python -m tools.train_default_model [--steps 600] [--out shardnet/models]

Corpus: the top-level modules of the Python standard library of the running interpreter (always
present, no download). Tokenizer: byte-level BPE (2,048 tokens) trained with ``tokenizers``.
Models, Llama architecture, sharing the tokenizer:

- ``tiny-llama``: 8 layers, hidden 224 (about 5.1 M parameters), the swarm's target model;
- ``tiny-llama-draft``: 1 layer, hidden 224, the draft for speculative decoding, distilled from
  the target: trained to match the target's next-token distribution (KL divergence) on the
  corpus and on the target's own continuations of corpus snippets, greedy and sampled. A draft
  only pays when the target agrees with it, and a target's own output (repetitive, in a tiny
  model) is what the draft is asked to predict at decode time.

Both are trained with the same seeded data order and saved in Hugging Face format (config.json,
model.safetensors in float16, tokenizer.json), small enough to ship in the repository.
``--draft-only`` distills a new draft from the shipped target without touching it. The
distillation itself is ``shardnet/inference/model/distill.py``'s (``shardnet model distill-draft``
runs it on any target).
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

from shardnet.inference.model.distill import SEED, batches, distill, fit
from shardnet.inference.model.distill import stdlib_corpus as corpus_text

VOCAB = 2048


def say(line: str) -> None:
    print(line, flush=True)


def train_tokenizer(text: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([text[i:i + 100_000] for i in range(0, len(text), 100_000)], trainer)
    return tok


def make_model(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=224, intermediate_size=640, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )
    return LlamaForCausalLM(cfg)


def train(model, ids: torch.Tensor, steps: int, name: str) -> float:
    """Next-token cross-entropy on corpus windows."""
    corpus = batches(ids, steps, random.Random(SEED))

    def batch_loss(_step: int) -> torch.Tensor:
        batch = next(corpus)
        return model(input_ids=batch[:, :-1], labels=batch[:, :-1].clone()).loss

    return fit(model, steps, batch_loss, name, "loss", log=say)


CHAT_TEMPLATE = ("{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def save(model, tok, out: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.float16).save_pretrained(out, safe_serialization=True)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                   eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE  # so the OpenAI gateway's chat endpoint works on it
    fast.save_pretrained(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--draft-steps", type=int, default=800)
    p.add_argument("--draft-only", action="store_true",
                   help="distill a new draft from the target already in --out; leave the target as it is")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "shardnet" / "models")
    args = p.parse_args()
    torch.manual_seed(SEED)
    random.seed(SEED)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    text = corpus_text()
    print(f"corpus: {len(text) / 1e6:.1f} MB of Python {sys.version.split()[0]} stdlib source", flush=True)
    if args.draft_only:
        from tokenizers import Tokenizer
        from transformers import AutoModelForCausalLM

        tok = Tokenizer.from_file(str(args.out / "tiny-llama" / "tokenizer.json"))
        ids = torch.tensor(tok.encode(text).ids, dtype=torch.long)
        target = AutoModelForCausalLM.from_pretrained(args.out / "tiny-llama", dtype=torch.float32).eval()
    else:
        tok = train_tokenizer(text)
        ids = torch.tensor(tok.encode(text).ids, dtype=torch.long)
        torch.manual_seed(SEED)
        target = make_model(8)
        print(f"[tiny-llama] 8 layers, {sum(p.numel() for p in target.parameters()) / 1e6:.2f} M parameters",
              flush=True)
        train(target, ids, args.steps, "tiny-llama")
        save(target, tok, args.out / "tiny-llama")
        # distil from the weights as shipped (float16), the model peers will actually serve
        target = target.to(torch.float16).float().eval()
        print(f"[tiny-llama] saved to {args.out / 'tiny-llama'}", flush=True)
    print(f"tokens: {len(ids) / 1e6:.2f} M", flush=True)
    torch.manual_seed(SEED)
    draft = make_model(1)
    print(f"[tiny-llama-draft] 1 layer, {sum(p.numel() for p in draft.parameters()) / 1e6:.2f} M parameters, "
          f"distilled from tiny-llama", flush=True)
    distill(draft, target, ids, args.draft_steps, log=say)
    save(draft, tok, args.out / "tiny-llama-draft")
    print(f"[tiny-llama-draft] saved to {args.out / 'tiny-llama-draft'}", flush=True)


if __name__ == "__main__":
    main()
