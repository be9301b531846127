"""``shardnet generate``: text from a prompt through the swarm, streamed, with an optional run receipt."""

from __future__ import annotations

import json
import logging
import sys
from contextlib import contextmanager
from pathlib import Path

import click
import trio

from shardnet.inference.client.auto_drafter import SPECULATE_CHOICES

from .common import (
    cache_dir_option,
    client_identity_option,
    client_model,
    draft_model_for,
    generation_config,
    local_model,
    log,
    model_path_option,
    needs_network_for,
    network_options,
    run,
    wrap_errors,
)


@click.command()
@client_identity_option
@network_options("/ip4/0.0.0.0/tcp/0")
@model_path_option
@cache_dir_option
@click.argument("prompt")
@click.option("--max-new-tokens", "-n", default=48, show_default=True)
@click.option("--temperature", default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-p", default=1.0, show_default=True)
@click.option("--top-k", default=0, show_default=True)
@click.option("--seed", default=None, type=int)
@click.option("--logits-on-last", is_flag=True, help="Let the last peer apply the LM head (thin client).")
@click.option("--dtype", default="auto", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), show_default=True,
              help="Compute dtype; auto: the one the checkpoint stores.")
@click.option("--route-timeout", default=30.0, show_default=True, help="Seconds to wait for peers covering the model.")
@click.option("--speculate", type=click.Choice(SPECULATE_CHOICES), default="auto", show_default=True,
              help="Speculative decoding (lossless, any sampling): auto chooses as it goes between a draft "
                   "model (when there is one), suffix matching and plain decoding by what each yields; draft: "
                   "a draft model; model-free: suffix matching over the text (suffix) or the latest n-gram "
                   "(ngram); none: plain decoding.")
@click.option("--draft", "draft_path", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="Draft checkpoint for --speculate draft or auto (default: the one the model's card names, "
                   "fetched from the swarm; the shipped tiny-llama-draft for the shipped model).")
@click.option("-k", "draft_k", type=int, default=None,
              help="Drafted tokens verified per traversal (default: 4 in a chain; a tree's shape is chosen per "
                   "traversal from measured acceptance and trip times, up to 12 in its chain and as many beside).")
@click.option("--depth", default=1, show_default=True, help="Verify chunks kept in flight by speculation.")
@click.option("--wire", type=click.Choice(["float32", "float16", "bfloat16", "int8q"]), default=None,
              help="How hidden states travel between peers (default: the model dtype; int8q = int8 + scales).")
