"""``shardnet`` command line: a thin layer over the library.

Every command says what it is doing on stderr (logging) and prints its results on stdout; a
failure exits non-zero with one line ``error: <reason>`` and no traceback.
"""

from __future__ import annotations

import functools
import json
import logging
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager, contextmanager
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
        f = click.option("--relay", "relays", multiple=True, metavar="MADDR",
                         help="Hold a slot at this circuit relay (/ip4/../tcp/../p2p/ID), repeatable: peers "
                              "that cannot dial us (NAT) reach us through it.")(f)
        f = click.option("--no-hole-punch", is_flag=True, expose_value=False, callback=_remember,
                         help="Keep relayed connections relayed (no DCUtR hole punching).")(f)
        f = click.option("--no-auto-relay", is_flag=True, expose_value=False, callback=_remember,
                         help="Without --relay, do not reserve relay slots when AutoNAT finds us behind NAT.")(f)
        f = click.option("--no-autonat", is_flag=True, expose_value=False, callback=_remember,
                         help="Do not ask peers whether we are reachable (for bootstrap and relay nodes whose "
                              "reachability is known); still answer their questions.")(f)
        return limit_option(swarm_key_option(f))

    return deco


def limit_option(f):
    return click.option("--limit", "limits", multiple=True, metavar="NAME=VALUE", expose_value=False,
                        callback=_remember, help="Set a resource limit (repeatable; `shardnet limits` lists them).")(f)


def swarm_key_option(f):
    return click.option("--swarm-key", type=click.Path(dir_okay=False, path_type=Path), default=None,
                        envvar="SHARDNET_SWARM_KEY", expose_value=False, callback=_remember,
                        help="Private swarm: connect only with peers holding this key file "
                             "(make one with `shardnet swarm-key PATH`).")(f)


def _load_swarm_key(cfg: NodeConfig) -> NodeConfig:
    """--swarm-key (or $SHARDNET_SWARM_KEY), remembered in the click context, into ``cfg``."""
    meta = click.get_current_context(silent=True)
    path = meta.meta.get("shardnet.swarm_key") if meta is not None else None
    if path:
        from .transport.swarm_key import SwarmKey

        cfg.swarm_key = SwarmKey.load(path)
        log.info("private swarm: key %s (%s)", cfg.swarm_key.fingerprint, path)
    return cfg


def _remember(ctx: click.Context, param: click.Parameter, value) -> None:
    """Network flags every command shares reach make_config through the click context."""
    ctx.meta[f"shardnet.{param.name}"] = value


def make_config(*, identity: Path | None, listen, announce, bootstrap, quic: bool, mdns: bool,
                default_listen: str, persistent: bool = True, dht_mode: str = "server", relays=()) -> NodeConfig:
    from .transport import identity as ident

    for a in listen:
        parse_multiaddr(a, what="--listen")
    for a in announce:
        parse_multiaddr(a, what="--announce")
    for a in bootstrap:
        parse_peer_addr(a, what="--bootstrap")
    for a in relays:
        parse_peer_addr(a, what="--relay")
    cfg = NodeConfig(
        listen=list(listen) or [default_listen],
        announce=list(announce),
        bootstrap=list(bootstrap),
        enable_quic=quic,
        enable_mdns=mdns,
        dht_mode=dht_mode,
        relays=list(relays),
    )
    meta = click.get_current_context(silent=True)
    meta = meta.meta if meta is not None else {}
    cfg.hole_punch = not meta.get("shardnet.no_hole_punch", False)
    for assignment in meta.get("shardnet.limits", ()):
        cfg.limits.set(assignment)
    _load_swarm_key(cfg)
    if meta.get("shardnet.no_auto_relay", False):
        cfg.auto_relays = 0
    if meta.get("shardnet.no_autonat", False):
        cfg.autonat_client = False
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


@main.command("limits")
def limits_cmd() -> None:
    """List the resource limits a node enforces on its peers, with their defaults.

    Set any of them on a node command with `--limit NAME=VALUE` (repeatable)."""
    from .transport.limits import Limits

    rows = Limits.describe()
    width = max(len(name) for name, _, _ in rows)
    for name, default, doc in rows:
        _say(f"{name:<{width}}  {default!s:<10}  {doc}")
    _say("")
    _say("Also: --kv-budget-mb (join: KV cache for all sessions), the relay limits (relay, bootstrap "
         "--serve-relay; see --help), gossip rate and connection counts (NodeConfig, for embedding apps).")


