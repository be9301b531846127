"""Overlay commands: identity, limits, swarm keys, long-running nodes (bootstrap, relay, node)
and short looks at the swarm (peers, status, ping)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click
import trio

from shardnet.transport.config import DEFAULT_SERVER_LISTEN, NodeConfig, parse_peer_addr

from .common import (
    emit,
    fail,
    identity_option,
    load_swarm_key,
    log,
    make_config,
    local_model,
    metrics_if_asked,
    metrics_options,
    model_path_option,
    network_options,
    run,
    say,
    swarm_key_option,
    visiting,
    visitor_config,
    wrap_errors,
)


@click.command("id")
@identity_option
@wrap_errors
def id_cmd(identity: Path | None) -> None:
    """Create (first time) or show this machine's peer identity."""
    from shardnet.transport import identity as ident

    path = identity or ident.default_identity_path()
    kp, created = ident.load_or_create(path)
    say(f"peer id:  {ident.peer_id_of(kp)}")
    say(f"identity: {path} ({'created' if created else 'existing'})")


@click.command("limits")
def limits_cmd() -> None:
    """List the resource limits a node enforces on its peers, with their defaults.

    Set any of them on a node command with `--limit NAME=VALUE` (repeatable)."""
    from shardnet.transport.limits import Limits

    rows = Limits.describe()
    width = max(len(name) for name, _, _ in rows)
    for name, default, doc in rows:
        say(f"{name:<{width}}  {default!s:<10}  {doc}")
    say("")
    say("Also: --kv-budget-mb (join: KV cache for all sessions), the relay limits (relay, bootstrap "
         "--serve-relay; see --help), gossip rate and connection counts (NodeConfig, for embedding apps).")


@click.command("swarm-key")
@click.argument("path", type=click.Path(dir_okay=False, path_type=Path))
@wrap_errors
def swarm_key_cmd(path: Path) -> None:
    """Make a private swarm's key at PATH (or show the fingerprint of the one there).

    Give the file (mode 0600) to every member: `--swarm-key PATH` on each of their commands.
    """
    from shardnet.transport.swarm_key import SwarmKey

    if path.exists():
        key = SwarmKey.load(path)
        say(f"swarm key {path}: fingerprint {key.fingerprint}")
        return
    key = SwarmKey.generate()
    key.save(path)
    say(f"made swarm key {path}: fingerprint {key.fingerprint}")


def relay_limit_options(f):
    f = click.option("--reservation-ttl", default=3600.0, show_default=True, help="Seconds a reservation lasts.")(f)
    f = click.option("--max-reservations", default=128, show_default=True)(f)
    f = click.option("--max-circuits-per-peer", default=16, show_default=True)(f)
    f = click.option("--circuit-mb", default=1024.0, show_default=True, help="MiB per direction per circuit.")(f)
    f = click.option("--circuit-seconds", default=3600.0, show_default=True, help="Lifetime of a circuit.")(f)
    return f


def _relay_limits(reservation_ttl, max_reservations, max_circuits_per_peer, circuit_mb, circuit_seconds):
    from shardnet.transport.nat.relay import RelayLimits

    if min(reservation_ttl, max_reservations, max_circuits_per_peer, circuit_mb, circuit_seconds) <= 0:
        fail("relay limits must be positive", 2)
    return RelayLimits(reservation_ttl=reservation_ttl, max_reservations=max_reservations,
                       max_circuits_per_peer=max_circuits_per_peer, circuit_bytes=int(circuit_mb * (1 << 20)),
                       circuit_duration=circuit_seconds)


def _serve_forever(cfg: NodeConfig, title: str) -> None:
    from shardnet.transport import open_node

    meta = click.get_current_context().meta

    async def _main() -> None:
        async with open_node(cfg) as node, metrics_if_asked(node, meta):
            say(f"{title} {node.peer_id}")
            for a in node.listen_addrs:
                say(f"  {a}")
            lim = cfg.relay_service
            if lim is not None:
                say(f"relay: reservations {lim.reservation_ttl:g} s (at most {lim.max_reservations}), "
                     f"{lim.max_circuits_per_peer} circuits per peer, {lim.circuit_bytes >> 20} MiB and "
                     f"{lim.circuit_duration:g} s per circuit")
            say("ready; stop with Ctrl-C")
            await trio.sleep_forever()

    run(_main)
    say("stopped")


