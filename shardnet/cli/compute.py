"""``shardnet join``: serve a block of a model's layers to the swarm."""

from __future__ import annotations

from pathlib import Path

import click

from shardnet.transport.config import DEFAULT_SERVER_LISTEN

from .common import (
    FetchProgressBar,
    cache_dir_option,
    emit,
    fail,
    identity_option,
    local_model,
    make_config,
    metrics_if_asked,
    metrics_options,
    model_from_swarm,
    model_path_option,
    network_options,
    require_swarm_for,
    run,
    say,
    wrap_errors,
)


@click.command()
@identity_option
@network_options(DEFAULT_SERVER_LISTEN)
@metrics_options
@model_path_option
@cache_dir_option
@click.option("--layers", default=None, metavar="START:END",
              help="Layers to serve (default: as many as memory allows, where the swarm needs them most).")
@click.option("--max-layers", type=click.IntRange(min=1), default=None,
              help="Serve at most this many layers when choosing automatically.")
@click.option("--rebalance-interval", default=60.0, show_default=True,
              help="Seconds between looks at the swarm (RTTs to successors; moving, if the span was chosen "
                   "automatically). 0: never.")
@click.option("--dtype", default="auto", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), show_default=True,
              help="Compute dtype; auto: the one the checkpoint stores.")
@click.option("--quantize", default=None, type=click.Choice(["int8", "int4"]),
              help="Quantize the block's weights at load (about 1/2 or 1/4 of bf16's bytes a layer); claims say so.")
@click.option("--device", default=None, help="cpu or cuda (default: cuda when present).")
@click.option("--kv-budget-mb", default=512, show_default=True, help="KV cache memory for all sessions.")
@click.option("--hold-head", is_flag=True, help="Also hold the final norm and LM head (last block only).")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="CPU threads for block computation (default: torch's choice). Use 1 when several "
                   "peers share a machine: small blocks lose more to thread hand-offs than they gain.")
@click.option("--throughput", type=click.FloatRange(min=0, min_open=True), default=None, metavar="TOK_S",
              help="Advertise this many tokens/s for the block instead of measuring it (default: measured "
                   "when loaded). Placement and routing weigh peers by it; a fixed figure keeps them steady "
                   "where a measurement would wobble, e.g. several peers on one busy machine.")
@click.option("--batch-tokens", type=click.IntRange(min=0), default=256, show_default=True,  # the scheduler's default
              metavar="N",
              help="Continuous batching: the steps of concurrent sessions that are ready run as one forward "
                   "pass of up to N tokens, decode steps first, then chunks of long prompts in what is left. "
                   "0: one session's step per pass, in fair turns between upstream peers.")
@click.option("--region", default=None, metavar="TEXT",
              help="Where this peer is, as you declare it (e.g. eu-west): stated in every stage receipt it "
                   "signs, next to the address its neighbours see. Not proven.")
@click.option("--draft", "draft_path", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="A draft model for speculative decoding with this one: served whole beside it and named in "
                   "its model card, so clients' --speculate auto fetch it (default: the shipped "
                   "tiny-llama-draft when serving the shipped model).")
