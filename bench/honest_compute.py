"""What receipts and honest-compute checks cost, measured side by side in one run.

    python -m bench.honest_compute [--tokens 48] [--repeats 5] [--rates 0.1,0.25] [--quick]

The shipped tiny-llama served twice over (layers 0:4 and 4:8 each by two ``shardnet join``
processes, so every span has a witness). Rounds alternate between: everything off (no run
receipt bookkeeping, no checks), receipts on (the client keeps hash chains and drains the return
stream at close; peers hash and sign every session either way), and receipts on with checks at
each ``--rates`` value. Each request decodes ``--tokens`` tokens greedily; tok/s counts the whole
request (checks still running at the end are waited for). Also reported: the time to collect a
run receipt (every stage receipt) after a request. All processes share this machine's cores, so
a check's extra forward passes compete with the request itself: on a real swarm they load other
machines.
"""

from __future__ import annotations

import statistics
import sys
import time

import trio

from bench._common import bench_parser, ratio  # noqa: E402
from shardnet.inference.claims import find_claims  # noqa: E402
from shardnet.inference.client.client import Client
from shardnet.inference.model.local_model import LocalModel  # noqa: E402
from shardnet.testing.localswarm import LocalSwarm  # noqa: E402
from shardnet.models import default_model_path  # noqa: E402
from shardnet.transport import NodeConfig, open_node  # noqa: E402

PROMPT = "def __init__(self, name):\n        self.name = name\n        self."


async def main_async(args) -> None:
    rates = [float(r) for r in args.rates.split(",") if r]
    with LocalSwarm() as swarm:
        boot_addr = swarm.start_bootstrap()
        swarm.join_spans([(0, 4), (0, 4), (4, 8), (4, 8)], "--threads", "1")
        cfg = NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"], bootstrap=[boot_addr], dht_mode="client",
                         low_watermark=0)
        async with open_node(cfg) as node:
            await node.wait_bootstrapped()
            model = LocalModel(default_model_path())
            with trio.fail_after(60):
                while len(await find_claims(node, model.model_id, num_layers=model.ckpt.num_layers)) < 4:
                    await trio.sleep(0.5)
            modes = {"off": dict(receipts=False, audit_rate=0.0), "receipts": dict(receipts=True, audit_rate=0.0)}
            modes |= {f"receipts+checks@{r:g}": dict(receipts=True, audit_rate=r) for r in rates}
            clients = {name: Client(node, model, **kw) for name, kw in modes.items()}
            for c in clients.values():  # warm-up: routes, RTTs, caches
                [t async for t in c.generate(PROMPT, max_new_tokens=4, stop_at_eos=False)]
            tps: dict[str, list[float]] = {name: [] for name in modes}
            checks: dict[str, list[int]] = {name: [0, 0] for name in modes}
            collect: list[float] = []
            want = None
            for _ in range(args.repeats):
                for name, c in clients.items():
                    ids: list[int] = []
                    t0 = time.perf_counter()
                    async for tok in c.generate(PROMPT, max_new_tokens=args.tokens, stop_at_eos=False):
                        tok.apply(ids)
                    tps[name].append(args.tokens / (time.perf_counter() - t0))
                    want = want or ids
                    assert ids == want, f"{name}: output differs"
                    a = c.last_stats.audit
                    if a is not None:
                        checks[name][0] += a.checked
                        checks[name][1] += a.agreed
                    if name == "receipts":
                        t0 = time.perf_counter()
                        await c.run_receipt()
                        collect.append(time.perf_counter() - t0)
            base = statistics.median(tps["off"])
            print(f"{args.tokens} tokens per request, {args.repeats} rounds, medians:")
            for name in modes:
                med = statistics.median(tps[name])
                extra = ""
                if checks[name][0]:
                    extra = f"; {checks[name][0]} steps re-run on a witness, {checks[name][1]} agreed"
                print(f"  {name:<22} {med:6.1f} tok/s  ({ratio(med, base)} of off){extra}")
            print(f"  collecting a run receipt after a request: {statistics.median(collect) * 1000:.0f} ms")


def main() -> int:
    ap = bench_parser(__doc__, quick="a short run for the tests: 8 tokens, 1 round, checks at rate 1 (every step)")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rates", default="0.1,0.25")
    args = ap.parse_args()
    if args.quick:
        args.tokens, args.repeats, args.rates = 8, 1, "1"
    trio.run(main_async, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
