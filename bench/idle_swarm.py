"""Idle CPU per peer as the swarm grows (issue 37): N ``shardnet join`` processes, nothing requested.

    python -m bench.idle_swarm [--sizes 2,8,24] [--settle 30] [--window 60] [--profile]
                               [--profile-dir DIR] [--visible-timeout 180] [--quick]

For each size N: a bootstrap and N ``shardnet join --threads 1 --throughput 100 --layers a:b``
processes on loopback serving the shipped tiny-llama (8 layers), the layers split into
min(N, 4) contiguous spans dealt round-robin (2 peers: 0:4 and 4:8; 8 or more: spans of 2
layers, N/4 peers each), so every layer is served at every size. A fixed ``--throughput``: the
start-up measurement would cost CPU and wobble.

1. Visible: from the last peer's ``ready`` on, a fresh node (DHT client, new identity, as
   ``shardnet status`` makes) runs ``swarm_report`` (status' own call: the DHT's providers and
   claims, then a ping to each) again and again, each time from a new node, until it lists all N
   peers live; the time that took and how many peers the last look saw (all N, or the most any
   look saw within ``--visible-timeout``).
2. Settle ``--settle`` seconds, then over ``--window`` seconds: each process's CPU time from
   /proc/PID/stat (utime + stime), its RSS at the end (/proc/PID/status), the machine's busy
   cores (/proc/stat) and load average, since other work may share the machine.

With ``--profile`` one peer per size runs under ``SHARDNET_PROFILE`` (shardnet/cli/profiling.py:
cProfile in CPU seconds of its event loop's thread), scoped to the window by its signals; its CPU
time is left out of the per-peer figures (profiling makes every call dearer). Its functions are
mapped to categories by module path and name (``CATEGORIES``); a function of no category (trio's
channels and sleeps, logging, cbor2, ...) passes its time to its callers' categories, in
proportion to the time each caller spent in it, and what reaches trio's run loop with no
category is the event loop's own. The profile's call counts give message rates: pubsub RPCs
read, gossip messages received (duplicates included), new claims validated from the claims
topic, ed25519 signature checks; cumulative times of a few entry points (``INCLUSIVE``) say
what drives the connection layer's and the event loop's share. ``--profile-dir`` keeps each
window's profile (``peer0-of-N.prof``, pstats' format). Figures: docs/performance.md (issue 37).
"""

from __future__ import annotations

import functools
import os
import pstats
import re
import shutil
import signal
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import trio

from bench._common import bench_parser, cpu_seconds, print_table, ratio
from bench._common import progress as _progress
from shardnet.cli.profiling import ENV as PROFILE_ENV
from shardnet.inference.model.checkpoint import Checkpoint
from shardnet.inference.swarm_status import swarm_report
from shardnet.models import default_model_path
from shardnet.testing.localswarm import LocalSwarm, ShardnetProcess
from shardnet.transport import NodeConfig, open_node

MAX_SPANS = 4