@click.option("--no-draft", is_flag=True, help="Name and serve no draft model.")
@click.option("--events", is_flag=True, help="JSON events on stdout, JSON commands on stdin.")
@wrap_errors
def join(identity, listen, announce, bootstrap, quic, mdns, relays, model_path, cache_dir, layers, max_layers,
         rebalance_interval, dtype, quantize, device, kv_budget_mb, hold_head, threads, throughput, batch_tokens,
         region, draft_path, no_draft, events) -> None:
    """Serve a block of a model's layers to the swarm (chosen for you unless --layers).

    With --model naming a model the swarm serves (no files here), only the layers this peer
    serves are fetched from the peers that hold them, then served."""
    from shardnet.inference.model.block import parse_layers, pick_device, resolve_dtype
    from shardnet.inference.model.checkpoint import Checkpoint, CheckpointError
    from shardnet.inference.model.family_check import ensure_family_matches
    from shardnet.inference.server.compute_peer import join_swarm
    from shardnet.transport import allocator, open_node

    from .node_control import NodeControl

    if threads:
        import torch

        torch.set_num_threads(threads)
    if region is not None:
        from shardnet.protocols.receipts import region_problem

        if problem := region_problem(region):
            fail(f"--region {region!r}: {problem}", 2)
    path = local_model(model_path, download=not bootstrap and not mdns)
    if no_draft:
        draft_path = None
    elif draft_path is None:
        from shardnet.models import shipped_draft_for

        draft_path = shipped_draft_for(path)
    _check_device(device)
    span = None
    require_swarm_for(model_path, path, bootstrap, mdns)
    if path is not None:
        try:
            ckpt = Checkpoint(path)
            span = parse_layers(layers, ckpt.num_layers) if layers else None
            # before the network: an unsupported model fails at once (its span's layer kinds, or
            # every layer kind stored here when the span is chosen later)
            with allocator.loading():  # (the check's buffers go back to the system as they are freed)
                ensure_family_matches(ckpt, span or (0, ckpt.num_layers),
                                      dtype=resolve_dtype(dtype, ckpt, pick_device(device)))
        except CheckpointError as e:
            fail(str(e))
    cfg = make_config(relays=relays, identity=identity, listen=listen, announce=announce, bootstrap=bootstrap,
                      quic=quic, mdns=mdns, default_listen=DEFAULT_SERVER_LISTEN)

    def moved(move, old) -> None:
        if events:
            emit({"event": "moved", "from": list(old), "layers": [move.start, move.end],
                   "bottleneck": [move.bottleneck_now, move.bottleneck_after]})
        else:
            say(f"moved from layers {old[0]}:{old[1]} to {move.start}:{move.end} (swarm bottleneck "
                 f"{move.bottleneck_now:.1f} -> {move.bottleneck_after:.1f} tok/s)")

    meta = click.get_current_context().meta

    async def _main() -> None:
        nonlocal span
        async with open_node(cfg) as n, metrics_if_asked(n, meta):
            if bootstrap and (span is None or path is None):
                await n.wait_bootstrapped()  # to see what the swarm serves before choosing or fetching
            ckpt_path, shown = path, path.name if path else model_path
            if ckpt_path is None:
                ckpt_path = await model_from_swarm(n, model_path, cache_dir=cache_dir, events=events)
                fetched = Checkpoint(ckpt_path)  # its manifest checked against the model ID
                span = parse_layers(layers, fetched.num_layers) if layers else None
            async with join_swarm(n, str(ckpt_path), layers=span, max_layers=max_layers,
                                  rebalance_interval=rebalance_interval, on_move=moved, dtype=dtype, device=device,
                                  kv_budget_bytes=kv_budget_mb << 20, hold_head=hold_head,
                                  throughput=throughput, quantize=quantize, batch_tokens=batch_tokens,
                                  region=region, fetch_progress=FetchProgressBar("layers", events=events),
                                  draft_path=draft_path) as peer:
                start, end = peer.span
                if events:
                    emit({"event": "serving", "model": peer.model_id, "layers": [start, end], "tput": peer.tput})
                else:
                    say(f"serving layers {start}:{end} of {shown} (model {peer.model_id[:16]}…, "
                         f"{peer.tput:.0f} tok/s)")
                control = NodeControl(n, emit=emit if events else None, say=say)
                await control.run(topics=[], read_commands=events)

    run(_main)


def _check_device(device: str | None) -> None:
    """--device names a device this machine has (checked before joining the network)."""
    if device is None:
        return
    import torch

    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError):
        fail(f"--device {device!r} is not a torch device (cpu, cuda, cuda:N)", 2)
    if kind == "cuda":
        if not torch.cuda.is_available():
            fail(f"--device {device}: no CUDA device is available on this machine (torch "
                 f"{torch.__version__}, CUDA build: {torch.version.cuda or 'none'}); use --device cpu", 2)
        index = torch.device(device).index
        if index is not None and index >= torch.cuda.device_count():
            fail(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)", 2)
    elif kind != "cpu" and not getattr(getattr(torch.backends, kind, None), "is_available", lambda: False)():
        fail(f"--device {device}: no {kind} device is available on this machine", 2)