@click.command()
@identity_option
@network_options(DEFAULT_SERVER_LISTEN)
@metrics_options
@click.option("--serve-relay", is_flag=True, help="Also be a circuit relay (limits as for `shardnet relay`).")
@relay_limit_options
@wrap_errors
def bootstrap(identity, listen, announce, bootstrap, quic, mdns, relays, serve_relay, **limits) -> None:
    """Run a bootstrap / DHT server node; print its full multiaddrs; run until stopped."""
    cfg = make_config(relays=relays, identity=identity, listen=listen, announce=announce, bootstrap=bootstrap,
                      quic=quic, mdns=mdns, default_listen=DEFAULT_SERVER_LISTEN)
    if serve_relay:
        cfg.relay_service = _relay_limits(**limits)
    _serve_forever(cfg, "bootstrap node")


@click.command()
@identity_option
@network_options(DEFAULT_SERVER_LISTEN)
@metrics_options
@relay_limit_options
@wrap_errors
def relay(identity, listen, announce, bootstrap, quic, mdns, relays, **limits) -> None:
    """Run a circuit relay v2 (hop + stop), also a bootstrap / DHT server; run until stopped.

    Peers behind NAT reserve a slot (`--relay MADDR` on any command) and are reached through it."""
    cfg = make_config(relays=relays, identity=identity, listen=listen, announce=announce, bootstrap=bootstrap,
                      quic=quic, mdns=mdns, default_listen=DEFAULT_SERVER_LISTEN)
    cfg.relay_service = _relay_limits(**limits)
    _serve_forever(cfg, "relay node")


@click.command()
@identity_option
@network_options(DEFAULT_SERVER_LISTEN)
@metrics_options
@click.option("--subscribe", "topics", multiple=True, metavar="TOPIC", help="Print messages on TOPIC.")
@click.option("--events", is_flag=True,
              help="Machine interface: JSON events on stdout, JSON commands on stdin.")
@wrap_errors
def node(identity, listen, announce, bootstrap, quic, mdns, relays, topics, events) -> None:
    """Join the overlay through --bootstrap and stay up until stopped."""
    from shardnet.transport import open_node

    cfg = make_config(relays=relays, identity=identity, listen=listen, announce=announce, bootstrap=bootstrap,
                      quic=quic, mdns=mdns, default_listen=DEFAULT_SERVER_LISTEN)
    if not bootstrap and not mdns:
        log.warning("no --bootstrap given: this node will only know peers that dial it")

    meta = click.get_current_context().meta

    async def _main() -> None:
        from .node_control import NodeControl

        async with open_node(cfg) as n, metrics_if_asked(n, meta):
            control = NodeControl(n, emit=emit if events else None, say=say)
            await control.run(topics=list(topics), read_commands=events)

    run(_main)
    if not events:
        say("stopped")


