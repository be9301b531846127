"""``shardnet`` command line: a thin layer over the library.

Every command says what it is doing on stderr (logging) and prints its results on stdout; a
failure exits non-zero with one line ``error: <reason>`` and no traceback.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import click
import trio

from . import __version__, logs
from .transport.config import DEFAULT_SERVER_LISTEN, NodeConfig, parse_multiaddr, parse_peer_addr
from .transport.errors import ShardnetError

log = logging.getLogger("shardnet.cli")


# -- plumbing ------------------------------------------------------------------------------------
def fail(message: str, code: int = 1) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def run(main: Callable[[], Awaitable[Any]]) -> Any:
    """Run ``main`` under trio; SIGINT/SIGTERM stop it cleanly; ShardnetError -> one line."""

    async def _guarded() -> Any:
        result: list[Any] = []
        async with trio.open_nursery() as nursery:

            async def _signals() -> None:
                with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                    async for signum in signals:
                        log.info("received %s, shutting down", signal.Signals(signum).name)
                        nursery.cancel_scope.cancel()
                        return

            async def _main() -> None:
                result.append(await main())
                nursery.cancel_scope.cancel()

            nursery.start_soon(_signals)
            nursery.start_soon(_main)
        return result[0] if result else None

    try:
        return trio.run(_guarded)
    except (ShardnetError, BaseExceptionGroup) as e:
        first = _first_shardnet_error(e)
        if first is None:
            _unexpected(e)
        fail(str(first))
    except Exception as e:
        _unexpected(e)


def _unexpected(e: BaseException) -> None:
    """A bug, not a user error: still one line, with the traceback in the debug log."""
    while isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1:
        e = e.exceptions[0]
    log.debug("unexpected failure", exc_info=e)
    fail(f"unexpected {type(e).__name__}: {e} (run with -v for the traceback)")


def _first_shardnet_error(e: BaseException) -> ShardnetError | None:
    if isinstance(e, ShardnetError):
        return e
    if isinstance(e, BaseExceptionGroup):
        for sub in e.exceptions:
            found = _first_shardnet_error(sub)
            if found is not None:
                return found
    return None


def _emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _say(text: str) -> None:
    click.echo(text)
    sys.stdout.flush()


def identity_option(f):
    return click.option(
        "--identity",
        type=click.Path(dir_okay=False, path_type=Path),
        default=None,
        help="Identity key file (default $SHARDNET_IDENTITY or ~/.shardnet/identity.key).",
    )(f)


def network_options(default_listen: str | None):
    def deco(f):
        f = click.option("--listen", "listen", multiple=True, metavar="MADDR",
                         help=f"Listen multiaddr, repeatable (default {default_listen or '/ip4/0.0.0.0/tcp/0'}).")(f)
        f = click.option("--announce", multiple=True, metavar="MADDR",
                         help="Advertise this multiaddr instead of the listen addresses (repeatable).")(f)
        f = click.option("--bootstrap", multiple=True, metavar="MADDR", envvar="SHARDNET_BOOTSTRAP",
                         help="Bootstrap peer (/ip4/../tcp/../p2p/ID), repeatable.")(f)
        f = click.option("--quic", is_flag=True, help="Also enable the QUIC transport.")(f)
        f = click.option("--mdns", is_flag=True, help="Discover peers on the LAN with mDNS.")(f)
        return f

    return deco


def make_config(*, identity: Path | None, listen, announce, bootstrap, quic: bool, mdns: bool,
                default_listen: str, persistent: bool = True, dht_mode: str = "server") -> NodeConfig:
    from .transport import identity as ident

    for a in listen:
        parse_multiaddr(a, what="--listen")
    for a in announce:
        parse_multiaddr(a, what="--announce")
    for a in bootstrap:
        parse_peer_addr(a, what="--bootstrap")
    cfg = NodeConfig(
        listen=list(listen) or [default_listen],
        announce=list(announce),
        bootstrap=list(bootstrap),
        enable_quic=quic,
        enable_mdns=mdns,
        dht_mode=dht_mode,
    )
    if persistent:
        path = identity or ident.default_identity_path()
        kp, created = ident.load_or_create(path)
        log.info("%s identity %s (%s)", "created" if created else "using", ident.peer_id_of(kp), path)
        cfg.key_pair = kp
    return cfg


def _wrap_errors(f):
    """Turn ShardnetError raised while parsing options into the one-line failure."""
    import functools

    @functools.wraps(f)
    def inner(*a, **kw):
        try:
            return f(*a, **kw)
        except ShardnetError as e:
            fail(str(e))

    return inner


# -- commands -----------------------------------------------------------------------------------
@click.group()
@click.option("-v", "--verbose", count=True, help="More logging (-vv includes py-libp2p).")
@click.option("-q", "--quiet", is_flag=True, help="Only warnings and errors on stderr.")
@click.version_option(__version__, prog_name="shardnet")
def main(verbose: int, quiet: bool) -> None:
    """shardnet: pool machines over a peer-to-peer overlay to run large language models."""
    logs.setup(-1 if quiet else verbose)


@main.command("id")
@identity_option
@_wrap_errors
def id_cmd(identity: Path | None) -> None:
    """Create (first time) or show this machine's peer identity."""
    from .transport import identity as ident

    path = identity or ident.default_identity_path()
    kp, created = ident.load_or_create(path)
    _say(f"peer id:  {ident.peer_id_of(kp)}")
    _say(f"identity: {path} ({'created' if created else 'existing'})")