# (category, module path fragment or None, function name pattern or None): the first rule whose
# fragment is in the function's file path (or, for C functions, its name) and whose pattern
# matches its name gives its category.
CATEGORIES: list[tuple[str, str | None, str | None]] = [
    ("signatures (ed25519)", "/nacl/", None),
    ("signatures (ed25519)", "/libp2p/crypto/ed25519", None),
    ("signatures (ed25519)", "/libp2p/crypto/keys", None),
    ("signatures (ed25519)", "/libp2p/crypto/serialization", None),
    ("signatures (ed25519)", "/libp2p/pubsub/validators", None),
    ("signatures (ed25519)", "/shardnet/transport/envelope", None),
    ("signatures (ed25519)", "~", r"crypto_sign|ed25519|Ed25519"),
    ("claims", "/shardnet/inference/server/claim_publisher", None),
    ("claims", "/shardnet/inference/client/claims_view", None),
    ("claims", "/shardnet/inference/claims.py", None),
    ("claims", "/shardnet/protocols/block_claim", None),
    ("keepalive", "/shardnet/transport/keepalive", None),
    ("keepalive", "/libp2p/network/health", None),
    ("keepalive", "/stream_muxer/yamux", r"(?i)ping|keepalive"),
    ("keepalive", "/shardnet/transport/compat/yamux", r"(?i)ping|keepalive"),
    ("RTT probes", "/shardnet/inference/probes", None),
    ("RTT probes", "/libp2p/host/ping", None),
    ("RTT probes", "/shardnet/transport/host.py", r"ping"),
    ("RTT probes", "/shardnet/transport/node.py", r"ping"),
    ("RTT probes", "/shardnet/inference/server/compute_peer", r"measure_successors"),
    ("peer discovery", "/shardnet/transport/discovery", None),
    ("peer discovery", "/shardnet/transport/bootstrap", None),
    ("DHT", "/libp2p/kad_dht/", None),
    ("DHT", "/libp2p/records/", None),
    ("DHT", "/shardnet/transport/dht", None),
    ("DHT", "/shardnet/transport/records", None),
    ("DHT", "/shardnet/transport/compat/kad", None),
    ("gossipsub heartbeat", "/libp2p/pubsub/gossipsub", r"heartbeat|graft|prune|fanout|select_from_minus|mesh"),
    ("gossipsub IHAVE/IWANT", "/libp2p/pubsub/", r"(?i)ihave|iwant|gossip_heartbeat|mcache|window|shift"),
    ("gossipsub IHAVE/IWANT", "/libp2p/pubsub/mcache", None),
    ("pubsub RPCs (read, validate, forward)", "/libp2p/pubsub/", None),
    ("pubsub RPCs (read, validate, forward)", "/shardnet/transport/pubsub", None),
    ("pubsub RPCs (read, validate, forward)", "/shardnet/transport/compat/pubsub", None),
    ("identify", "/libp2p/identity/", None),
    ("identify", "/shardnet/transport/compat/identify", None),
    ("AutoNAT", "/libp2p/host/autonat", None),
    ("AutoNAT", "/shardnet/transport/nat/autonat", None),
    ("relay, hole punching", "/libp2p/relay/", None),
    ("relay, hole punching", "/shardnet/transport/nat/", None),
    ("connections (TCP, Noise, Yamux, multistream)", "/libp2p/stream_muxer/", None),
    ("connections (TCP, Noise, Yamux, multistream)", "/libp2p/security/", None),
    ("connections (TCP, Noise, Yamux, multistream)", "/libp2p/transport/", None),
    ("connections (TCP, Noise, Yamux, multistream)", "/libp2p/network/", None),
    ("connections (TCP, Noise, Yamux, multistream)", "/libp2p/protocol_muxer/", None),
    ("connections (TCP, Noise, Yamux, multistream)", "/libp2p/io/", None),
    ("connections (TCP, Noise, Yamux, multistream)", "/libp2p/crypto/", None),
    ("connections (TCP, Noise, Yamux, multistream)", "/shardnet/transport/compat/", None),
    ("connections (TCP, Noise, Yamux, multistream)", "/shardnet/transport/stream", None),
    ("connections (TCP, Noise, Yamux, multistream)", "/shardnet/transport/conn_writer", None),
    ("connections (TCP, Noise, Yamux, multistream)", "~", r"ChaCha|encrypt|decrypt|socket|X25519"),
    ("trio event loop", "/trio/_core/", None),
    ("trio event loop", "/outcome/", None),
    ("trio event loop", "~", r"select\.epoll|_contextvars\.Context"),
]
#: A function of no category (trio's channels and locks, logging, codecs, multiaddr, the stdlib,
#: shardnet's own glue) passes its time to its callers: its work is theirs. A chain of such calls
#: that reaches a task's start (trio resuming a coroutine: ``TASK_ROOT``) with no category is "other".
OTHER = "other"
TASK_ROOT = "<method 'send' of "


