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

from . import config_file
from .common import make_config, network_options

__all__ = ["main", "make_config", "network_options"]

#: each command and the module defining it, imported only when the command runs (or --help lists
#: them): a bootstrap, relay or plain node process does not import torch (~3 s of CPU at each
#: start on a 2-core machine, and the tests start hundreds of processes)
COMMANDS = {
    "id": "overlay:id_cmd", "limits": "overlay:limits_cmd", "swarm-key": "overlay:swarm_key_cmd",
    "bootstrap": "overlay:bootstrap", "relay": "overlay:relay", "node": "overlay:node", "peers": "overlay:peers",
    "status": "overlay:status", "ping": "overlay:ping",
    "join": "compute:join",
    "generate": "generate:generate",
    "serve": "serve:serve", "dashboard": "dashboard:dashboard",
    "verify": "receipts:verify", "receipts": "receipts:receipts",
    "model": "model:model", "models": "model:models",
    "demo": "demo:demo",
}


class LazyGroup(click.Group):
    """A group whose commands (``COMMANDS``) are imported when first asked for."""

    def list_commands(self, ctx: click.Context | None) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context | None, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in COMMANDS:
            import importlib

            module, attr = COMMANDS[cmd_name].split(":")
            self.commands[cmd_name] = getattr(importlib.import_module(f"{__name__}.{module}"), attr)
        return self.commands.get(cmd_name)


@click.group(cls=LazyGroup)
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
        ctx.default_map = config_file.default_map(ctx.command, config, ctx.invoked_subcommand)
