"""Latency-aware routing and mid-request healing, measured side by side in one run.

    python -m bench.swarm_routing [--delay-ms 15] [--tokens 32] [--repeats 3] [--quick]

Routing: the shipped tiny-llama served twice over (layers 0:4 and 4:8 each by two peers, all
separate ``shardnet join`` processes); one chain's peers sit behind a WAN emulator
(bench/wan_emulator.py) adding ``--delay-ms`` each way. Alternating runs decode ``--tokens``
tokens greedily through the route the client chooses (it measures round trips) and through the
slow chain forced; the ratio is what latency-aware routing buys over a choice blind to latency
(which would pick the slow first hop half the time).

Healing: with a spare peer for each span, each repeat decodes once uninterrupted and once
while the chain's first peer is killed (SIGKILL) after 8 tokens; a fresh peer then takes its
place for the next repeat.
Reported: the heal time (failure seen to generation going on) and the extra time of the whole
request over the uninterrupted one.
"""

from __future__ import annotations

import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import trio

from bench._common import bench_parser, ratio  # noqa: E402
from bench.wan_emulator import Link, WanProxy  # noqa: E402
from shardnet.inference.claims import find_claims  # noqa: E402
from shardnet.inference.client.client import Client
from shardnet.inference.model.local_model import LocalModel  # noqa: E402
from shardnet.testing.localswarm import ShardnetProcess, free_port, stop_processes  # noqa: E402
from shardnet.models import default_model_path  # noqa: E402
from shardnet.transport import NodeConfig, open_node  # noqa: E402

PROMPT = "def __init__(self, name):\n        self.name = name\n        self."


def spawn(tmp: Path, name: str, boot: str, layers: str, proxy_port: int | None = None,
          real_port: int | None = None) -> ShardnetProcess:
    listen = f"/ip4/127.0.0.1/tcp/{real_port or 0}"
    extra = ["--announce", f"/ip4/127.0.0.1/tcp/{proxy_port}"] if proxy_port else []
    return ShardnetProcess(name, ["join", "--events", "--identity", str(tmp / f"{name}.key"), "--listen", listen,
                                  *extra, "--bootstrap", boot, "--layers", layers, "--threads", "1",
                                  "--rebalance-interval", "2"], workdir=tmp)


async def ready(p: ShardnetProcess) -> str:
    """Its peer ID once it serves, waited for in a thread: the WAN proxies run in this trio loop and
    must go on forwarding meanwhile (a slow peer's start-up dials cross them)."""
    ev = await trio.to_thread.run_sync(p.wait_event, lambda e: e.get("event") == "ready", 120)
    return ev["peer_id"]


async def decode(client: Client, tokens: int, route=None, progress=None) -> tuple[float, list[int]]:
    client.planner.fixed_route = route
    t0 = time.perf_counter()
    ids = [t.id async for t in client.generate(PROMPT, max_new_tokens=tokens, stop_at_eos=False,
                                                  progress=progress)]
    return time.perf_counter() - t0, ids