def category(func: tuple[str, int, str]) -> str | None:
    """The category of a pstats function key (file, line, name); C functions' file is ``~``."""
    path, _, name = func
    path = path.replace(os.sep, "/")
    for cat, fragment, pattern in CATEGORIES:
        if (path != "~" if fragment == "~" else fragment not in path):
            continue
        if pattern is None or re.search(pattern, name):
            return cat
    if path == "~" and name.startswith(TASK_ROOT):
        return OTHER
    return None


def attribute(stats: dict) -> dict[str, float]:
    """CPU seconds per category: each function's own time to its category, or (without one)
    to its callers' categories in proportion to the time each caller spent in it."""
    memo: dict = {}

    def contexts(func) -> dict[str, float]:
        """Where calls of ``func`` belong: category -> fraction (by the time each caller spent in it)."""
        if func in memo:
            return memo[func]
        cat = category(func)
        if cat is not None:
            memo[func] = {cat: 1.0}
            return memo[func]
        memo[func] = {OTHER: 1.0}  # (while it is worked out: a recursive call ends here)
        memo[func] = spread(stats[func][4] if func in stats else {}, 3, func)
        return memo[func]

    def spread(callers: dict, edge_time: int, func) -> dict[str, float]:
        total = sum(edge[edge_time] for edge in callers.values())
        if not total:
            return {OTHER: 1.0}
        out: dict[str, float] = {}
        for caller, edge in callers.items():
            for cat, frac in contexts(caller).items():
                out[cat] = out.get(cat, 0.0) + frac * edge[edge_time] / total
        return out

    seconds: dict[str, float] = {}
    for func, (_cc, _nc, tt, _ct, callers) in stats.items():
        if tt <= 0:
            continue
        cat = category(func)
        shares = {cat: 1.0} if cat is not None else spread(callers, 2, func)  # its own time, per caller
        for cat2, frac in shares.items():
            seconds[cat2] = seconds.get(cat2, 0.0) + tt * frac
    return seconds


#: (label, module path fragment, function name): entry points whose time with everything they call
#: (cProfile's cumulative time, over every resumption of a coroutine) says what drives the
#: categories above: DHT traffic is read and written by the connection layer's own tasks.
INCLUSIVE = [
    ("DHT requests answered (inbound streams)", "/libp2p/kad_dht/kad_dht", "_do_handle_stream"),
    ("DHT queries sent (outbound, one peer each)", "/libp2p/kad_dht/peer_routing", "_query_single_peer_for_closest"),
    ("every inbound stream (handler and negotiation)", "/libp2p/network/connection/swarm_connection",
     "_handle_muxed_stream"),
    ("Yamux frame reader tasks", "/libp2p/stream_muxer/yamux/yamux", "handle_incoming"),
    ("connection writer tasks", "/shardnet/transport/conn_writer", "run"),
]


def inclusive(stats: dict, path: str, name: str) -> float:
    return sum(v[3] for (file, _, fname), v in stats.items() if fname == name and path in file.replace(os.sep, "/"))


def calls(stats: dict, path: str, name: str, caller: str | None = None) -> int:
    """How many times the function ``name`` in a file whose path contains ``path`` ran
    (``caller``: only its calls from a function of that name)."""
    n = 0
    for (file, _, fname), (_cc, nc, _tt, _ct, callers) in stats.items():
        if fname == name and path in file.replace(os.sep, "/"):
            n += sum(edge[1] for c, edge in callers.items() if c[2] == caller) if caller else nc
    return n


@dataclass
class Profile:
    seconds: dict[str, float]  # CPU seconds per category over the window
    rates: dict[str, float]  # per second: RPCs, messages, claims, verifies
    total: float
    inclusive: dict[str, float] = field(default_factory=dict)  # CPU seconds, INCLUSIVE's entry points


