"""Decode over an emulated WAN: plain pipeline vs speculative decoding, in one run.

    python bench/wan_decode.py [--delay-ms 25] [--jitter-ms 2] [--mbit 100] [--tokens 48] [-k 4]

A bootstrap, 3 compute peers (``shardnet join``, separate processes, the shipped tiny-llama split
0:3, 3:5, 5:8) and the client each sit behind a WAN emulator (bench/wan_emulator.py): every
peer announces its proxy's address, so every connection crosses one emulated edge with the given
one-way delay, jitter and bandwidth cap in each direction. Alternating runs measure greedy decode
without speculation, with it (the shipped draft proposes k tokens; one traversal verifies them),
and with --depth verify chunks in flight.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import statistics
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import trio  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.wan_emulator import Link, WanProxy  # noqa: E402
from shardnet.inference.checkpoint import Checkpoint  # noqa: E402
from shardnet.inference.client import Client, LocalModel  # noqa: E402
from shardnet.inference.layout import split_layers  # noqa: E402
from shardnet.inference.speculative import ModelDrafter  # noqa: E402
from shardnet.localswarm import ShardnetProcess  # noqa: E402
from shardnet.models import default_draft_path, default_model_path  # noqa: E402
from shardnet.transport import NodeConfig, open_node  # noqa: E402

PROMPT = "def __init__(self, name):\n        self.name = name\n        self."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def run(args: argparse.Namespace, workdir: Path) -> None:
    link = Link(delay=args.delay_ms / 1e3, jitter=args.jitter_ms / 1e3, rate=args.mbit * 1e6 / 8)
    ckpt = Checkpoint(default_model_path())
    ranges = split_layers(ckpt.num_layers, 3)
    procs: list[ShardnetProcess] = []
    async with trio.open_nursery() as nursery:
        async def behind_wan(seed: int) -> tuple[int, int]:
            real, pub = free_port(), free_port()
            await nursery.start(WanProxy(("127.0.0.1", real), link, seed=seed, port=pub).serve)
            return real, pub

        try:
            real, pub = await behind_wan(0)
            boot = ShardnetProcess("boot", ["bootstrap", "--identity", str(workdir / "boot.key"), "--listen",
                                            f"/ip4/127.0.0.1/tcp/{real}", "--announce", f"/ip4/127.0.0.1/tcp/{pub}"],
                                   workdir=workdir)
            procs.append(boot)
            boot_addr = boot.wait_for_line(lambda s: "/p2p/" in s, 60).strip()
            for i, (a, b) in enumerate(ranges):
                real, pub = await behind_wan(i + 1)
                procs.append(ShardnetProcess(f"p{i}", [
                    "join", "--events", "--identity", str(workdir / f"p{i}.key"), "--model", str(default_model_path()),
                    "--layers", f"{a}:{b}", "--listen", f"/ip4/127.0.0.1/tcp/{real}", "--announce",
                    f"/ip4/127.0.0.1/tcp/{pub}", "--bootstrap", boot_addr], workdir=workdir))
            for p in procs[1:]:
                await trio.to_thread.run_sync(p.wait_event, lambda e: e.get("event") == "ready", 120)
            real, pub = await behind_wan(9)
            model = LocalModel(default_model_path())
            drafter = ModelDrafter(default_draft_path(), vocab_size=ckpt.config.vocab_size)
            cfg = NodeConfig(listen=[f"/ip4/127.0.0.1/tcp/{real}"], announce=[f"/ip4/127.0.0.1/tcp/{pub}"],
                             bootstrap=[boot_addr], dht_mode="client", low_watermark=0)
            async with open_node(cfg) as node:
                await node.wait_bootstrapped(60)
                client = Client(node, model, route_timeout=60)
                route = await client.find_route()
                ping = await node.ping(route[0].peer)  # shows the emulated edge: ~2 x delay
                plain, spec, piped, same, sp = [], [], [], True, None
                want = None
                for _ in range(args.repeats):
                    got = [t.id async for t in client.generate(PROMPT, max_new_tokens=args.tokens, stop_at_eos=False)]
                    plain.append(client.last_stats.tokens_per_s)
                    got_s = [t.id async for t in client.generate(PROMPT, max_new_tokens=args.tokens, stop_at_eos=False,
                                                                  drafter=drafter, k=args.k)]
                    spec.append(client.last_stats.tokens_per_s)
                    sp = client.last_stats.speculation
                    got_p = [t.id async for t in client.generate(PROMPT, max_new_tokens=args.tokens, stop_at_eos=False,
                                                                  drafter=drafter, k=args.k, depth=args.depth)]
                    piped.append(client.last_stats.tokens_per_s)
                    want = want or got
                    same = same and got == want and got_s == want and got_p == want
        finally:
            for p in procs:
                p.stop()
            nursery.cancel_scope.cancel()
    tp, ts, tq = statistics.median(plain), statistics.median(spec), statistics.median(piped)
    print(f"WAN edge: {args.delay_ms:g} ms one way (+ up to {args.jitter_ms:g} ms jitter), {args.mbit:g} Mbit/s cap; "
          f"client -> first peer ping {ping * 1e3:.1f} ms")
    print(f"tiny-llama over 3 peers {ranges}, {args.tokens} greedy tokens x {args.repeats} runs, medians")
    print(f"plain pipeline decode:       {tp:6.2f} tok/s")
    print(f"speculative (draft, k={args.k}):   {ts:6.2f} tok/s   {ts / tp:.2f}x plain; "
          f"{sp.tokens_per_traversal:.2f} tokens per traversal, {sp.acceptance:.0%} of drafts accepted")
    print(f"speculative, {args.depth} chunks in flight: {tq:6.2f} tok/s   {tq / tp:.2f}x plain")
    print(f"greedy output identical in all three: {same}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--delay-ms", type=float, default=25.0)
    p.add_argument("--jitter-ms", type=float, default=2.0)
    p.add_argument("--mbit", type=float, default=100.0)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("-k", type=int, default=4)
    p.add_argument("--depth", type=int, default=2, help="verify chunks in flight for the pipelined row")
    args = p.parse_args()
    logging.disable(logging.CRITICAL)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="shardnet-wan-") as d:
        trio.run(run, args, Path(d))


if __name__ == "__main__":
    main()
