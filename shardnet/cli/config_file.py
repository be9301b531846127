"""``shardnet --config FILE`` (or ``$SHARDNET_CONFIG``): option values from a TOML file.

    bootstrap = ["/ip4/203.0.113.7/tcp/4001/p2p/12D3KooW..."]   # every command that has --bootstrap
    identity = "/var/lib/shardnet/id.key"

    [join]
    model = "tiny-llama"
    layers = "0:4"
    batch-tokens = 256
    limit = ["sessions_per_peer=64"]

    [serve]
    port = 8080

Keys are option names as on the command line (``batch-tokens`` or ``batch_tokens``). Top-level
keys go to every command that has that option; a table holds one command's. Values are what the
option takes (a list for a repeatable one, true/false for a flag). The file only supplies
defaults: a flag on the command line, then an option's environment variable, win over it (click's
``default_map``). A key no command has, or a table for a command that does not exist, is an
error naming it, so a typo never passes silently.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import click

from .common import fail


def _option(cmd: click.Command, key: str) -> click.Option | None:
    flag = "--" + key.replace("_", "-")
    for p in cmd.params:
        if isinstance(p, click.Option) and (flag in p.opts or p.name == key.replace("-", "_")):
            return p
    return None


def default_map(group: click.Group, path: Path, only: str | None = None) -> dict:
    """The ``default_map`` for ``group``'s commands from the TOML file at ``path`` (``only``: for
    that command alone, the others imported only to check a top-level key it lacks: a bootstrap
    started with a config file does not import the compute commands' torch)."""
    try:
        config = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        fail(f"config {path}: cannot read it ({e.strerror or e})")
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        fail(f"config {path}: not valid TOML ({e})")
    names = group.list_commands(None)
    shared = {k: v for k, v in config.items() if not isinstance(v, dict)}
    for name in config:
        if name not in shared and name not in names:
            fail(f"config {path}: [{name}]: there is no command `shardnet {name}`")
    for key in shared:
        if only is not None and _option(group.get_command(None, only), key):
            continue
        if not any(_option(group.get_command(None, name), key) for name in names):
            fail(f"config {path}: {key}: no command has an option --{key.replace('_', '-')}")
    commands = {name: group.get_command(None, name) for name in (names if only is None else [only])}
    out: dict[str, dict] = {}
    for name, cmd in commands.items():
        values = {}
        for key, value in shared.items():
            if (opt := _option(cmd, key)) is not None:
                values[opt.name] = value
        table = config.get(name)  # (`bootstrap = [...]` at the top is the option, not the command)
        for key, value in (table.items() if isinstance(table, dict) else ()):
            opt = _option(cmd, key)
            if opt is None:
                fail(f"config {path}: [{name}] {key}: `shardnet {name}` has no option --{key.replace('_', '-')}")
            values[opt.name] = value
        if values:
            out[name] = values
    return out
