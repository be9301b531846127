"""``shardnet serve``: an OpenAI-compatible HTTP gateway backed by the swarm."""

from __future__ import annotations

import functools
from pathlib import Path

import click
import trio

from .common import (
    cache_dir_option,
    client_identity_option,
    client_model,
    generation_config,
    local_model,
    log,
    model_path_option,
    needs_network_for,
    network_options,
    run,
    say,
    wrap_errors,
)


@click.command()
@client_identity_option
@network_options("/ip4/0.0.0.0/tcp/0")
@model_path_option
@cache_dir_option
@click.option("--host", default="127.0.0.1", show_default=True, help="Address the HTTP server binds.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="HTTP port (0: any).")
@click.option("--name", default=None, help="The model name clients ask for (default: the model directory's name).")
@click.option("--logits-on-last", is_flag=True, help="Let the last peer apply the LM head (thin gateway).")
@click.option("--dtype", default="auto", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), show_default=True,
              help="Compute dtype; auto: the one the checkpoint stores.")
@click.option("--route-timeout", default=10.0, show_default=True,
              help="Seconds a request waits for peers covering the model before a 503.")
@click.option("--audit-rate", type=click.FloatRange(0, 1), default=None,
              help="Share of steps re-run on other peers to catch wrong computation (default 0.1; 0: off).")
@click.option("--quantized", default="allow", type=click.Choice(["allow", "require", "refuse"]), show_default=True,
              help="Route through peers whose weights are quantized (join --quantize): allow, require or refuse.")
@click.option("--api-key", default=None, envvar="SHARDNET_API_KEY", metavar="KEY",
              help="Require 'Authorization: Bearer KEY' on every /v1/* request (401 otherwise); the health "
                   "probes stay open. Default: $SHARDNET_API_KEY, else no key.")
@click.option("--chat-template", type=click.Path(path_type=Path), default=None, metavar="FILE",
              help="A Jinja chat template file used instead of the model's own (tokenizer_config.json).")
@click.option("--prefix-reuse", default="private", type=click.Choice(["private", "shared", "off"]), show_default=True,
              help="Let every peer reuse the keys and values it computed for a prompt's start already sent "
                   "(a chat's earlier turns): private to this gateway (its users share it), shared with "
                   "every client, or off (docs/security.md).")
@click.option("--speculate", default="none", type=click.Choice(["auto", "suffix", "ngram", "none"]), show_default=True,
              help="Speculative decoding (lossless) of a request that starts while no other is generating "
                   "(with several at once the peers are busy computing, and verify chunks cost them more than "
                   "the round trips they save): auto chooses as it goes between suffix matching over the "
                   "request's text and plain decoding by what each yields. Off by default: in float16 or "
                   "bfloat16 a verify chunk and a plain step may pick different tokens at a near-tie, and a "
                   "gateway's greedy answers should not depend on how busy it is.")
@click.option("--share-outputs", is_flag=True, default=False,
              help="With --speculate auto or suffix: suffix drafting also matches this gateway's recent outputs "
                   "(the last 20,000 tokens), so a request that repeats what an earlier one answered is drafted "
                   "from it (not a seeded sampled request). Other users' text shapes only the drafts (greedy "
                   "drafts are verified, sampling is lossless; in float16 or bfloat16 a near-tie may tip); how "
                   "fast an answer comes may tell that it was asked before (docs/security.md).")
@wrap_errors
def serve(identity, listen, announce, bootstrap, quic, mdns, relays, model_path, cache_dir, host, port, name, logits_on_last,
          dtype, route_timeout, audit_rate, quantized, api_key, chat_template, prefix_reuse, speculate,
          share_outputs) -> None:
    """Serve an OpenAI-compatible HTTP API (completions, chat, streaming) backed by the swarm."""
    from shardnet.errors import ShardnetError
    from shardnet.gateway.server import read_chat_template, serve_gateway
    from shardnet.inference.client.client import Client
    from shardnet.inference.weights.names import model_name
    from shardnet.transport import open_node

    if api_key is not None and not api_key.strip():
        raise ShardnetError("--api-key is empty (leave it out to serve without a key)")
    if share_outputs and speculate not in ("auto", "suffix"):
        raise ShardnetError("--share-outputs is for suffix drafting: add --speculate auto or --speculate suffix")
    # a bad template file fails here, before anything is loaded or joined
    template = None if chat_template is None else read_chat_template(chat_template)
    path = local_model(model_path, download=not bootstrap and not mdns)
    needs_network_for(model_path, path, bootstrap, mdns, "serve")
    cfg = generation_config(identity, relays=relays, listen=listen, announce=announce, bootstrap=bootstrap,
                             quic=quic, mdns=mdns)

    async def _main() -> None:
        # local files: loaded (and a bad checkpoint refused) before joining the network
        model = None if path is None else await client_model(None, model_path, path, dtype=dtype,
                                                             logits_on_last=logits_on_last, cache_dir=cache_dir)
        async with open_node(cfg) as n:
            if bootstrap:
                log.info("joining the swarm…")
                await n.wait_bootstrapped()
            if model is None:  # no files here: what a client needs, from the swarm
                model = await client_model(n, model_path, None, dtype=dtype, logits_on_last=logits_on_last,
                                           cache_dir=cache_dir)
            shown = name or (path.name if path else model_name(model_path))
            client = Client(n, model, logits_on_last=logits_on_last, route_timeout=route_timeout,
                            quantized=quantized, prefix={"off": None, "private": "gateway"}.get(prefix_reuse, prefix_reuse),
                            **({} if audit_rate is None else {"audit_rate": audit_rate}))
            async with trio.open_nursery() as nursery:
                # a port in use: PortInUseError, one line like the libp2p port's
                urls = await nursery.start(functools.partial(
                    serve_gateway, client, shown, host=host, port=port, route_timeout=route_timeout,
                    api_key=api_key, chat_template=template, speculate=speculate, share_outputs=share_outputs))
                say(f"serving the OpenAI API for model {shown!r} on {', '.join(urls)} "
                     f"(model {model.model_id[:16]}…)" + (" with an API key" if api_key else "")
                     + f"; speculation: {speculate}" + (", drafting from shared outputs too" if share_outputs else ""))
                say(f"swarm dashboard on {urls[0]}/dashboard, metrics on {urls[0]}/metrics")

    run(_main)