@main.command()
@identity_option
@network_options(DEFAULT_SERVER_LISTEN)
@_wrap_errors
def bootstrap(identity, listen, announce, bootstrap, quic, mdns) -> None:
    """Run a bootstrap / DHT server node; print its full multiaddrs; run until stopped."""
    from .transport import open_node

    cfg = make_config(identity=identity, listen=listen, announce=announce, bootstrap=bootstrap,
                      quic=quic, mdns=mdns, default_listen=DEFAULT_SERVER_LISTEN)

    async def _main() -> None:
        async with open_node(cfg) as node:
            _say(f"bootstrap node {node.peer_id}")
            for a in node.listen_addrs:
                _say(f"  {a}")
            _say("ready; stop with Ctrl-C")
            await trio.sleep_forever()

    run(_main)
    _say("stopped")


@main.command()
@identity_option
@network_options(DEFAULT_SERVER_LISTEN)
@click.option("--subscribe", "topics", multiple=True, metavar="TOPIC", help="Print messages on TOPIC.")
@click.option("--events", is_flag=True,
              help="Machine interface: JSON events on stdout, JSON commands on stdin.")
@_wrap_errors
def node(identity, listen, announce, bootstrap, quic, mdns, topics, events) -> None:
    """Join the overlay through --bootstrap and stay up until stopped."""
    from .transport import open_node

    cfg = make_config(identity=identity, listen=listen, announce=announce, bootstrap=bootstrap,
                      quic=quic, mdns=mdns, default_listen=DEFAULT_SERVER_LISTEN)
    if not bootstrap and not mdns:
        log.warning("no --bootstrap given: this node will only know peers that dial it")

    async def _main() -> None:
        from .node_control import NodeControl

        async with open_node(cfg) as n:
            control = NodeControl(n, emit=_emit if events else None, say=_say)
            await control.run(topics=list(topics), read_commands=events)

    run(_main)
    if not events:
        _say("stopped")


@main.command()
@network_options("/ip4/0.0.0.0/tcp/0")
@click.option("--wait", default=3.0, show_default=True, help="Seconds to spend discovering.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@_wrap_errors
def peers(listen, announce, bootstrap, quic, mdns, wait, as_json) -> None:
    """List the peers reachable through --bootstrap (joins with a throwaway identity)."""
    from .transport import open_node

    if not bootstrap and not mdns:
        fail("peers needs --bootstrap MADDR (or --mdns)", 2)
    cfg = make_config(identity=None, listen=listen, announce=announce, bootstrap=bootstrap,
                      quic=quic, mdns=mdns, default_listen="/ip4/0.0.0.0/tcp/0",
                      persistent=False, dht_mode="client")

    async def _main() -> list[dict]:
        async with open_node(cfg) as n:
            if bootstrap:
                await n.wait_bootstrapped()
            log.info("discovering peers for %.1f s", wait)
            await trio.sleep(wait)
            return [{"peer_id": str(p), "addrs": [str(a) for a in n.addrs_of(p)],
                     "connected": p in n.peers()} for p in sorted(n.discovered, key=str)]

    found = run(_main) or []
    if as_json:
        _say(json.dumps(found, indent=2))
        return
    _say(f"{len(found)} peer(s)")
    for p in found:
        _say(f"{p['peer_id']}  {'connected' if p['connected'] else 'known':9}  {' '.join(p['addrs'])}")


@main.command()
@click.argument("maddr")
@click.option("--count", "-c", default=3, show_default=True, help="Number of pings.")
@click.option("--timeout", default=10.0, show_default=True, help="Seconds to wait for each answer.")
@_wrap_errors
def ping(maddr: str, count: int, timeout: float) -> None:
    """Ping a peer at MADDR (/ip4/../tcp/../p2p/ID) and print round-trip times."""
    from .transport import open_node

    info = parse_peer_addr(maddr, what="MADDR")
    cfg = NodeConfig(listen=["/ip4/0.0.0.0/tcp/0"], dial_timeout=timeout)

    async def _main() -> None:
        async with open_node(cfg) as n:
            _say(f"PING {info.peer_id}")
            t0 = time.perf_counter()
            await n.connect(info)
            _say(f"connected in {(time.perf_counter() - t0) * 1000:.1f} ms")
            for i in range(count):
                rtt = await n.ping(info.peer_id, timeout=timeout)
                _say(f"pong from {info.peer_id}: seq={i} time={rtt * 1000:.2f} ms")

    run(_main)


@main.command()
@click.option("--nodes", default=3, show_default=True, help="Compute nodes to start besides the bootstrap.")
@click.option("--timeout", default=60.0, show_default=True, help="Give up after this many seconds.")
def demo(nodes: int, timeout: float) -> None:
    """Start a local swarm (bootstrap + nodes, separate processes), show it working, stop it."""
    from .demo import run_overlay_demo

    try:
        run_overlay_demo(nodes=nodes, timeout=timeout, say=_say)
    except ShardnetError as e:
        fail(str(e))


if __name__ == "__main__":  # pragma: no cover
    main()
