"""An honest client, for tests: ``python honest_client.py BOOTSTRAP NEW_TOKENS``.

Joins the swarm, then for every line on stdin generates NEW_TOKENS greedily from a fixed prompt
through the swarm (the shipped model; a new session each time, its route found anew) and prints
``{"s": seconds, "ids": [...]}``. Prints ``{"ready": true}`` after a first, unmeasured generation.
"""

import json
import sys
import time
from pathlib import Path

import trio  # noqa: E402

from shardnet.inference.client.client import Client
from shardnet.inference.model.local_model import LocalModel  # noqa: E402
from shardnet.models import default_model_path  # noqa: E402
from shardnet.transport import open_node  # noqa: E402
from shardnet.transport.config import NodeConfig  # noqa: E402

PROMPT = "def fibonacci(n):"


async def main(bootstrap: str, new: int) -> None:
    config = NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"], bootstrap=[bootstrap], dht_mode="client",
                        autonat=False, hole_punch=False, auto_relays=0)
    async with open_node(config) as node:
        await node.wait_bootstrapped(30)
        client = Client(node, LocalModel(default_model_path()), audit_rate=0.0)

        async def once() -> list[int]:
            with trio.fail_after(120):
                return [t.id async for t in client.generate(PROMPT, max_new_tokens=new, stop_at_eos=False)]

        await once()
        print(json.dumps({"ready": True}), flush=True)
        while await trio.to_thread.run_sync(sys.stdin.readline):
            t0 = time.perf_counter()
            ids = await once()
            print(json.dumps({"s": time.perf_counter() - t0, "ids": ids}), flush=True)


if __name__ == "__main__":
    trio.run(main, sys.argv[1], int(sys.argv[2]))
