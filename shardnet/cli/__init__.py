"""``shardnet`` command line: a thin layer over the library.

Every command says what it is doing on stderr (logging) and prints its results on stdout; a
failure exits non-zero with one line ``error: <reason>`` and no traceback. One module per group
of commands; :mod:`.common` holds what they share.
"""

from __future__ import annotations

from pathlib import Path

import click

from shardnet import logs
from shardnet._version import __version__

from . import compute, config_file, dashboard, demo, generate, model, overlay, receipts, serve
from .common import make_config, network_options

__all__ = ["main", "make_config", "network_options"]


@click.group()
@click.option("-v", "--verbose", count=True, help="More logging (-vv includes py-libp2p).")
@click.option("-q", "--quiet", is_flag=True, help="Only warnings and errors on stderr.")
@click.option("--config", type=click.Path(dir_okay=False, path_type=Path), envvar="SHARDNET_CONFIG", metavar="FILE",
              help="Option values from a TOML file: top-level keys for every command that has the option, "
                   "[command] tables for one command; flags on the command line win. Default: $SHARDNET_CONFIG.")
@click.version_option(__version__, prog_name="shardnet")
@click.pass_context
def main(ctx: click.Context, verbose: int, quiet: bool, config: Path | None) -> None:
    """shardnet: pool machines over a peer-to-peer overlay to run large language models."""
    logs.setup(-1 if quiet else verbose)
    if config is not None:
        ctx.default_map = config_file.default_map(ctx.command, config)


for command in (
    overlay.id_cmd, overlay.limits_cmd, overlay.swarm_key_cmd, overlay.bootstrap, overlay.relay, overlay.node,
    overlay.peers, overlay.status, overlay.ping,
    compute.join,
    generate.generate,
    serve.serve, dashboard.dashboard,
    receipts.verify, receipts.receipts,
    model.model, model.models,
    demo.demo,
):
    main.add_command(command)
del command