@click.command()
@network_options("/ip4/0.0.0.0/tcp/0")
@click.option("--wait", default=3.0, show_default=True, help="Seconds to spend discovering.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@wrap_errors
def peers(listen, announce, bootstrap, quic, mdns, relays, wait, as_json) -> None:
    """List the peers reachable through --bootstrap (joins with a throwaway identity)."""

    if not bootstrap and not mdns:
        fail("peers needs --bootstrap MADDR (or --mdns)", 2)
    cfg = visitor_config(relays, listen, announce, bootstrap, quic, mdns)

    async def _main() -> list[dict]:
        async with visiting(cfg, wait) as n:
            return {"reachability": n.autonat.status,
                    "peers": [{"peer_id": str(p), "addrs": [str(a) for a in n.addrs_of(p)],
                               "link": n.link(p) or "known",
                               "connected": p in n.peers()} for p in sorted(n.discovered, key=str)]}

    found = run(_main) or {"reachability": "unknown", "peers": []}
    if as_json:
        say(json.dumps(found, indent=2))
        return
    say(f"{len(found['peers'])} peer(s); this machine is {found['reachability']}")
    for p in found["peers"]:
        say(f"{p['peer_id']}  {p['link']:8}  {' '.join(p['addrs'])}")


@click.command()
@network_options("/ip4/0.0.0.0/tcp/0")
@model_path_option
@click.option("--wait", default=20.0, show_default=True, help="Seconds to wait for AutoNAT answers.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@wrap_errors
def status(listen, announce, bootstrap, quic, mdns, relays, model_path, wait, as_json) -> None:
    """This machine's reachability (AutoNAT, relays) and the swarm serving a model: the layer
    coverage map and each peer's range, throughput, reachability, load and round trip."""
    from shardnet.inference.model.checkpoint import Checkpoint
    from shardnet.inference.swarm_status import format_report, swarm_report
    from shardnet.transport import open_node

    if not bootstrap:
        fail("status needs --bootstrap MADDR", 2)
    cfg = visitor_config(relays, listen, announce, bootstrap, quic, mdns)
    path = local_model(model_path, download=False)
    ckpt = Checkpoint(path) if path is not None else None  # else a model the swarm serves, by name or ID

    async def _main() -> dict:
        from shardnet.inference.weights.cards import resolve_model

        async with open_node(cfg) as n:
            await n.wait_bootstrapped()
            if ckpt is not None:
                model_id, num_layers, shown = ckpt.model_id, ckpt.num_layers, ckpt.path.name
            else:
                card = await resolve_model(n, model_path, timeout=min(wait, 15.0))
                model_id, num_layers, shown = card.model_id, card.num_layers, model_path
            click.echo(f"joined as {n.peer_id}; asking peers whether they can reach us (up to {wait:g} s) "
                       f"and which layers of {shown} they serve", err=True)
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
                out["swarm"] = await swarm_report(n, model_id, num_layers, wait=min(wait, 10.0))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(nat)
                nursery.start_soon(swarm)
            return out

    st = run(_main)
    if as_json:
        say(json.dumps(st, indent=2))
        return
    nat = st["nat"]
    say(f"reachability: {nat['reachability']}")
    for server, answer in nat["autonat_answers"].items():
        say(f"  {server[:16]}…: {answer}")
    say(f"seen at: {', '.join(nat['observed_ips']) or 'nobody said'}")
    say(f"public addresses: {', '.join(nat['public_addrs']) or 'none'}")
    if nat["circuit_addrs"]:
        say("reachable through relays at:")
        for a in nat["circuit_addrs"]:
            say(f"  {a}")
    elif nat["reachability"] == "private":
        say("no relay slot: peers behind other NATs cannot reach this machine (start a relay: `shardnet relay`)")
    say("")
    for line in format_report(st["swarm"]):
        say(line)


@click.command()
@click.argument("maddr")
@click.option("--count", "-c", default=3, show_default=True, help="Number of pings.")
@click.option("--timeout", default=10.0, show_default=True, help="Seconds to wait for each answer.")
@swarm_key_option
@wrap_errors
def ping(maddr: str, count: int, timeout: float) -> None:
    """Ping a peer at MADDR (/ip4/../tcp/../p2p/ID) and print round-trip times."""
    from shardnet.transport import open_node

    info = parse_peer_addr(maddr, what="MADDR")
    cfg = load_swarm_key(NodeConfig(listen=["/ip4/0.0.0.0/tcp/0"], dial_timeout=timeout))

    async def _main() -> None:
        async with open_node(cfg) as n:
            say(f"PING {info.peer_id}")
            t0 = time.perf_counter()
            await n.connect(info)
            say(f"connected in {(time.perf_counter() - t0) * 1000:.1f} ms")
            for i in range(count):
                rtt = await n.ping(info.peer_id, timeout=timeout)
                say(f"pong from {info.peer_id}: seq={i} time={rtt * 1000:.2f} ms")

    run(_main)
