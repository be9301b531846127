"""Generating through a swarm from a plain script or a notebook, in the Hugging Face style.

    python examples/hf_client.py --bootstrap /ip4/127.0.0.1/tcp/4001/p2p/12D3KooW... [--model tiny-llama]

No trio, no async: ``DistributedModelForCausalLM`` runs the overlay on a background thread. Its
``generate`` takes and returns what transformers' does, so code written for a local model runs
against a swarm by changing the line that loads it. The tokenizer is transformers' own, read from
the directory the model's files are in (fetched from the swarm when ``--model`` names a model
this machine has no files of).
"""

from __future__ import annotations

import argparse
import sys

from transformers import AutoTokenizer, TextStreamer

import shardnet


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bootstrap", action="append", required=True, help="a swarm peer's multiaddr")
    p.add_argument("--model", default=None, help="directory, Hugging Face repo, or a name the swarm serves "
                                                  "(default: the shipped tiny-llama)")
    p.add_argument("--prompt", default="def main(")
    p.add_argument("-n", "--max-new-tokens", type=int, default=24)
    args = p.parse_args()

    # the first cell of a notebook: join the swarm as a client of the model (a few seconds)
    model = shardnet.DistributedModelForCausalLM.from_pretrained(args.model, bootstrap=args.bootstrap)
    with model:
        tokenizer = AutoTokenizer.from_pretrained(model.name_or_path)

        # greedy, as transformers' generate: the prompt's ids with the new ones after them
        input_ids = tokenizer(args.prompt, return_tensors="pt").input_ids
        out = model.generate(input_ids, max_new_tokens=args.max_new_tokens, do_sample=False)
        print("greedy:", tokenizer.decode(out[0]))

        # two prompts at once: each row is a session of its own, batched on the peers
        batch = tokenizer(["import os", "class A"], return_tensors="pt", padding=True)
        out = model.generate(**batch, max_new_tokens=8)
        for row in out:
            print("batch:", tokenizer.decode(row, skip_special_tokens=True))

        # sampled, streamed token by token as it arrives (seeded: the same text every run)
        print("sampled: ", end="", flush=True)
        model.generate(input_ids, max_new_tokens=args.max_new_tokens, do_sample=True, temperature=0.8,
                       seed=7, streamer=TextStreamer(tokenizer, skip_prompt=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
