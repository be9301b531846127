"""``shardnet dashboard``: the swarm dashboard on its own, for operators with no model files."""

from __future__ import annotations

import functools

import click
import trio

from .common import client_identity_option, generation_config, log, network_options, run, say, wrap_errors


@click.command()
@client_identity_option
@network_options("/ip4/0.0.0.0/tcp/0")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address the HTTP server binds.")
@click.option("--port", default=8080, show_default=True, type=click.IntRange(0, 65535), help="HTTP port (0: any).")
@click.option("--model", "models", multiple=True, metavar="NAME_OR_ID",
              help="Show only this model (repeatable; default: every model the swarm lists).")
@wrap_errors
def dashboard(identity, listen, announce, bootstrap, quic, mdns, relays, host, port, models) -> None:
    """Serve the swarm dashboard (coverage map, peers, their throughput and round trips) over HTTP.

    Needs no model files: the models come from the swarm's model cards."""
    from shardnet.errors import ShardnetError
    from shardnet.gateway.dashboard import SwarmModels, dashboard_app
    from shardnet.gateway.http import serve_asgi
    from shardnet.inference.services import inference_services
    from shardnet.transport import open_node

    if not bootstrap and not mdns:
        raise ShardnetError("the dashboard shows a swarm: give --bootstrap MADDR (or $SHARDNET_BOOTSTRAP) or --mdns")
    cfg = generation_config(identity, relays=relays, listen=listen, announce=announce, bootstrap=bootstrap,
                            quic=quic, mdns=mdns)

    async def _main() -> None:
        async with open_node(cfg) as n:
            log.info("joining the swarm…")
            await n.wait_bootstrapped()
            app = dashboard_app(n, SwarmModels(n, tuple(models)), inference_services(n).activity)
            async with trio.open_nursery() as nursery:
                urls = await nursery.start(functools.partial(serve_asgi, app, host=host, port=port))
                say(f"swarm dashboard on {urls[0]}/dashboard")

    run(_main)
