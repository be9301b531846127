"""Activation compression on the wire: bytes per token per hop, and whether greedy output changes.

    python -m bench.wire_compression [--tokens 48] [--quick]

Two peers serve the shipped tiny-llama (layers 0:4, 4:8) in this process; for each wire dtype
the client generates ``--tokens`` greedy tokens from three prompts and counts how many tokens agree with
the uncompressed (float32) run before the first difference.
"""

import logging
from contextlib import AsyncExitStack

import torch
import trio

from bench._common import bench_parser, print_table  # noqa: E402
from shardnet.inference.model import wire  # noqa: E402
from shardnet.inference.client.client import Client
from shardnet.inference.model.local_model import LocalModel  # noqa: E402
from shardnet.inference.server.compute_peer import serve_block  # noqa: E402
from shardnet.models import default_model_path  # noqa: E402
from shardnet.transport import NodeConfig, open_node  # noqa: E402

logging.disable(logging.CRITICAL)
P = default_model_path()
PROMPTS = ["def __init__(self", "import os\nimport sys\n\n", "class Foo:\n    def bar(self, x):\n        return"]


def agreeing_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


async def run(new: int) -> None:
    async with AsyncExitStack() as st:
        boot = await st.enter_async_context(open_node(NodeConfig()))
        cfg = NodeConfig(bootstrap=[str(boot.listen_addrs[0])])
        for a, b in ((0, 4), (4, 8)):
            peer = await st.enter_async_context(open_node(cfg))
            await st.enter_async_context(serve_block(peer, str(P), a, b))
        node = await st.enter_async_context(open_node(cfg))
        await node.wait_bootstrapped()
        model = LocalModel(P)
        hidden = model.ckpt.config.hidden_size
        ref: dict[str, list[int]] = {}
        table = []
        for w in ("float32", "float16", "bfloat16", "int8q"):
            client = Client(node, model, wire=w, audit_rate=0)  # the wire alone
            agree = 0
            for pr in PROMPTS:
                ids = [t.id async for t in client.generate(pr, max_new_tokens=new, stop_at_eos=False)]
                ref.setdefault(pr, ids)
                agree += agreeing_prefix(ids, ref[pr])
            size = len(wire.to_payload(torch.randn(1, 1, hidden), w)[2])
            table.append([w, size, f"{size / (4 * hidden):.2f}", f"{agree}/{new * len(PROMPTS)}"])
        print_table(None, ["wire dtype", "bytes/token/hop", "vs float32", "greedy tokens agreeing"], table)


def main() -> None:
    p = bench_parser(__doc__, quick="a short run for the tests: 4 tokens per prompt")
    p.add_argument("--tokens", type=int, default=48, help="greedy tokens per prompt")
    args = p.parse_args()
    trio.run(run, 4 if args.quick else args.tokens)


if __name__ == "__main__":
    main()