async def main_async(args) -> None:
    delay = args.delay_ms / 1000
    procs: list[ShardnetProcess] = []
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        try:
            boot = ShardnetProcess("boot", ["bootstrap", "--identity", str(tmp / "boot.key"),
                                            "--listen", "/ip4/127.0.0.1/tcp/0"], workdir=tmp)
            procs.append(boot)
            boot_addr = boot.wait_for_line(lambda s: s.strip().startswith("/ip4/"), 60).strip()
            async with trio.open_nursery() as nursery:
                peers: dict[str, tuple[ShardnetProcess, str]] = {}  # name -> (process, peer id)
                for name, layers, slow in (("fast0", "0:4", False), ("fast1", "4:8", False),
                                           ("slow0", "0:4", True), ("slow1", "4:8", True)):
                    real = pub = None
                    if slow:
                        real, pub = free_port(), free_port()
                        await nursery.start(WanProxy(("127.0.0.1", real), Link(delay=delay), port=pub).serve)
                    p = spawn(tmp, name, boot_addr, layers, pub, real)
                    procs.append(p)
                    peers[name] = (p, "")
                for name, (p, _) in list(peers.items()):
                    peers[name] = (p, await ready(p))
                names = {pid: name for name, (_, pid) in peers.items()}
                cfg = NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"], bootstrap=[boot_addr], dht_mode="client",
                                 low_watermark=0)
                async with open_node(cfg) as node:
                    await node.wait_bootstrapped()
                    client = Client(node, LocalModel(default_model_path()), audit_rate=0)  # routing alone
                    model_id, num_layers = client.model.model_id, client.model.ckpt.num_layers
                    with trio.fail_after(60):
                        while len(claims := await find_claims(node, model_id, num_layers=num_layers)) < 4:
                            await trio.sleep(0.5)
                    by_peer = {c.peer: c for c in claims}
                    slow_route = [by_peer[peers["slow0"][1]], by_peer[peers["slow1"][1]]]
                    await decode(client, 4)  # warm-up
                    times = {"chosen": [], "slow": []}
                    chosen_names = set()
                    for _ in range(args.repeats):
                        t, _ = await decode(client, args.tokens)
                        times["chosen"].append(t)
                        chosen_names.add(" -> ".join(names[c.peer] for c in client.last_stats.chain))
                        t, _ = await decode(client, args.tokens, route=slow_route)
                        times["slow"].append(t)
                    med = {k: args.tokens / statistics.median(v) for k, v in times.items()}
                    print(f"routing: chosen chain(s) {sorted(chosen_names)}: {med['chosen']:.1f} tok/s; "
                          f"slow chain ({args.delay_ms:g} ms each way per slow peer): {med['slow']:.1f} tok/s; "
                          f"ratio {ratio(med['chosen'], med['slow'])}", flush=True)

                    heals, extra = [], []
                    for i in range(args.repeats):
                        t_plain, want = await decode(client, args.tokens)
                        route: list[str] = []
                        got_n = [0]

                        def progress(event, info):
                            if event == "route":
                                route[:] = [c[0] for c in info["chain"]]
                            elif event == "sent" and got_n[0] == 0 and info["step"] >= 8 and route:
                                victim = names[route[0]]
                                p, _ = peers[victim]
                                os.kill(p.pid, signal.SIGKILL)
                                got_n[0] = 1

                        t_heal, got = await decode(client, args.tokens, progress=progress)
                        assert got == want, "healed output differs"
                        h = client.last_stats.heals
                        assert h, "no heal happened"
                        heals.append(h[-1].seconds)
                        extra.append(t_heal - t_plain)
                        print(f"  heal {i + 1}: {names[h[-1].failed[0]]} {h[-1].layers} failed during "
                              f"{h[-1].phase}; healed in {h[-1].seconds * 1000:.0f} ms, request "
                              f"{t_heal:.2f} s vs {t_plain:.2f} s uninterrupted", flush=True)
                        # a fresh spare (new identity) takes the killed peer's place for the next round
                        # (the killed one stays avoided: clients' dial caches remember it failing)
                        victim = names[h[-1].failed[0]]
                        peers.pop(victim)[0].stop()
                        if i + 1 == args.repeats:
                            continue  # no next round to serve
                        layers = "0:4" if victim.startswith(("fast0", "slow0")) else "4:8"
                        real = pub = None
                        if victim.startswith("slow"):
                            real, pub = free_port(), free_port()
                            await nursery.start(WanProxy(("127.0.0.1", real), Link(delay=delay), port=pub).serve)
                        fresh = f"{victim.split('-')[0]}-{i + 1}"
                        p = spawn(tmp, fresh, boot_addr, layers, pub, real)
                        procs.append(p)
                        pid = await ready(p)
                        peers[fresh], names[pid] = (p, pid), fresh
                        with trio.fail_after(60):  # once its claim is found
                            while pid not in {c.peer for c in await find_claims(node, model_id,
                                                                                num_layers=num_layers)}:
                                await trio.sleep(0.5)
                    print(f"healing: median heal {statistics.median(heals) * 1000:.0f} ms; a request with one "
                          f"failure takes {statistics.median(extra):+.2f} s over an uninterrupted one "
                          f"({args.tokens} tokens)", flush=True)
                nursery.cancel_scope.cancel()
        finally:
            stop_processes(procs)


def main() -> int:
    ap = bench_parser(__doc__, quick="a short run for the tests: 12 tokens (the kill comes after 8), 1 repeat")
    ap.add_argument("--delay-ms", type=float, default=15.0)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.quick:
        args.tokens, args.repeats = 12, 1
    trio.run(main_async, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