def read_profile(path: Path, window: float) -> Profile:
    stats = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
    seconds = attribute(stats)
    rates = {
        "pubsub RPCs read": calls(stats, "/libp2p/pubsub/pubsub", "maybe_consume_signed_record",
                                  "continuously_read_stream"),
        "gossip msgs received": calls(stats, "/libp2p/pubsub/pubsub", "_is_subscribed_to_msg",
                                      "continuously_read_stream"),
        "new claims validated": calls(stats, "/shardnet/inference/client/claims_view", "valid"),
        "ed25519 verifies": calls(stats, "/libp2p/crypto/ed25519", "verify"),
        "  of signed peer records": calls(stats, "/libp2p/crypto/ed25519", "verify", "validate"),
        "  of claims and receipts": calls(stats, "/libp2p/crypto/ed25519", "verify", "open_envelope"),
        "  of pubsub messages": calls(stats, "/libp2p/crypto/ed25519", "verify", "signature_validator"),
        "DHT requests answered": calls(stats, "/libp2p/kad_dht/utils", "maybe_consume_signed_record",
                                       "_do_handle_stream"),
        "DHT queries sent": calls(stats, "/libp2p/kad_dht/utils", "maybe_consume_signed_record",
                                  "_query_peer_for_closest"),
        "socket reads": calls(stats, "~", "<method 'recv' of '_socket.socket' objects>"),
        "socket writes": calls(stats, "~", "<method 'send' of '_socket.socket' objects>"),
    }
    return Profile(seconds, {k: v / window for k, v in rates.items()}, sum(seconds.values()),
                   {label: inclusive(stats, fragment, name) for label, fragment, name in INCLUSIVE})


def spans_for(n: int, layers: int) -> list[tuple[int, int]]:
    """Each peer's span: the layers split into min(n, MAX_SPANS) contiguous blocks, dealt round-robin."""
    blocks = min(n, MAX_SPANS, layers)
    edges = [layers * i // blocks for i in range(blocks + 1)]
    return [(edges[i % blocks], edges[i % blocks + 1]) for i in range(n)]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of all cores so far (/proc/stat)."""
    values = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]  # idle, iowait
    return sum(values) - idle, sum(values)


async def look(bootstrap: str, model_id: str, layers: int) -> int:
    """Live peers a fresh node's ``swarm_report`` lists (a DHT client with a new identity)."""
    cfg = NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"], bootstrap=[bootstrap], dht_mode="client",
                     autonat_client=False)
    async with open_node(cfg) as node:
        await node.wait_bootstrapped(30)
        report = await swarm_report(node, model_id, layers, wait=10.0)
    return len(report["peers"])


def wait_visible(bootstrap: str, ckpt: Checkpoint, n: int, timeout: float) -> tuple[int, float, int]:
    """(peers seen by the last look, or the most any look saw; seconds; looks)."""
    start = time.monotonic()
    best = looks = 0
    while True:
        looks += 1
        seen = trio.run(look, bootstrap, ckpt.model_id, ckpt.num_layers)
        best = max(best, seen)
        if seen >= n or time.monotonic() - start > timeout:
            return (seen if seen >= n else best), time.monotonic() - start, looks
        time.sleep(1.0)


@dataclass
class Size:
    n: int
    visible: int
    visible_s: float
    looks: int
    cpu: list[float]  # per unprofiled peer: cores busy over the window
    rss: list[float]  # MB, every peer
    bootstrap_cpu: float
    machine_cores: float  # busy cores of the whole machine over the window
    load: tuple[float, float]  # 1-minute load average at the window's start and end
    profiled_cpu: float | None = None
    profile: Profile | None = None
    spans: list[tuple[int, int]] = field(default_factory=list)


progress = functools.partial(_progress, bench="idle_swarm")  # a whole run takes tens of minutes