@main.command("swarm-key")
@click.argument("path", type=click.Path(dir_okay=False, path_type=Path))
@_wrap_errors
def swarm_key_cmd(path: Path) -> None:
    """Make a private swarm's key at PATH (or show the fingerprint of the one there).

    Give the file (mode 0600) to every member: `--swarm-key PATH` on each of their commands.
    """
    from .transport.swarm_key import SwarmKey

    if path.exists():
        key = SwarmKey.load(path)
        _say(f"swarm key {path}: fingerprint {key.fingerprint}")
        return
    key = SwarmKey.generate()
    key.save(path)
    _say(f"made swarm key {path}: fingerprint {key.fingerprint}")


def relay_limit_options(f):
    f = click.option("--reservation-ttl", default=3600.0, show_default=True, help="Seconds a reservation lasts.")(f)
    f = click.option("--max-reservations", default=128, show_default=True)(f)
    f = click.option("--max-circuits-per-peer", default=16, show_default=True)(f)
    f = click.option("--circuit-mb", default=1024.0, show_default=True, help="MiB per direction per circuit.")(f)
    f = click.option("--circuit-seconds", default=3600.0, show_default=True, help="Lifetime of a circuit.")(f)
    return f


def _relay_limits(reservation_ttl, max_reservations, max_circuits_per_peer, circuit_mb, circuit_seconds):
    from .transport.nat.relay import RelayLimits

    if min(reservation_ttl, max_reservations, max_circuits_per_peer, circuit_mb, circuit_seconds) <= 0:
        fail("relay limits must be positive", 2)
    return RelayLimits(reservation_ttl=reservation_ttl, max_reservations=max_reservations,
                       max_circuits_per_peer=max_circuits_per_peer, circuit_bytes=int(circuit_mb * (1 << 20)),
                       circuit_duration=circuit_seconds)


def _serve_forever(cfg: NodeConfig, title: str) -> None:
    from .transport import open_node

    async def _main() -> None:
        async with open_node(cfg) as node:
            _say(f"{title} {node.peer_id}")
            for a in node.listen_addrs:
                _say(f"  {a}")
            lim = cfg.relay_service
            if lim is not None:
                _say(f"relay: reservations {lim.reservation_ttl:g} s (at most {lim.max_reservations}), "
                     f"{lim.max_circuits_per_peer} circuits per peer, {lim.circuit_bytes >> 20} MiB and "
                     f"{lim.circuit_duration:g} s per circuit")
            _say("ready; stop with Ctrl-C")
            await trio.sleep_forever()

    run(_main)
    _say("stopped")


@main.command()
@identity_option
@network_options(DEFAULT_SERVER_LISTEN)
@click.option("--serve-relay", is_flag=True, help="Also be a circuit relay (limits as for `shardnet relay`).")
@relay_limit_options
@_wrap_errors
def bootstrap(identity, listen, announce, bootstrap, quic, mdns, relays, serve_relay, **limits) -> None:
    """Run a bootstrap / DHT server node; print its full multiaddrs; run until stopped."""
    cfg = make_config(relays=relays, identity=identity, listen=listen, announce=announce, bootstrap=bootstrap,
                      quic=quic, mdns=mdns, default_listen=DEFAULT_SERVER_LISTEN)
    if serve_relay:
        cfg.relay_service = _relay_limits(**limits)
    _serve_forever(cfg, "bootstrap node")


@main.command()
@identity_option
@network_options(DEFAULT_SERVER_LISTEN)
@relay_limit_options
@_wrap_errors
def relay(identity, listen, announce, bootstrap, quic, mdns, relays, **limits) -> None:
    """Run a circuit relay v2 (hop + stop), also a bootstrap / DHT server; run until stopped.

    Peers behind NAT reserve a slot (`--relay MADDR` on any command) and are reached through it."""
    cfg = make_config(relays=relays, identity=identity, listen=listen, announce=announce, bootstrap=bootstrap,
                      quic=quic, mdns=mdns, default_listen=DEFAULT_SERVER_LISTEN)
    cfg.relay_service = _relay_limits(**limits)
    _serve_forever(cfg, "relay node")


@main.command()
@identity_option
@network_options(DEFAULT_SERVER_LISTEN)
@click.option("--subscribe", "topics", multiple=True, metavar="TOPIC", help="Print messages on TOPIC.")
@click.option("--events", is_flag=True,
              help="Machine interface: JSON events on stdout, JSON commands on stdin.")
