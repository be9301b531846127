"""``shardnet model``: model files (random checkpoints, manifests)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from shardnet.inference.model.families import FAMILIES

from .common import fail, say


@click.group()
def model() -> None:
    """Model files: random checkpoints, manifests."""


@model.command("init-random")
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option("--family", default="llama", type=click.Choice(list(FAMILIES)), show_default=True)
@click.option("--layers", default=4, show_default=True)
@click.option("--hidden", default=64, show_default=True)
@click.option("--heads", default=4, show_default=True)
@click.option("--kv-heads", default=2, show_default=True)
@click.option("--intermediate", default=None, type=int)
@click.option("--vocab", default=512, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--dtype", default="float32", type=click.Choice(["float32", "bfloat16", "float16"]), show_default=True)
@click.option("--shards", default=1, show_default=True, help="Split the weights into this many files.")
@click.option("--experts", default=4, show_default=True, help="Routed experts per MoE layer (MoE families).")
@click.option("--active-experts", default=2, show_default=True, help="Experts each token is routed to.")
def model_init_random(out, family, layers, hidden, heads, kv_heads, intermediate, vocab, seed, dtype, shards,
                      experts, active_experts) -> None:
    """Write a random checkpoint (any size) to OUT."""
    from shardnet.inference.model.random_model import init_random

    if hidden % heads or heads % kv_heads:
        fail("--hidden must be a multiple of --heads, and --heads of --kv-heads", 2)
    if not 1 <= active_experts <= experts:
        fail("--active-experts must be between 1 and --experts", 2)
    path = init_random(out, family, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                       intermediate=intermediate, vocab=vocab, seed=seed, dtype=dtype, shards=shards,
                       experts=experts, active_experts=active_experts)
    say(f"wrote {family} ({layers} layers, hidden {hidden}) to {path}")


@model.command("manifest")
@click.argument("path", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True)
def model_manifest(path, as_json) -> None:
    """Print a checkpoint's model ID (and its manifest with --json)."""
    from shardnet.inference.model.checkpoint import Checkpoint, CheckpointError

    try:
        ck = Checkpoint(path)
        m = ck.manifest()
    except CheckpointError as e:
        fail(str(e))
    if as_json:
        say(json.dumps({"model_id": ck.model_id, "manifest": m}, indent=2))
    else:
        say(f"model id: {ck.model_id}")
        say(f"family:   {m['model_type']}, {m['num_layers']} layers")