def measure(n: int, args, ckpt: Checkpoint, workdir: Path) -> Size:
    spans = spans_for(n, ckpt.num_layers)
    progress(f"{n} peers: starting a bootstrap and {n} `shardnet join` processes")
    prof_path = workdir / f"peer0-of-{n}.prof" if args.profile else None  # (rewritten at its exit)
    with LocalSwarm(workdir / f"swarm-{n}") as swarm:
        boot = swarm.start_bootstrap()
        peers: list[ShardnetProcess] = []
        for i, (a, b) in enumerate(spans):
            name = f"join{i}"
            env = {PROFILE_ENV: str(prof_path)} if prof_path and i == 0 else None
            p = ShardnetProcess(name, ["join", "--events", "--identity", str(swarm.workdir / f"{name}.key"),
                                       "--listen", "/ip4/127.0.0.1/tcp/0", "--bootstrap", boot,
                                       "--layers", f"{a}:{b}", "--threads", "1", "--throughput", "100"],
                                workdir=swarm.workdir, env=env)
            swarm.procs.append(p)
            peers.append(p)
        for p in peers:
            swarm.wait_ready(p, timeout=args.ready_timeout)
        progress(f"{n} peers: all ready; looking for them from a fresh node")
        visible, visible_s, looks = wait_visible(boot, ckpt, n, args.visible_timeout)
        progress(f"{n} peers: {visible} visible after {visible_s:.1f} s; settling {args.settle:g} s")
        time.sleep(args.settle)
        assert swarm.bootstrap is not None
        pids = [swarm.bootstrap.pid, *(p.pid for p in peers)]
        load0 = os.getloadavg()[0]
        if prof_path:
            os.kill(peers[0].pid, signal.SIGUSR1)  # start afresh: the window only
        before, busy0, t0 = [cpu_seconds(pid) for pid in pids], machine_busy(), time.monotonic()
        progress(f"{n} peers: measuring CPU over {args.window:g} s")
        time.sleep(args.window)
        after, busy1, wall = [cpu_seconds(pid) for pid in pids], machine_busy(), time.monotonic() - t0
        profile = None
        if prof_path:
            os.kill(peers[0].pid, signal.SIGUSR2)  # write the window's profile
        load1 = os.getloadavg()[0]
        rss = [rss_mb(p.pid) for p in peers]
        cores = [(a - b) / wall for a, b in zip(after, before)]
        if prof_path:
            deadline = time.monotonic() + 30
            while not (prof_path.exists() and prof_path.stat().st_mtime > time.time() - wall / 2):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no profile from peer 0 in {prof_path}")
                time.sleep(0.2)
            profile = read_profile(prof_path, wall)
            if args.profile_dir:  # the window's profile, as read
                shutil.copyfile(prof_path, args.profile_dir / prof_path.name)
        dead = [p.name for p in peers if not p.alive()]
        if dead:
            raise RuntimeError(f"peers exited during the run: {dead}")
    machine = (busy1[0] - busy0[0]) / max(1, busy1[1] - busy0[1]) * (os.cpu_count() or 1)
    peer_cores = cores[1:]
    return Size(n, visible, visible_s, looks, peer_cores[1:] if prof_path else peer_cores, rss, cores[0], machine,
                (load0, load1), peer_cores[0] if prof_path else None, profile, spans)