@_wrap_errors
def node(identity, listen, announce, bootstrap, quic, mdns, relays, topics, events) -> None:
    """Join the overlay through --bootstrap and stay up until stopped."""
    from .transport import open_node

    cfg = make_config(relays=relays, identity=identity, listen=listen, announce=announce, bootstrap=bootstrap,
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


def model_path_option(f):
    return click.option("--model", "model_path", type=click.Path(exists=True, file_okay=False, path_type=Path),
                        default=None, help="Checkpoint directory (default: the shipped tiny-llama).")(f)


def _model_dir(path: Path | None) -> Path:
    from .models import default_model_path

    return path or default_model_path()


@asynccontextmanager
async def _visiting(cfg: NodeConfig, wait: float):
    """A visitor's node, joined (when it has bootstrap peers) and given ``wait`` s to discover."""
    from .transport import open_node

    async with open_node(cfg) as n:
        if cfg.bootstrap:
            await n.wait_bootstrapped()
        log.info("discovering peers for %.1f s", wait)
        await trio.sleep(wait)
        yield n


def _visitor_config(relays, listen, announce, bootstrap, quic, mdns) -> NodeConfig:
    """A short-lived look at the swarm: throwaway identity, ephemeral port, DHT client only."""
    return make_config(relays=relays, identity=None, listen=listen, announce=announce, bootstrap=bootstrap,
                       quic=quic, mdns=mdns, default_listen="/ip4/0.0.0.0/tcp/0",
                       persistent=False, dht_mode="client")


@main.command()
@network_options("/ip4/0.0.0.0/tcp/0")
@click.option("--wait", default=3.0, show_default=True, help="Seconds to spend discovering.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@_wrap_errors
def peers(listen, announce, bootstrap, quic, mdns, relays, wait, as_json) -> None:
    """List the peers reachable through --bootstrap (joins with a throwaway identity)."""

    if not bootstrap and not mdns:
        fail("peers needs --bootstrap MADDR (or --mdns)", 2)
    cfg = _visitor_config(relays, listen, announce, bootstrap, quic, mdns)

    async def _main() -> list[dict]:
        async with _visiting(cfg, wait) as n:
            return {"reachability": n.autonat.status,
                    "peers": [{"peer_id": str(p), "addrs": [str(a) for a in n.addrs_of(p)],
                               "link": n.link(p) or "known",
                               "connected": p in n.peers()} for p in sorted(n.discovered, key=str)]}

    found = run(_main) or {"reachability": "unknown", "peers": []}
    if as_json:
        _say(json.dumps(found, indent=2))
        return
    _say(f"{len(found['peers'])} peer(s); this machine is {found['reachability']}")
    for p in found["peers"]:
        _say(f"{p['peer_id']}  {p['link']:8}  {' '.join(p['addrs'])}")


@main.command()
@network_options("/ip4/0.0.0.0/tcp/0")
@model_path_option
@click.option("--wait", default=20.0, show_default=True, help="Seconds to wait for AutoNAT answers.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@_wrap_errors
def status(listen, announce, bootstrap, quic, mdns, relays, model_path, wait, as_json) -> None:
    """This machine's reachability (AutoNAT, relays) and the swarm serving a model: the layer
    coverage map and each peer's range, throughput, reachability, load and round trip."""
    from shardnet.inference.model.checkpoint import Checkpoint
    from .inference.swarm_status import format_report, swarm_report
    from .transport import open_node

    if not bootstrap:
        fail("status needs --bootstrap MADDR", 2)
    cfg = _visitor_config(relays, listen, announce, bootstrap, quic, mdns)
    ckpt = Checkpoint(_model_dir(model_path))

    async def _main() -> dict:
        async with open_node(cfg) as n:
            await n.wait_bootstrapped()
            click.echo(f"joined as {n.peer_id}; asking peers whether they can reach us (up to {wait:g} s) "
                       f"and which layers of {ckpt.path.name} they serve", err=True)
            out: dict = {}

            async def nat() -> None:
                with trio.move_on_after(wait):
                    # until a verdict (or every server declined to judge: same machine or LAN)
                    while (n.autonat.status == "unknown" and not n.autonat.reachability.answers) or (
                            n.autonat.status == "private" and cfg.auto_relays and not n.relay_client.circuit_addrs):
                        await trio.sleep(0.2)
                out["nat"] = {"peer_id": str(n.peer_id), "listen": [str(a) for a in n.listen_addrs],
                              **n.nat_status()}

            async def swarm() -> None:
                out["swarm"] = await swarm_report(n, ckpt.model_id, ckpt.num_layers, wait=min(wait, 10.0))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(nat)
                nursery.start_soon(swarm)
            return out

    st = run(_main)
    if as_json:
        _say(json.dumps(st, indent=2))
        return
    nat = st["nat"]
    _say(f"reachability: {nat['reachability']}")
    for server, answer in nat["autonat_answers"].items():
        _say(f"  {server[:16]}…: {answer}")
    _say(f"seen at: {', '.join(nat['observed_ips']) or 'nobody said'}")
    _say(f"public addresses: {', '.join(nat['public_addrs']) or 'none'}")
    if nat["circuit_addrs"]:
        _say("reachable through relays at:")
        for a in nat["circuit_addrs"]:
            _say(f"  {a}")
    elif nat["reachability"] == "private":
        _say("no relay slot: peers behind other NATs cannot reach this machine (start a relay: `shardnet relay`)")
    _say("")
    for line in format_report(st["swarm"]):
        _say(line)


@main.command()
@click.argument("maddr")
@click.option("--count", "-c", default=3, show_default=True, help="Number of pings.")
@click.option("--timeout", default=10.0, show_default=True, help="Seconds to wait for each answer.")
@swarm_key_option
@_wrap_errors
def ping(maddr: str, count: int, timeout: float) -> None:
    """Ping a peer at MADDR (/ip4/../tcp/../p2p/ID) and print round-trip times."""
    from .transport import open_node

    info = parse_peer_addr(maddr, what="MADDR")
    cfg = _load_swarm_key(NodeConfig(listen=["/ip4/0.0.0.0/tcp/0"], dial_timeout=timeout))

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
@identity_option
@network_options(DEFAULT_SERVER_LISTEN)
@model_path_option
@click.option("--layers", default=None, metavar="START:END",
              help="Layers to serve (default: as many as memory allows, where the swarm needs them most).")
@click.option("--max-layers", type=click.IntRange(min=1), default=None,
              help="Serve at most this many layers when choosing automatically.")
@click.option("--rebalance-interval", default=60.0, show_default=True,
              help="Seconds between looks at the swarm (RTTs to successors; moving, if the span was chosen "
                   "automatically). 0: never.")
@click.option("--dtype", default="float32", type=click.Choice(["float32", "bfloat16", "float16"]), show_default=True)
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
@click.option("--events", is_flag=True, help="JSON events on stdout, JSON commands on stdin.")
@_wrap_errors
def join(identity, listen, announce, bootstrap, quic, mdns, relays, model_path, layers, max_layers, rebalance_interval,
         dtype, device, kv_budget_mb, hold_head, threads, throughput, events) -> None:
    """Serve a block of a model's layers to the swarm (chosen for you unless --layers)."""
    from shardnet.inference.model.block import parse_layers
    from shardnet.inference.model.checkpoint import Checkpoint, CheckpointError
    from shardnet.inference.server.compute_peer import join_swarm
    from .node_control import NodeControl
    from .transport import open_node

    if threads:
        import torch

        torch.set_num_threads(threads)
    path = _model_dir(model_path)
    _check_device(device)
    try:
        ckpt = Checkpoint(path)
        span = parse_layers(layers, ckpt.num_layers) if layers else None
    except CheckpointError as e:
        fail(str(e))
    cfg = make_config(relays=relays, identity=identity, listen=listen, announce=announce, bootstrap=bootstrap,
                      quic=quic, mdns=mdns, default_listen=DEFAULT_SERVER_LISTEN)

    def moved(move, old) -> None:
        if events:
            _emit({"event": "moved", "from": list(old), "layers": [move.start, move.end],
                   "bottleneck": [move.bottleneck_now, move.bottleneck_after]})
        else:
            _say(f"moved from layers {old[0]}:{old[1]} to {move.start}:{move.end} (swarm bottleneck "
                 f"{move.bottleneck_now:.1f} -> {move.bottleneck_after:.1f} tok/s)")

    async def _main() -> None:
        async with open_node(cfg) as n:
            if bootstrap and span is None:
                await n.wait_bootstrapped()  # to see what the swarm serves before choosing
            async with join_swarm(n, str(path), layers=span, max_layers=max_layers,
                                  rebalance_interval=rebalance_interval, on_move=moved, dtype=dtype, device=device,
                                  kv_budget_bytes=kv_budget_mb << 20, hold_head=hold_head,
                                  throughput=throughput) as peer:
                start, end = peer.span
                if events:
                    _emit({"event": "serving", "model": peer.model_id, "layers": [start, end], "tput": peer.tput})
                else:
                    _say(f"serving layers {start}:{end} of {path.name} (model {peer.model_id[:16]}…, "
                         f"{peer.tput:.0f} tok/s)")
                control = NodeControl(n, emit=_emit if events else None, say=_say)
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


def _client_identity_option(f):
    return click.option("--identity", type=click.Path(dir_okay=False, path_type=Path), default=None,
                        help="Identity key file to use, created if missing (default: a throwaway identity "
                             "for this run).")(f)


def _generation_config(identity: Path | None, **net) -> NodeConfig:
    """A generating client's node: DHT client; its own identity with --identity, else a throwaway one."""
    return make_config(identity=identity, persistent=identity is not None, default_listen="/ip4/0.0.0.0/tcp/0",
                       dht_mode="client", **net)


@main.command()
@_client_identity_option
@network_options("/ip4/0.0.0.0/tcp/0")
@model_path_option
@click.argument("prompt")
@click.option("--max-new-tokens", "-n", default=48, show_default=True)
@click.option("--temperature", default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-p", default=1.0, show_default=True)
@click.option("--top-k", default=0, show_default=True)
@click.option("--seed", default=None, type=int)
@click.option("--logits-on-last", is_flag=True, help="Let the last peer apply the LM head (thin client).")
@click.option("--dtype", default="float32", type=click.Choice(["float32", "bfloat16", "float16"]), show_default=True)
@click.option("--route-timeout", default=30.0, show_default=True, help="Seconds to wait for peers covering the model.")
@click.option("--speculate", type=click.Choice(["none", "draft", "ngram"]), default="none", show_default=True,
              help="Speculative decoding with a local draft model or prompt lookup (lossless, any sampling).")
@click.option("--draft", "draft_path", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="Draft checkpoint for --speculate draft (default: the shipped tiny-llama-draft).")
@click.option("-k", "draft_k", default=4, show_default=True, help="Drafted tokens verified per traversal.")
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
@_wrap_errors
def generate(identity, listen, announce, bootstrap, quic, mdns, relays, model_path, prompt, max_new_tokens, temperature,
             top_p, top_k, seed, logits_on_last, dtype, route_timeout, speculate, draft_path, draft_k, depth, wire,
             receipt, receipt_without_prompt, check_speculation, audit_rate) -> None:
    """Generate text from PROMPT through the swarm; print tokens as they arrive."""
    from shardnet.inference.client.client import Client
    from shardnet.inference.model.local_model import LocalModel
    from shardnet.inference.client.speculative import ModelDrafter, NGramDrafter
    from .transport import open_node

    if not bootstrap and not mdns:
        fail("generate needs --bootstrap MADDR (or --mdns)", 2)
    path = _model_dir(model_path)
    cfg = _generation_config(identity, relays=relays, listen=listen, announce=announce, bootstrap=bootstrap,
                             quic=quic, mdns=mdns)

    drafter = None

    async def _main() -> None:
        nonlocal drafter
        model = await trio.to_thread.run_sync(lambda: LocalModel(path, dtype=dtype, lm_head=not logits_on_last))
        if speculate == "ngram":
            drafter = NGramDrafter()
        elif speculate == "draft":
            from .models import default_draft_path

            drafter = await trio.to_thread.run_sync(lambda: ModelDrafter(
                draft_path or default_draft_path(), vocab_size=model.ckpt.config.vocab_size))
        async with open_node(cfg) as n:
            if bootstrap:
                await n.wait_bootstrapped()
            client = Client(n, model, logits_on_last=logits_on_last, route_timeout=route_timeout, wire=wire,
                            **({} if audit_rate is None else {"audit_rate": audit_rate}))
            await _stream_generation(client, prompt, max_new_tokens=max_new_tokens, temperature=temperature,
                                     top_p=top_p, top_k=top_k, seed=seed, drafter=drafter, k=draft_k, depth=depth)
            if receipt is not None:
                await _write_receipt(client, receipt, with_prompt=not receipt_without_prompt,
                                     check=check_speculation and drafter is not None and temperature == 0)

    run(_main)


@main.command()
@_client_identity_option
@network_options("/ip4/0.0.0.0/tcp/0")
@model_path_option
@click.option("--host", default="127.0.0.1", show_default=True, help="Address the HTTP server binds.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="HTTP port (0: any).")
@click.option("--name", default=None, help="The model name clients ask for (default: the model directory's name).")
@click.option("--logits-on-last", is_flag=True, help="Let the last peer apply the LM head (thin gateway).")
@click.option("--dtype", default="float32", type=click.Choice(["float32", "bfloat16", "float16"]), show_default=True)
@click.option("--route-timeout", default=10.0, show_default=True,
              help="Seconds a request waits for peers covering the model before a 503.")
@click.option("--audit-rate", type=click.FloatRange(0, 1), default=None,
              help="Share of steps re-run on other peers to catch wrong computation (default 0.1; 0: off).")
@_wrap_errors
def serve(identity, listen, announce, bootstrap, quic, mdns, relays, model_path, host, port, name, logits_on_last,
          dtype, route_timeout, audit_rate) -> None:
    """Serve an OpenAI-compatible HTTP API (completions, chat, streaming) backed by the swarm."""
    from .gateway.server import serve_gateway
    from shardnet.inference.client.client import Client
    from shardnet.inference.model.local_model import LocalModel
    from .transport import open_node

    if not bootstrap and not mdns:
        fail("serve needs --bootstrap MADDR (or --mdns)", 2)
    path = _model_dir(model_path)
    cfg = _generation_config(identity, relays=relays, listen=listen, announce=announce, bootstrap=bootstrap,
                             quic=quic, mdns=mdns)

    async def _main() -> None:
        log.info("loading the model's head from %s…", path)
        model = await trio.to_thread.run_sync(lambda: LocalModel(path, dtype=dtype, lm_head=not logits_on_last))
        async with open_node(cfg) as n:
            if bootstrap:
                log.info("joining the swarm…")
                await n.wait_bootstrapped()
            client = Client(n, model, logits_on_last=logits_on_last, route_timeout=route_timeout,
                            **({} if audit_rate is None else {"audit_rate": audit_rate}))
            async with trio.open_nursery() as nursery:
                # a port in use: PortInUseError, one line like the libp2p port's
                urls = await nursery.start(functools.partial(
                    serve_gateway, client, name or path.name, host=host, port=port, route_timeout=route_timeout))
                _say(f"serving the OpenAI API for model {name or path.name!r} on {', '.join(urls)} "
                     f"(model {model.model_id[:16]}…)")

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
    route = await client.find_route()  # its status lines come before the text, not inside it
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
    if sp.drafted:
        click.echo(f"-- speculation: {sp.verified} traversals, {sp.tokens_per_traversal:.2f} tokens each, "
                   f"{sp.acceptance:.0%} of drafts accepted, {sp.stale} stale chunks discarded")
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


@main.command()
@click.argument("receipt", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--manifest", type=click.Path(exists=True, path_type=Path), default=None,
              help="The model's manifest (`shardnet model manifest` output) or its checkpoint directory.")
@click.option("--recompute", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="A local copy of the model: rerun the prompt and compare the tokens.")
@click.option("--prompt", default=None, help="The prompt text, when the receipt does not carry its tokens.")
@_wrap_errors
def verify(receipt: Path, manifest: Path | None, recompute: Path | None, prompt: str | None) -> None:
    """Check a run receipt offline: signatures, layer tiling, hash chains linking every stage,
    the output hash, the model ID; optionally recompute the output. One line per check; exit 0
    only if every check passes."""
    from .protocols import receipts as rc

    try:
        doc = json.loads(receipt.read_text())
    except (OSError, json.JSONDecodeError) as e:
        fail(f"{receipt} is not a JSON receipt: {e}")
    model_id = None
    if manifest is not None:
        from shardnet.inference.model.checkpoint import Checkpoint, model_id_of

        if manifest.is_dir():
            model_id = Checkpoint(manifest).model_id
        else:  # `shardnet model manifest --json` output, or a bare manifest: the ID is recomputed from it
            m = json.loads(manifest.read_text())
            model_id = model_id_of(m["manifest"] if isinstance(m, dict) and "manifest" in m else m)
    checks = rc.verify_run(doc, manifest_model_id=model_id)
    if recompute is not None and all(c.ok for c in checks):
        checks.append(_recompute_check(doc, recompute, prompt))
    for c in checks:
        _say(f"{'ok  ' if c.ok else 'FAIL'}  {c.name}: {c.detail}")
    bad = [c for c in checks if not c.ok]
    if bad:
        fail(f"receipt does not verify: {bad[0].name}")
    _say(f"receipt verifies: {len(checks)} checks passed")


def _recompute_check(doc: dict, path: Path, prompt: str | None):
    from shardnet.inference.model.block import Block
    from shardnet.inference.client.decode import GenerationStats, generate_on
    from shardnet.inference.model.local_model import LocalModel
    from shardnet.inference.model.local_session import LocalSession
    from shardnet.inference.client.sampling import Randomness, SamplingParams
    from shardnet.inference.client.speculative import NGramDrafter
    from .protocols import receipts as rc

    body = doc["body"]
    model = LocalModel(path)
    if model.model_id != body["model"]:
        return rc.Check("recompute", False, f"{path} is model {model.model_id[:16]}…, the run used {body['model'][:16]}…")
    ids = model.encode(prompt) if prompt is not None else doc.get("prompt_ids")
    if ids is None:
        return rc.Check("recompute", False, "the receipt carries no prompt tokens: give --prompt")
    if rc.tokens_hash(ids) != body["prompt_sha256"]:
        return rc.Check("recompute", False, "the prompt does not match prompt_sha256")
    sampling = body["sampling"]
    params = SamplingParams(sampling["temperature"], sampling["top_p"], sampling["top_k"], body.get("seed"))
    spec = body.get("speculative")
    drafter, k, depth = None, 0, 1
    if not params.greedy and spec:  # sampled text depends on the drafting: replay it where it is deterministic
        if spec["drafter"] != "ngram":
            return rc.Check("recompute", False, "a sampled run with a draft model cannot be recomputed here")
        drafter, k, depth = NGramDrafter(), spec["k"], spec["depth"]
    want = body["output_ids"]
    block = Block(model.ckpt, 0, model.ckpt.num_layers)

    async def _run() -> list[int]:
        out: list[int] = []
        async for tok in generate_on(LocalSession(block), model, ids, params=params, rng=Randomness(params.seed),
                                     drafter=drafter, k=k, depth=depth, max_new=len(want), stop_at_eos=False,
                                     stats=GenerationStats()):
            out.append(tok.id)
        return out

    got = trio.run(_run)
    same = got == want
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    return rc.Check("recompute", same, f"{len(want)} tokens recomputed locally: identical" if same
                    else f"token {first} differs (local {got[first]}, receipt {want[first]})")


@main.command()
@network_options("/ip4/0.0.0.0/tcp/0")
@click.option("--peer", "peer_ids", multiple=True, help="Ask this peer (repeatable; default: every peer found).")
@click.option("--get", "get_ids", multiple=True, help="Fetch the receipt with this ID (repeatable) and print it.")
@click.option("--reports", "want_reports", is_flag=True,
              help="List the reports of peers caught computing wrong that peers heard on gossip.")
@click.option("--wait", default=3.0, show_default=True, help="Seconds to spend discovering peers.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@_wrap_errors
def receipts(listen, announce, bootstrap, quic, mdns, relays, peer_ids, get_ids, want_reports, wait, as_json) -> None:
    """List the stage receipts peers keep (newest first), fetch receipts by ID, or list reports."""
    from .inference.receipt_service import request
    from .protocols import receipt_gossip as rg
    from .protocols import receipts as rc

    if not bootstrap and not mdns:
        fail("receipts needs --bootstrap MADDR (or --mdns)", 2)
    cfg = _visitor_config(relays, listen, announce, bootstrap, quic, mdns)

    async def _main() -> list[dict]:
        async with _visiting(cfg, wait) as n:
            targets = list(peer_ids) or [str(p) for p in n.peers()]
            out: list[dict] = []

            async def ask(peer: str) -> None:
                try:
                    if want_reports:
                        got = await request(n, peer, rg.encode_request(reports_max=rg.MAX_REPORTS_PER_RESPONSE))
                        for blob in got["reports"]:
                            try:
                                r = rg.decode_report(blob)
                            except rg.GossipError as e:
                                log.info("%s sent a bad report: %s", peer[:16], e)
                                continue
                            out.append({"id": rc.receipt_id(blob), "from": peer, "accused": r["accused"],
                                        "reporter": r["reporter"], "layers": r["layers"], "model": r["model"],
                                        "divergence": r["divergence"], "tolerance": r["tolerance"],
                                        "evidence": [x.peer for x in r["receipts"]], "t": r.get("t")})
                    elif get_ids:
                        got = await request(n, peer, rg.encode_request(get=list(get_ids)))
                        for blob in got["receipts"]:
                            r = rc.decode_stage(blob)
                            out.append({"id": rc.receipt_id(blob), "from": peer, "receipt": r.__dict__})
                    else:
                        got = await request(n, peer, rg.encode_request(list_max=rg.MAX_IDS_PER_REQUEST))
                        out.extend({**d, "from": peer} for d in got["digests"])
                except (ShardnetError, rg.GossipError, rc.ReceiptError, trio.TooSlowError) as e:
                    log.info("%s: %s", peer[:16], e)

            async with trio.open_nursery() as nursery:
                for p in targets:
                    nursery.start_soon(ask, p)
            return out

    found = run(_main) or []
    if get_ids:
        missing = set(get_ids) - {f["id"] for f in found}
        _say(json.dumps({f["id"]: f["receipt"] for f in found}, indent=1))
        if missing:
            fail(f"not found: {', '.join(sorted(missing))}")
        return
    if want_reports:
        found = list({f["id"]: f for f in found}.values())  # the same report, heard by several peers
    if as_json:
        _say(json.dumps(found, indent=1))
        return
    if want_reports:
        _say(f"{len(found)} report(s)")
        for r in found:
            _say(f"{r['id'][:16]}…  accused {r['accused'][:16]}…  layers {r['layers'][0]}:{r['layers'][1]}  "
                 f"off by {r['divergence']:.3g} (tolerance {r['tolerance']:.2g})  by {r['reporter'][:16]}…  "
                 f"{len(r['evidence'])} signed receipt(s)")
        return
    _say(f"{len(found)} receipt(s)")
    for d in found:
        _say(f"{d['id'][:16]}…  peer {d['peer'][:16]}…  layers {d['layers'][0]}:{d['layers'][1]}  "
             f"steps {d['steps']}  session {d['session'][:8]}…")


@main.group()
def model() -> None:
    """Model files: random checkpoints, manifests."""


@model.command("init-random")
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option("--family", default="llama", type=click.Choice(["llama", "mistral", "qwen2", "qwen3"]), show_default=True)
@click.option("--layers", default=4, show_default=True)
@click.option("--hidden", default=64, show_default=True)
@click.option("--heads", default=4, show_default=True)
@click.option("--kv-heads", default=2, show_default=True)
@click.option("--intermediate", default=None, type=int)
@click.option("--vocab", default=512, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--dtype", default="float32", type=click.Choice(["float32", "bfloat16", "float16"]), show_default=True)
@click.option("--shards", default=1, show_default=True, help="Split the weights into this many files.")
def model_init_random(out, family, layers, hidden, heads, kv_heads, intermediate, vocab, seed, dtype, shards) -> None:
    """Write a random checkpoint (any size) to OUT."""
    from shardnet.inference.model.random_model import init_random

    if hidden % heads or heads % kv_heads:
        fail("--hidden must be a multiple of --heads, and --heads of --kv-heads", 2)
    path = init_random(out, family, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                       intermediate=intermediate, vocab=vocab, seed=seed, dtype=dtype, shards=shards)
    _say(f"wrote {family} ({layers} layers, hidden {hidden}) to {path}")


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
        _say(json.dumps({"model_id": ck.model_id, "manifest": m}, indent=2))
    else:
        _say(f"model id: {ck.model_id}")
        _say(f"family:   {m['model_type']}, {m['num_layers']} layers")


@main.command()
@model_path_option
@click.option("--prompt", default=None, help="Prompt (default: the start of a Python function).")
@click.option("--max-new-tokens", "-n", default=48, show_default=True)
@click.option("--peers", default=3, show_default=True, help="Compute peers to start.")
@click.option("--timeout", default=120.0, show_default=True, help="Give up after this many seconds.")
@click.option("--overlay-only", is_flag=True, help="Only show the overlay (discovery, streams, gossip).")
def demo(model_path, prompt, max_new_tokens, peers, timeout, overlay_only) -> None:
    """Start a local swarm serving the shipped model, generate, print the layer map, stop it all."""
    from .demo import run_model_demo, run_overlay_demo

    try:
        if overlay_only:
            run_overlay_demo(nodes=peers, timeout=timeout, say=_say)
        else:
            run_model_demo(model_path=_model_dir(model_path), peers=peers, prompt=prompt,
                           max_new_tokens=max_new_tokens, timeout=timeout, say=_say)
    except ShardnetError as e:
        fail(str(e))


if __name__ == "__main__":  # pragma: no cover
    main()
