"""``shardnet model``: model files (random checkpoints, manifests); ``shardnet models``: what the swarm serves."""

from __future__ import annotations

import json
from pathlib import Path

import click

from shardnet.inference.model.families import FAMILIES

from .common import fail, network_options, run, say, visitor_config, wrap_errors


#: ``init-random --format``: "module:function" writing a stored-format copy of a checkpoint
#: (``function(src_dir, dst) -> path``), each with its format's reference quantizer
STORED_FORMAT_WRITERS = {
    "fp8": "shardnet.testing.fp8:quantize_checkpoint_fp8",
    "gguf-q8_0": "shardnet.testing.gguf:convert_to_gguf_q8_0", "gguf-q4_k": "shardnet.testing.gguf:convert_to_gguf_q4_k",
    **{f: f"shardnet.testing.int4:write_{f.replace('-', '_')}" for f in ("gptq", "awq", "compressed-tensors")},
    "mxfp4": "shardnet.testing.mxfp4:quantize_checkpoint_mxfp4",
}


def stored_format_writer(fmt: str):
    import importlib

    module, name = STORED_FORMAT_WRITERS[fmt].split(":")
    return getattr(importlib.import_module(module), name)


@click.group()
def model() -> None:
    """Model files: random checkpoints, manifests."""


@model.command("init-random")
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option("--family", default="llama", show_default=True,
              help=f"Any causal LM model_type of the installed transformers ({', '.join(FAMILIES)} are tested here).")
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
@click.option("--max-positions", default=2048, show_default=True, type=click.IntRange(min=1),
              help="The context the config allows (max_position_embeddings).")
@click.option("--format", "fmt", default="none", type=click.Choice(["none", *STORED_FORMAT_WRITERS]),
              show_default=True, help="Store it quantized as checkpoints of that format ship (--dtype: the "
              "unquantized tensors' dtype).")
@wrap_errors
def model_init_random(out, family, layers, hidden, heads, kv_heads, intermediate, vocab, seed, dtype, shards,
                      experts, active_experts, max_positions, fmt) -> None:
    """Write a random checkpoint (any size) to OUT."""
    import tempfile

    from shardnet.inference.model.random_model import init_random

    if hidden % heads or heads % kv_heads:
        fail("--hidden must be a multiple of --heads, and --heads of --kv-heads", 2)
    if not 1 <= active_experts <= experts:
        fail("--active-experts must be between 1 and --experts", 2)
    kw = dict(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, intermediate=intermediate, vocab=vocab,
              seed=seed, dtype=dtype, shards=shards, experts=experts, active_experts=active_experts,
              max_positions=max_positions)
    if fmt == "none":
        path = init_random(out, family, **kw)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            plain = init_random(Path(tmp) / "plain", family, **kw)
            path = stored_format_writer(fmt)(plain, out)
    say(f"wrote {family} ({layers} layers, hidden {hidden}{'' if fmt == 'none' else ', ' + fmt}) to {path}")


@model.command("distill-draft")
@click.argument("target", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option("--layers", default=1, show_default=True, type=click.IntRange(min=1),
              help="The draft's layers (it starts as the target's first ones, with its embeddings and head).")
@click.option("--steps", default=300, show_default=True, type=click.IntRange(min=1), help="Training steps.")
@click.option("--corpus", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="A text file to distill on (default: the Python standard library's sources, offline).")
@click.option("--continuations", default=256, show_default=True, type=click.IntRange(min=0),
              help="The target's own continuations of corpus snippets to distill on too (0: none).")
@click.option("--seq", default=128, show_default=True, type=click.IntRange(min=8), help="Tokens per window.")
@click.option("--batch", default=16, show_default=True, type=click.IntRange(min=1), help="Windows per step.")
@wrap_errors
def model_distill_draft(target, out, layers, steps, corpus, continuations, seq, batch) -> None:
    """Distill a draft for speculative decoding (generate --speculate draft --draft OUT) from the
    checkpoint TARGET: trained to match TARGET's next-token distributions, on CPU. Progress on
    stderr."""
    from shardnet.inference.model.distill import distill_draft

    text = corpus.read_text(encoding="utf-8", errors="replace") if corpus is not None else None
    try:
        kl = distill_draft(target, out, layers=layers, steps=steps, corpus=text, continuations=continuations,
                           seq=seq, batch=batch)
    except (ValueError, OSError) as e:
        fail(str(e).splitlines()[0])
    say(f"wrote a {layers}-layer draft of {target} to {out} (KL to the target {kl:.3f})")


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


@click.command("models")
@network_options("/ip4/0.0.0.0/tcp/0")
@click.option("--wait", default=15.0, show_default=True, help="Seconds to look for models and their peers.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@wrap_errors
def models(listen, announce, bootstrap, quic, mdns, relays, wait, as_json) -> None:
    """The models the swarm serves: name, model ID, family, size, layers covered, peers, quantization;
    then each name that several models claim (a conflict), and which of them is bound here."""
    from shardnet.inference.weights.cards import list_models
    from shardnet.inference.weights.names import NameBindings
    from shardnet.transport import open_node

    if not bootstrap and not mdns:
        fail("models needs --bootstrap MADDR (or --mdns)", 2)
    cfg = visitor_config(relays, listen, announce, bootstrap, quic, mdns)

    async def _main() -> list:
        async with open_node(cfg) as n:
            if bootstrap:
                await n.wait_bootstrapped()
            click.echo("asking the swarm which models it serves…", err=True)
            return [m.to_json() for m in await list_models(n, timeout=wait)]

    found = run(_main)
    bound = NameBindings().all()
    for m in found:
        m["bound_here"] = sorted(n for n in {*m["names"], *m["conflicts"]}
                                 if n in bound and bound[n].model_id == m["model_id"])
    if as_json:
        say(json.dumps(found, indent=2))
        return
    if not found:
        say("the swarm serves no model (no peer publishes a model card)")
        return
    say(f"{'NAME':24} {'MODEL ID':18} {'FAMILY':12} {'SIZE':>9} {'LAYERS':14} {'PEERS':>5}  QUANT")
    for m in found:
        covered = ",".join(f"{a}-{b - 1}" for a, b in m["covered"]) or "none"
        full = m["covered"] == [[0, m["num_layers"]]]
        layers = f"{covered}/{m['num_layers']}" + ("" if full else " gaps")
        say(f"{(m['names'] or ['?'])[0][:24]:24} {m['model_id'][:16] + '…':18} {m['family'][:12]:12} "
            f"{_size(m['bytes']):>9} {layers:14} {m['peers']:>5}  {','.join(m['quantization'])}")
    for line in conflict_lines(found):
        say(line)


def conflict_lines(found: list[dict]) -> list[str]:
    """One line per name several models claim: each model's ID prefix, publishers, and whether
    the name is bound here to it (``--model NAME`` is refused unless it is bound to one)."""
    from shardnet.inference.weights.names import describe

    claimed: dict[str, list[dict]] = {}
    for m in found:
        for name in m["conflicts"]:
            claimed.setdefault(name, []).append(m)
    lines = []
    for name, models in sorted(claimed.items()):
        listing = ", ".join(describe(m["model_id"], m["publishers"], bound=name in m["bound_here"])
                            for m in models)
        bound = any(name in m["bound_here"] for m in models)
        lines.append(f"conflict: {name!r} is claimed by {len(models)} models: {listing}; "
                     + (f"--model {name} means the one bound here" if bound else
                        f"--model {name} is refused here: give {name}@ID-PREFIX or the model ID"))
    return lines


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)
