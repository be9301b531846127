"""Decode over an emulated WAN, the headline benchmark: plain vs speculative vs pipelined, one run.

    python -m bench.wan_decode [--peers 4] [--delay-ms 20] [--jitter-ms 1] [--mbit 100] [--tokens 64]
                               [-k 6] [--depth 4] [--ngram-k 8] [--repeats 1] [--temperature 0] [--quick]

A bootstrap, ``--peers`` compute peers (``shardnet join``, separate processes, the shipped
tiny-llama split evenly) and the client each sit behind a WAN emulator (bench/wan_emulator.py):
every node announces its proxy's address, so every connection crosses one emulated edge with the
given one-way delay, jitter and bandwidth cap in each direction. A ring traversal (client ->
peer 1 -> ... -> peer n -> client) crosses n + 1 edges: about 100 ms with 4 peers at 20 ms.

Alternating runs (greedy, the same ``PROMPTS``: eight of three kinds, code, prose and chat)
measure: plain decode; speculative decode with the shipped draft model, the n-gram drafter and
the suffix drafter (one verify chunk at a time); the draft model's trees (its chain and the
likeliest of its second choices beside it, ``ModelDrafter.propose_tree``, one chunk at a time),
of a fixed shape (k + k) and of a shape chosen per tree from the generation's measured
acceptance and trips (``throughput.TreeShaper``, up to 12 + 12: its ceiling computed at its
mean positions per chunk); ``--speculate auto``'s choice between the draft model (its trees'
shape chosen), the suffix drafter and plain decoding, and between the last two alone (auto
model-free) (auto_drafter.py: their ceilings are computed as if every chunk had k + 1
positions); and each drafter with ``--depth`` verify chunks in flight. The figures of a mode
are over all prompts: tok/s is the median over runs of one prompt each. Per mode: tok/s, the ratio to plain, tokens gained per
traversal, the share of drafts accepted, the share of chunks sent that went stale, and the
analytical ceiling (shardnet/inference/client/throughput.py, docs/performance.md) with the share of it
reached. The ceiling is what the mode's own acceptance outcomes would give if a chunk's trip cost
only the WAN (the emulated delays and serialisation at the cap) plus computation measured in
this process (each block, the client's embedding and head, the drafting): the gap to it is the
overhead of the real stack (framing, encryption, multiplexing, scheduling on shared cores).
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import trio  # noqa: E402

from bench._common import bench_parser, median_seconds, print_table, progress, ratio  # noqa: E402
from bench.wan_emulator import Link, WanProxy  # noqa: E402
from shardnet.inference.model.checkpoint import Checkpoint  # noqa: E402
from shardnet.inference.client.client import Client
from shardnet.inference.model.local_model import LocalModel  # noqa: E402
from shardnet.inference.model.layout import split_layers  # noqa: E402
from shardnet.inference.client.speculative import ModelDrafter, NGramDrafter, SpeculationStats  # noqa: E402
from shardnet.inference.client.suffix_drafter import SuffixDrafter  # noqa: E402
from shardnet.inference.client.auto_drafter import PLAIN, AutoDrafter  # noqa: E402
from shardnet.inference.client.throughput import TREE_MAX_K, ceiling, tree_tokens  # noqa: E402
from shardnet.testing.localswarm import ShardnetProcess, free_port, stop_processes  # noqa: E402
from shardnet.models import default_draft_path, default_model_path  # noqa: E402
from shardnet.transport import NodeConfig, open_node  # noqa: E402

#: (kind, prompt): what users bring. The shipped tiny-llama learned code; prose and chat show
#: what the drafters make of text it continues less predictably.
PROMPTS = [
    ("code", "def __init__(self, name):\n        self.name = name\n        self."),
    ("code", "import os\nimport sys\n\ndef main():\n    "),
    ("code", "class Parser:\n    def parse(self, text):\n        "),
    ("code", "    for i in range(len(items)):\n        if "),
    ("prose", "The history of the city begins in the twelfth century, when the first"),
    ("prose", "In this paper we study how a network of small computers can share"),
    ("chat", "User: How do I read a file line by line in Python?\nAssistant:"),
    ("chat", "User: What is the difference between a list and a tuple?\nAssistant:"),
]
#: the SpeculationStats fields that add up over runs
SUMMED = ("chunks", "verified", "stale", "carried", "drafted", "accepted", "tokens", "draft_s", "wait_s",
          "round_trip_s", "trees", "branched", "chain_tried", "chain_kept", "branch_tried", "branch_kept")


@dataclass
class Mode:
    name: str
    drafter: object
    k: int
    depth: int
    tree: bool = False  # trees of drafts: the draft's chain and its second choices beside it
    #: a tree's second choices (with the chain's k: a fixed shape); None: the shape chosen per
    #: tree by throughput.TreeShaper, up to k in the chain and as many beside
    branches: int | None = None
    rates: list[float] = field(default_factory=list)
    stats: list[SpeculationStats] = field(default_factory=list)
    #: (prompt index, the tokens generated) per run
    ids: list[tuple[int, list[int]]] = field(default_factory=list)
    #: a shape chosen per tree: the shaper's estimates after each run (TreeShaper.estimates)
    estimates: list[dict] = field(default_factory=list)

    def total(self, attr: str) -> float:
        return sum(getattr(s, attr) for s in self.stats)

    def summed(self) -> SpeculationStats:
        """The runs' counts and times added up (the numeric fields only, named: a field of
        another kind, such as a callback, is not summed)."""
        return SpeculationStats(**{f: self.total(f) for f in SUMMED})

    @property
    def positions(self) -> int:
        """Positions a chunk carries at most: the last token and the drafts (a shape chosen per
        tree: on average, once run)."""
        if self.tree and self.branches is None and self.total("verified"):
            return round(1 + self.total("drafted") / self.total("verified"))
        return self.k + (self.branches or 0) + 1 if self.tree else self.k + 1

    @property
    def ring(self) -> float:
        """Mean send-to-result time of a verify chunk."""
        return self.total("round_trip_s") / self.total("verified")


async def run(args: argparse.Namespace, workdir: Path) -> None:
    link = Link(delay=args.delay_ms / 1e3, jitter=args.jitter_ms / 1e3, rate=args.mbit * 1e6 / 8)
    ckpt = Checkpoint(default_model_path())
    ranges = split_layers(ckpt.num_layers, args.peers)
    procs: list[ShardnetProcess] = []
    threads = max(1, (os.cpu_count() or 1) // (args.peers + 1))  # the peers and the client share the cores
    torch.set_num_threads(threads)
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
                    "--layers", f"{a}:{b}", "--threads", str(threads), "--dtype", args.dtype, "--listen", f"/ip4/127.0.0.1/tcp/{real}",
                    "--announce",
                    f"/ip4/127.0.0.1/tcp/{pub}", "--bootstrap", boot_addr], workdir=workdir))
            for p in procs[1:]:
                await trio.to_thread.run_sync(p.wait_event, lambda e: e.get("event") == "ready", 120)
            real, pub = await behind_wan(99)
            model = LocalModel(default_model_path(), dtype=args.dtype)
            draft = ModelDrafter(default_draft_path(), vocab_size=ckpt.config.vocab_size)
            ngram = NGramDrafter()
            auto_trees = "shape chosen" if args.temperature == 0 else "k+k"  # (sampling: a fixed shape)
            modes = [Mode("plain decode", None, 0, 1),
                     Mode(f"speculative, draft model, k={args.k}", draft, args.k, 1),
                     Mode(f"speculative, draft tree, k={args.k}+{args.k}", draft, args.k, 1, tree=True,
                          branches=args.k),
                     Mode(f"speculative, draft tree, shape chosen (k<={TREE_MAX_K})", draft, TREE_MAX_K, 1,
                          tree=True),
                     Mode(f"speculative, n-gram, k={args.ngram_k}", ngram, args.ngram_k, 1),
                     Mode(f"speculative, suffix, k={args.ngram_k}", SuffixDrafter, args.ngram_k, 1),
                     Mode(f"speculative, auto, k={args.k} (trees: {auto_trees})", lambda: AutoDrafter(
                         {"draft": draft, "suffix": SuffixDrafter(), PLAIN: None}), args.k, 1, tree=True),
                     Mode(f"speculative, auto model-free, k={args.ngram_k}", lambda: AutoDrafter(
                         {"suffix": SuffixDrafter(), PLAIN: None}), args.ngram_k, 1),
                     Mode(f"pipelined, draft model, k={args.k}, depth {args.depth}", draft, args.k, args.depth),
                     Mode(f"pipelined, n-gram, k={args.ngram_k}, depth {args.depth}", ngram, args.ngram_k,
                          args.depth),
                     Mode(f"pipelined, suffix, k={args.ngram_k}, depth {args.depth}", SuffixDrafter, args.ngram_k,
                          args.depth)]
            prompts = PROMPTS[:args.prompts]
            if args.temperature > 0:  # (sampling keeps a fixed tree shape, so that a seed fixes the output)
                modes = [m for m in modes if not (m.tree and m.branches is None and m.drafter is draft)]
            sampling = {"temperature": args.temperature}

            def drafter_for(m: Mode):
                # a suffix drafter (and auto's choices) per generation; the draft model's cache follows the text
                factory = isinstance(m.drafter, type) or (callable(m.drafter) and not hasattr(m.drafter, "propose"))
                return m.drafter() if factory else m.drafter

            cfg = NodeConfig(listen=[f"/ip4/127.0.0.1/tcp/{real}"], announce=[f"/ip4/127.0.0.1/tcp/{pub}"],
                             bootstrap=[boot_addr], dht_mode="client", low_watermark=0)
            async with open_node(cfg) as node:
                await node.wait_bootstrapped(60)
                client = Client(node, model, route_timeout=60, audit_rate=0)  # decode alone
                route = await client.planner.find_route()
                ping = await node.ping(route[0].peer)  # shows the emulated edge: ~2 x delay
                for m in modes:  # warm-up: connections along the ring, lazy initialisation
                    [t async for t in client.generate(prompts[0][1], max_new_tokens=8, stop_at_eos=False,
                                                      drafter=drafter_for(m), k=m.k, depth=m.depth,
                                                      tree=m.tree, branches=m.branches, seed=0, **sampling)]
                for r in range(args.repeats):
                    for i, (kind, prompt) in enumerate(prompts):
                        progress(f"run {r + 1}/{args.repeats}, prompt {i + 1}/{len(prompts)} ({kind})",
                                 bench="wan_decode")
                        for m in modes:
                            m.ids.append((i, [t.id async for t in client.generate(
                                prompt, max_new_tokens=args.tokens, stop_at_eos=False, drafter=drafter_for(m), k=m.k,
                                depth=m.depth, tree=m.tree, branches=m.branches, seed=1000 * r + i, **sampling)]))
                            st = client.last_stats
                            m.rates.append(st.tokens_per_s)
                            m.stats.append(st.speculation)
                            if m.tree and m.branches is None and st.speculation.trees:  # (this run's shaper)
                                m.estimates.append(client.tree_shaper.estimates())
        finally:
            stop_processes(procs)
            nursery.cancel_scope.cancel()
    reps = 3 if args.quick else 30
    compute = {n: measure_compute(ckpt, ranges, model, n, reps=reps, dtype=args.dtype)
               for n in {m.positions for m in modes}}
    report(args, ranges, ping, modes, compute, ckpt.config.hidden_size)


def measure_compute(ckpt: Checkpoint, ranges, model: LocalModel, positions: int, context: int = 64,
                    reps: int = 30, dtype: str = "auto") -> tuple[float, float]:
    """Seconds of computation per chunk of ``positions`` tokens at ``context`` tokens of history,
    measured here one block at a time: (summed over the chain's blocks, at the client: embedding
    and head)."""
    from shardnet.inference.model.block import Block, resolve_dtype

    def timed(fn) -> float:
        return median_seconds(fn, reps)

    hidden = ckpt.config.hidden_size
    x = torch.randn(1, positions, hidden)
    chain = 0.0
    with torch.inference_mode():
        for a, b in ranges:
            block = Block(ckpt, a, b, dtype=resolve_dtype(dtype, ckpt))  # as the peers compute
            cache = block.new_cache()
            block.forward(torch.randn(1, context, hidden), cache, 0)

            def step() -> None:
                block.forward(x, cache, context)
                cache.crop(-positions)

            chain += timed(step)
        ids = torch.randint(0, ckpt.config.vocab_size, (1, positions))
        client = timed(lambda: model.head.logits(model.head.embed(ids)))
    return chain, client


def report(args: argparse.Namespace, ranges, ping: float, modes: list[Mode], compute: dict,
           hidden_size: int) -> None:
    plain = statistics.median(modes[0].rates)
    edges = len(ranges) + 1
    hidden_bytes = 4 * hidden_size  # float32 on the wire

    def latency(positions: int) -> float:
        """The ring's physics: every edge's mean one-way delay and serialisation at the cap."""
        return edges * (args.delay_ms / 1e3 + args.jitter_ms / 2e3 + positions * hidden_bytes / (args.mbit * 1e6 / 8))

    print(f"WAN edge: {args.delay_ms:g} ms one way (+ up to {args.jitter_ms:g} ms jitter), {args.mbit:g} Mbit/s cap; "
          f"client -> first peer ping {ping * 1e3:.1f} ms")
    print(f"tiny-llama ({args.dtype}) over {len(ranges)} peers {ranges}; a traversal crosses {edges} edges: "
          f"{latency(1) * 1e3:.1f} ms of WAN, {modes[0].ring * 1e3:.1f} ms measured for plain decode")
    rows = []
    for m in modes:
        rate = statistics.median(m.rates)
        total = m.summed()
        chain, client = compute[m.positions]
        draft = total.draft_s / total.chunks
        ring = latency(m.positions) + chain + client  # from deciding on a chunk to having its result
        top = ceiling(total, m.depth, ring, draft, service=draft + client)
        acc = f"{total.acceptance:.0%}" if total.drafted else "-"
        rows.append([m.name, f"{rate:.2f}", ratio(rate, plain), f"{total.tokens_per_traversal:.2f}", acc,
                     f"{total.stale / max(1, total.chunks):.0%}", f"{top:.2f}", f"{rate / top:.0%}"])
    kinds = sorted({kind for kind, _ in PROMPTS[:args.prompts]})
    how = "greedy" if args.temperature == 0 else f"sampled (temperature {args.temperature:g}, seeded per prompt)"
    print_table(f"{args.tokens} {how} tokens x {args.prompts} prompts ({', '.join(kinds)}) x {args.repeats} runs "
                "per mode, alternating; tok/s: median over runs",
                ["mode", "tok/s", "x plain", "tok/trav", "accepted", "stale", "ceiling", "reached"], rows)
    if args.temperature == 0:
        plain_ids = dict(modes[0].ids)
        same = all(ids == plain_ids[i] for m in modes for i, ids in m.ids)
        print(f"greedy output identical in every mode and run: {same}")
    else:  # (a seed's text depends on which drafts were sent: each mode's is its own sample)
        print("sampled output not compared across modes (lossless: each mode's text is a sample of the same "
              "distribution, chi-square tested)")
    for m in modes:
        total = m.summed()
        if total.trees:  # the tree law (throughput.tree_tokens) over the trees' measured alpha and beta
            alpha, beta = total.tree_rates
            shapes = sum((s.shapes for s in m.stats), Counter()).most_common(3)
            law = (f"the tree law predicts {tree_tokens(alpha, beta, m.k, m.branches):.2f} tokens per traversal"
                   if m.branches is not None else
                   f"shapes chosen per tree, {total.drafted / total.verified:.1f} drafts per traversal on average, "
                   "most often " + ", ".join(f"{k}+{b} ({n}x)" for (k, b), n in shapes))
            print(f"{m.name}: {total.trees} trees, alpha {alpha:.2f}, beta {beta:.2f}: {law} (measured over trees "
                  f"and other chunks: {total.tokens_per_traversal:.2f} tokens); {total.branched} kept a branch")
            if m.estimates:
                med = {key: statistics.median(e[key] for e in m.estimates) for key in m.estimates[0]}
                print(f"  its shaper's estimates after each run, medians: trip {med['latency'] * 1e3:.1f} ms + "
                      f"{med['per_position'] * 1e3:.2f} ms a position (the client's own work on a step included), "
                      f"drafting {med['draft'] * 1e3:.2f} ms a token, alpha {med['alpha']:.2f}, beta {med['beta']:.2f}")
    print("ceiling: shardnet/inference/client/throughput.py over each mode's own acceptance outcomes, with the WAN")
    print("delays above plus compute measured in this process per chunk: " + ", ".join(
        f"{n} position{'s' if n > 1 else ''} {c[0] * 1e3:.1f} ms chain + {c[1] * 1e3:.1f} ms client"
        for n, c in sorted(compute.items())) + "; drafting per chunk: " + ", ".join(
        f"{m.name.split(', ')[1]} {m.total('draft_s') / m.total('chunks') * 1e3:.2f} ms"
        for m in modes if m.name.startswith("speculative")))


def main() -> None:
    p = bench_parser(__doc__,
                     quick="a short run for the tests: 2 peers, 5 ms edges, 8 tokens, 1 run, k=2, depth 2, "
                           "compute timed 3 times")
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--delay-ms", type=float, default=20.0)
    p.add_argument("--jitter-ms", type=float, default=1.0)
    p.add_argument("--mbit", type=float, default=100.0)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--prompts", type=int, choices=range(1, len(PROMPTS) + 1), default=len(PROMPTS), metavar="N",
                   help=f"how many of the {len(PROMPTS)} prompts (1-{len(PROMPTS)})")
    p.add_argument("-k", type=int, default=6, help="drafts per chunk for the draft model")
    p.add_argument("--dtype", default="float32", choices=["auto", "float32", "float16", "bfloat16"],
                   help="the peers' and the client's compute dtype (auto: the checkpoint's, float16 for the "
                        "shipped model; greedy output is compared exactly in float32 only: in float16 two "
                        "exact computations in different orders may pick different tokens at a near-tie)")
    p.add_argument("--ngram-k", type=int, default=8, help="drafts per chunk for the n-gram drafter")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample at this temperature (0: greedy); each prompt's seed is the same in every mode, "
                        "trees keep a fixed shape (the shape-chosen row is left out)")
    p.add_argument("--depth", type=int, default=4, help="verify chunks in flight for the pipelined rows")
    args = p.parse_args()
    if args.quick:
        args.peers, args.delay_ms, args.tokens, args.repeats, args.prompts = 2, 5.0, 8, 1, 2
        args.k, args.ngram_k, args.depth = 2, 2, 2
    logging.disable(logging.CRITICAL)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="shardnet-wan-") as d:
        trio.run(run, args, Path(d))


if __name__ == "__main__":
    main()