def report(args, sizes: list[Size]) -> None:
    print(f"idle swarms of the shipped tiny-llama on loopback: a bootstrap and N `shardnet join --threads 1 "
          f"--throughput 100` peers (spans of the 8 layers dealt round-robin), nothing requested; "
          f"settle {args.settle:g} s, window {args.window:g} s; {os.cpu_count()} cores")
    base = statistics.mean(sizes[0].cpu) if sizes and sizes[0].cpu else None
    rows = []
    for s in sizes:
        mean = statistics.mean(s.cpu) if s.cpu else 0.0
        rows.append([s.n, f"{s.visible}/{s.n}", f"{s.visible_s:.1f}", s.looks, len(s.cpu), f"{mean * 100:.2f}",
                     f"{max(s.cpu, default=0) * 100:.2f}", ratio(mean, base), f"{s.bootstrap_cpu * 100:.2f}",
                     f"{statistics.mean(s.rss):.0f}", f"{max(s.rss):.0f}", f"{s.machine_cores:.2f}",
                     f"{s.load[0]:.1f}/{s.load[1]:.1f}",
                     f"{s.profiled_cpu * 100:.2f}" if s.profiled_cpu is not None else "-"])
    print_table("per peer: CPU over the window as % of one core; ratio: the mean to the first size's",
                ["peers", "visible", "after s", "looks", "measured", "cpu mean %", "cpu max %", "ratio",
                 "bootstrap %", "rss mean MiB", "rss max MiB", "machine cores", "load 1m", "profiled %"], rows)
    print("visible: live peers a fresh node's swarm_report listed (status' call), after s: seconds from the last "
          "peer's ready until it listed all (or the timeout); measured: peers in the CPU figures (the profiled "
          "one left out); machine cores: the whole machine's busy cores over the window (other work included); "
          "load 1m: at the window's start/end; profiled %: the profiled peer's CPU (cProfile's cost included)")
    profiled = [s for s in sizes if s.profile]
    if not profiled:
        return
    cats = sorted({c for s in profiled for c in s.profile.seconds},
                  key=lambda c: -max(s.profile.seconds.get(c, 0.0) / max(s.profile.total, 1e-9) for s in profiled))
    header = ["category"]
    for s in profiled:
        header += [f"{s.n}: %", f"{s.n}: ms/s"]
    rows = []
    for c in cats:
        row = [c]
        for s in profiled:
            sec = s.profile.seconds.get(c, 0.0)
            row += [f"{sec / max(s.profile.total, 1e-9) * 100:.1f}", f"{sec / args.window * 1e3:.2f}"]
        rows.append(row)
    rows.append(["total", *[x for s in profiled for x in ("100.0", f"{s.profile.total / args.window * 1e3:.2f}")]])
    print_table("where one peer's CPU goes (cProfile, CPU time of its event loop's thread): share of the profile, "
                "and CPU ms per second of the window (cProfile's cost included)", header, rows)
    print_table("what drives them: % of the profile inside these calls, everything they call included (overlapping)",
                ["entry point", *[f"{s.n} peers" for s in profiled]],
                [[label, *[f"{s.profile.inclusive[label] / max(s.profile.total, 1e-9) * 100:.1f}" for s in profiled]]
                 for label, _, _ in INCLUSIVE])
    names = list(profiled[0].profile.rates)
    print_table("messages at the profiled peer, per second (from the profile's call counts)",
                ["per second", *[f"{s.n} peers" for s in profiled]],
                [[k, *[f"{s.profile.rates[k]:.1f}" for s in profiled]] for k in names])


def parse_sizes(text: str) -> list[int]:
    sizes = [int(x) for x in text.split(",") if x.strip()]
    if not sizes or min(sizes) < 1:
        raise ValueError("sizes are peer counts of 1 or more")
    return sizes


def main() -> None:
    p = bench_parser(__doc__, quick="a short run for the tests: 2 and 3 peers, a 5 s window, profiled")
    p.add_argument("--sizes", type=parse_sizes, default=[2, 8, 24], help="swarm sizes (peers), comma-separated")
    p.add_argument("--settle", type=float, default=30.0, help="seconds between visibility and the window")
    p.add_argument("--window", type=float, default=60.0, help="seconds of CPU time measured")
    p.add_argument("--profile", action="store_true", help="profile one peer per size (see the docstring)")
    p.add_argument("--profile-dir", type=Path, default=None,
                   help="keep the profiles here (peer0-of-N.prof, pstats' format) instead of a temporary folder")
    p.add_argument("--visible-timeout", type=float, default=180.0,
                   help="seconds to wait for a fresh node to list every peer")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds for a peer to be ready")
    args = p.parse_args()
    if args.quick:
        args.sizes, args.settle, args.window, args.profile = [2, 3], 2.0, 5.0, True
    ckpt = Checkpoint(default_model_path())
    if args.profile_dir:
        args.profile_dir.mkdir(parents=True, exist_ok=True)
        args.profile_dir = args.profile_dir.resolve()
    with tempfile.TemporaryDirectory(prefix="shardnet-idle-") as d:
        sizes = [measure(n, args, ckpt, Path(d)) for n in args.sizes]
    report(args, sizes)


if __name__ == "__main__":
    main()