@click.option("--receipt", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write a signed run receipt (with every peer's stage receipt) here; check it with `shardnet verify`.")
@click.option("--receipt-without-prompt", is_flag=True, help="Leave the prompt's tokens out of the receipt (its hash stays).")
@click.option("--check-speculation", is_flag=True,
              help="With --receipt and greedy speculation: decode again plainly and record whether the outputs agree.")
@click.option("--audit-rate", type=click.FloatRange(0, 1), default=None,
              help="Share of steps re-run on other peers of the same layers to catch wrong computation "
                   "(default 0.1; 0: off).")
@click.option("--quantized", default="allow", type=click.Choice(["allow", "require", "refuse"]), show_default=True,
              help="Route through peers whose weights are quantized (join --quantize): allow, require or refuse.")
@wrap_errors
def generate(identity, listen, announce, bootstrap, quic, mdns, relays, model_path, cache_dir, prompt, max_new_tokens, temperature,
             top_p, top_k, seed, logits_on_last, dtype, route_timeout, speculate, draft_path, draft_k, depth, wire,
             receipt, receipt_without_prompt, check_speculation, audit_rate, quantized) -> None:
    """Generate text from PROMPT through the swarm; print tokens as they arrive."""
    from shardnet.inference.client.auto_drafter import drafter_for
    from shardnet.inference.client.client import Client
    from shardnet.transport import open_node

    path = local_model(model_path, download=not bootstrap and not mdns)
    needs_network_for(model_path, path, bootstrap, mdns, "generate")
    cfg = generation_config(identity, relays=relays, listen=listen, announce=announce, bootstrap=bootstrap,
                             quic=quic, mdns=mdns)

    drafter = None

    async def _main() -> None:
        nonlocal drafter
        # local files: loaded (and a bad checkpoint refused) before joining the network
        model = None if path is None else await client_model(None, model_path, path, dtype=dtype,
                                                             logits_on_last=logits_on_last, cache_dir=cache_dir)
        async with open_node(cfg) as n:
            if bootstrap:
                await n.wait_bootstrapped()
            if model is None:  # no files here: what a client needs, from the swarm
                model = await client_model(n, model_path, None, dtype=dtype, logits_on_last=logits_on_last,
                                           cache_dir=cache_dir)
            draft = draft_path
            if speculate == "auto" and receipt is not None and temperature > 0:
                # a sampled run's receipt can be recomputed only where its drafts depend on the
                # text alone (recompute.py): auto chooses between suffix matching and plain decoding
                log.info("a receipt of a sampled run: speculating without a draft model, so it can be recomputed")
                draft = None
            elif draft is None and speculate in ("auto", "draft"):
                draft = await draft_model_for(n, model, cache_dir=cache_dir, required=speculate == "draft")
            drafter = await trio.to_thread.run_sync(lambda: drafter_for(
                speculate, vocab_size=model.ckpt.config.vocab_size, draft_path=draft))
            client = Client(n, model, logits_on_last=logits_on_last, route_timeout=route_timeout, wire=wire,
                            quantized=quantized, **({} if audit_rate is None else {"audit_rate": audit_rate}))
            await _stream_generation(client, prompt, max_new_tokens=max_new_tokens, temperature=temperature,
                                     top_p=top_p, top_k=top_k, seed=seed, drafter=drafter, k=draft_k, depth=depth)
            if receipt is not None:
                await _write_receipt(client, receipt, with_prompt=not receipt_without_prompt,
                                     check=check_speculation and drafter is not None and temperature == 0)

    run(_main)


@contextmanager
def _log_held_while_streaming():
    """While generated text streams to a terminal that also shows the log (stdout and stderr
    both ttys), log records wait and are printed after the text's line ends, so no status line
    lands inside the text. Elsewhere (a pipe, a file) stdout holds only text anyway."""
    if not (sys.stdout.isatty() and sys.stderr.isatty()):
        yield
        return
    held: list[tuple[logging.Handler, logging.LogRecord]] = []

    class Hold(logging.Filter):
        def __init__(self, handler: logging.Handler) -> None:
            super().__init__()
            self.handler = handler

        def filter(self, record: logging.LogRecord) -> bool:
            held.append((self.handler, record))
            return False

    holds = [(h, Hold(h)) for h in logging.getLogger().handlers]
    for h, f in holds:
        h.addFilter(f)
    try:
        yield
    finally:
        for h, f in holds:
            h.removeFilter(f)
        for h, record in held:
            h.handle(record)


async def _write_receipt(client, path: Path, *, with_prompt: bool, check: bool) -> None:
    run_info = client._last_run
    if check:  # greedy speculative output must equal plain greedy decoding: decode again, plainly
        want = list(run_info["output"])
        log.info("checking the speculative output against plain decoding…")
        plain: list[int] = []
        async for t in client.generate(run_info["prompt"], max_new_tokens=len(want), stop_at_eos=False):
            t.apply(plain)
        client._last_run = run_info
        run_info["checked"] = plain == want
        click.echo(f"-- speculative output {'equals' if plain == want else 'DIFFERS FROM'} plain decoding")
    log.info("collecting stage receipts…")
    doc = await client.run_receipt()
    if with_prompt:
        doc["prompt_ids"] = list(run_info["prompt"])  # outside the signed body: checked against its hash
    path.write_text(json.dumps(doc, indent=1))
    click.echo(f"-- receipt: {path} ({len(doc['body']['sessions'][-1]['stages'])} stage receipts, "
               f"signed by {doc['body']['client'][:16]}…)")


async def _stream_generation(client, prompt: str, **kw) -> None:
    log.info("finding peers for model %s…", client.model.model_id[:16])
    route = await client.planner.find_route()  # its status lines come before the text, not inside it
    sys.stdout.write(prompt)
    ids: list[int] = []
    with _log_held_while_streaming():
        async for tok in client.generate(prompt, route=route, **kw):
            tok.apply(ids)
            if tok.retracted:
                sys.stdout.write(f"\n-- {tok.retracted} token(s) withdrawn (a peer was caught computing wrong); "
                                 f"corrected text:\n{prompt}{client.model.decode(ids)}")
            else:
                sys.stdout.write(tok.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()
    st = client.last_stats
    click.echo(f"-- {st.new_tokens} tokens, {st.tokens_per_s:.1f} tok/s decode, prefill {st.prefill_s * 1000:.0f} ms")
    sp = st.speculation
    drafter = kw.get("drafter")
    if drafter is not None:
        name = drafter.describe() if hasattr(drafter, "describe") else getattr(drafter, "name", type(drafter).__name__)
        trees = f" ({sp.trees} of them trees of drafts)" if sp.trees else ""
        click.echo(f"-- speculation: {name}: {sp.verified} traversals{trees}, {sp.tokens_per_traversal:.2f} tokens "
                   f"each, {sp.acceptance:.0%} of drafts accepted, {sp.stale} stale chunks discarded")
    click.echo("-- chain: " + " -> ".join(f"{c.peer[:12]}… [{c.start}:{c.end}]" for c in st.chain))
    for h in st.heals:
        lost = ", ".join(f"{a}:{b}" for a, b in h.layers) or "?"
        if h.phase == "audit":
            click.echo(f"-- left {', '.join(p[:12] + '…' for p in h.failed)} (layers {lost}): caught computing wrong")
            continue
        click.echo(f"-- healed in {h.seconds:.2f} s during {h.phase}: {', '.join(p[:12] + '…' for p in h.failed)} "
                   f"(layers {lost}) failed; replayed {h.replayed_tokens} tokens")
    a = st.audit
    if a is not None and a.sampled:
        click.echo(f"-- checks: {a.checked} of {a.sampled} sampled steps re-run on other peers ({a.agreed} agreed, "
                   f"{a.convictions} caught, {a.disputes} unsettled, {a.no_witness} without a second peer)")
