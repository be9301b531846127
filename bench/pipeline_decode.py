"""Greedy decode through a chain of peers vs the same model in one process, in one run.

    python -m bench.pipeline_decode [--model PATH] [--peers 3] [--tokens 64] [--repeats 3] [--quick]

Starts a bootstrap node and --peers compute peers (``shardnet join``, separate processes on
loopback, each serving a contiguous block), then measures, alternating so load drift hits both:

- in one process: transformers' ``AutoModelForCausalLM`` greedy decode with its KV cache;
- through the chain: ``Client.generate`` (greedy), from this process;
- through the chain with speculative decoding (the shipped draft proposes k tokens, one traversal
  verifies them).

Prints decode tokens/s for each (prefill excluded), the ratio, and the per-hop overhead:
(chain time per token - local time per token) / (peers + 1), the number of network hops a token
crosses (client -> first peer -> ... -> last peer -> client).

And what a token costs in CPU over the plain chain runs: each peer process's CPU time
(/proc/PID/stat) and this process's (``time.process_time``, every thread) per decoded token
(less what a 1-token run costs: the session's opening, the prefill, the first token), against
the computation alone, measured here after the runs (each peer's block forward for one position
at the run's context; the client's embedding and head): the rest is each hop's overhead
(framing, encryption, scheduling, (de)serialization, receipts).
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as shardnet.inference sets it; before torch loads

import torch  # noqa: E402
import trio

from bench._common import bench_parser, cpu_seconds, median_seconds, print_table, ratio  # noqa: E402
from shardnet.inference.model.checkpoint import Checkpoint  # noqa: E402
from shardnet.inference.client.client import Client
from shardnet.inference.model.local_model import LocalModel  # noqa: E402
from shardnet.inference.model.layout import split_layers  # noqa: E402
from shardnet.inference.client.speculative import ModelDrafter  # noqa: E402
from shardnet.testing.localswarm import LocalSwarm  # noqa: E402
from shardnet.models import default_draft_path, default_model_path  # noqa: E402
from shardnet.transport import NodeConfig, open_node  # noqa: E402

PROMPT = "def __init__(self"


def local_decode(model, ids: list[int], tokens: int) -> tuple[float, list[int]]:
    """Seconds per decoded token (prefill excluded) and the tokens, transformers in one process."""
    with torch.inference_mode():
        out = model(torch.tensor([ids]), use_cache=True)
        cache, nxt = out.cache, int(out.logits[0, -1].argmax())
        got = [nxt]
        t0 = time.perf_counter()
        for _ in range(tokens - 1):
            out = model(torch.tensor([[nxt]]), cache=cache, use_cache=True)
            cache, nxt = out.cache, int(out.logits[0, -1].argmax())
            got.append(nxt)
        return (time.perf_counter() - t0) / (tokens - 1), got


async def chain_decode(client: Client, ids: list[int], tokens: int, **kw) -> tuple[float, list[int]]:
    got = [t.id async for t in client.generate(ids, max_new_tokens=tokens, stop_at_eos=False, **kw)]
    st = client.last_stats
    return st.decode_s / max(st.new_tokens - 1, 1), got


def main() -> None:
    p = bench_parser(__doc__, quick="a short run for the tests: 2 peers, 8 tokens, 1 run")
    p.add_argument("--model", type=Path, default=default_model_path())
    p.add_argument("--peers", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--draft", type=Path, default=default_draft_path(),
                   help="draft model for the speculative row (greedy, k drafted tokens per traversal)")
    p.add_argument("-k", type=int, default=4)
    args = p.parse_args()
    if args.quick:
        args.peers, args.tokens, args.repeats = 2, 8, 1
    logging.basicConfig(level=logging.ERROR)
    logging.disable(logging.CRITICAL)
    torch.set_num_threads(1)  # each peer process is single-threaded too: a like-for-like compute budget

    from transformers import AutoModelForCausalLM

    ckpt = Checkpoint(args.model)
    ranges = split_layers(ckpt.num_layers, args.peers)
    ref = AutoModelForCausalLM.from_pretrained(args.model).eval()  # its own dtype, as the peers (--dtype auto)
    model = LocalModel(args.model)
    ids = model.encode(PROMPT)

    with LocalSwarm() as swarm:
        boot = swarm.start_bootstrap()
        swarm.join_spans(ranges, "--model", str(args.model))

        drafter = ModelDrafter(args.draft, vocab_size=ckpt.config.vocab_size)

        peer_pids = [p.pid for p in swarm.procs[1:]]
        cpu = {"peers": [0.0] * len(peer_pids), "client": 0.0, "tokens": 0}

        async def run() -> tuple[list[float], list[float], list[float], bool, object]:
            local, chain, spec, same, sp = [], [], [], True, None
            async with open_node(NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"], bootstrap=[boot],
                                            dht_mode="client")) as node:
                await node.wait_bootstrapped(30)
                client = Client(node, model, audit_rate=0)  # decode alone (see honest_compute.py)
                await chain_decode(client, ids, 4)  # warm-up: route, connections
                # what a run costs besides its decoded tokens (the session's opening, the prefill,
                # the first token), taken out of the per-token CPU figures below
                before, c0 = [cpu_seconds(pid) for pid in peer_pids], time.process_time()
                await chain_decode(client, ids, 1)
                cpu["fixed_client"] = time.process_time() - c0
                cpu["fixed_peers"] = [cpu_seconds(pid) - b for pid, b in zip(peer_pids, before)]
                for _ in range(args.repeats):
                    t_local, want = local_decode(ref, ids, args.tokens)
                    before, c0 = [cpu_seconds(pid) for pid in peer_pids], time.process_time()
                    t_chain, got = await chain_decode(client, ids, args.tokens)
                    cpu["client"] += time.process_time() - c0 - cpu["fixed_client"]
                    cpu["peers"] = [t + cpu_seconds(pid) - b - f for t, pid, b, f
                                    in zip(cpu["peers"], peer_pids, before, cpu["fixed_peers"])]
                    cpu["tokens"] += args.tokens - 1
                    t_spec, got_spec = await chain_decode(client, ids, args.tokens, drafter=drafter, k=args.k)
                    sp = client.last_stats.speculation
                    local.append(t_local)
                    chain.append(t_chain)
                    spec.append(t_spec)
                    same = same and got == want and got_spec == want
            return local, chain, spec, same, sp

        local, chain, spec, same, sp = trio.run(run)

    t_local, t_chain, t_spec = statistics.median(local), statistics.median(chain), statistics.median(spec)
    hops = args.peers + 1
    print_table(f"model {args.model.name}: {ckpt.num_layers} layers over {args.peers} peers {ranges}; "
                f"{args.tokens} tokens x {args.repeats} runs, greedy, medians",
                ["", "one process", "chain", "ratio", ""],
                [["decode (tok/s)", f"{1 / t_local:.1f}", f"{1 / t_chain:.1f}", f"{t_local / t_chain:.3f}",
                  "(chain/local)"],
                 ["time per token (ms)", f"{t_local * 1e3:.2f}", f"{t_chain * 1e3:.2f}"]], notes=True)
    print(f"per-hop overhead: {(t_chain - t_local) / hops * 1e3:.2f} ms over {hops} network hops per token")
    print(f"speculative through the chain (draft {args.draft.name}, k={args.k}): {1 / t_spec:.1f} tok/s, "
          f"{ratio(t_chain, t_spec)} plain chain decode; {sp.tokens_per_traversal:.2f} tokens per traversal, "
          f"{sp.acceptance:.0%} of drafts accepted")
    print(f"greedy tokens identical to transformers (plain and speculative): {same}")
    report_cpu(cpu, compute_per_token(ckpt, ranges, model, len(ids) + args.tokens // 2))


def compute_per_token(ckpt: Checkpoint, ranges, model: LocalModel, context: int, reps: int = 50):
    """Seconds of computation for one decoded token: per block (one position at ``context``
    positions of history), and the client's embedding and head; medians."""
    from shardnet.inference.model.block import Block, resolve_dtype

    def timed(fn) -> float:
        return median_seconds(fn, reps)

    hidden = ckpt.config.hidden_size
    blocks = []
    with torch.inference_mode():
        for a, b in ranges:
            block = Block(ckpt, a, b, dtype=resolve_dtype("auto", ckpt))
            cache = block.new_cache()
            block.forward(torch.randn(1, context, hidden), cache, 0)
            x = torch.randn(1, 1, hidden)

            def step(block=block, cache=cache, x=x) -> None:
                block.forward(x, cache, context)
                cache.crop(-1)

            blocks.append(timed(step))
        ids = torch.tensor([[1]])
        client = timed(lambda: model.head.logits(model.head.embed(ids)))
    return blocks, client


def report_cpu(cpu: dict, compute) -> None:
    blocks, head = compute
    n = max(1, cpu["tokens"])
    rows = [[f"peer {i + 1}", f"{t / n * 1e3:.2f}", f"{c * 1e3:.2f}", f"{(t / n - c) * 1e3:.2f}"]
            for i, (t, c) in enumerate(zip(cpu["peers"], blocks))]
    client = cpu["client"] / n
    rows.append(["client", f"{client * 1e3:.2f}", f"{head * 1e3:.2f}", f"{(client - head) * 1e3:.2f}"])
    print_table(f"CPU per token over the plain chain runs ({n} tokens after each run's first), ms",
                ["process", "CPU", "compute", "overhead"],
                rows)


if __name__ == "__main__":
    main()
