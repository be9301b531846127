"""A compute peer: load one block, serve it on the activation protocol, keep its claim published."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import torch
import trio

from shardnet.protocols.block_claim import Claim
from shardnet.transport.node import Node

from .block import Block, Head, pick_device, resolve_dtype
from .checkpoint import Checkpoint
from .claims import ClaimPublisher
from .endpoint import ActivationEndpoint, KvBudget, ServedBlock

log = logging.getLogger(__name__)

DEFAULT_KV_BUDGET = 512 << 20


def measure_throughput(block: Block, tokens: int = 16) -> float:
    """Tokens per second of one decode-like forward (a rough figure for claims and routing)."""
    hidden = torch.zeros(1, 1, block.config.hidden_size, dtype=block.dtype, device=block.device)
    cache = block.new_cache()
    block.forward(hidden, cache, 0)  # warm-up
    t0 = time.perf_counter()
    for i in range(tokens):
        block.forward(hidden, cache, i + 1)
    return tokens / max(time.perf_counter() - t0, 1e-9)


@asynccontextmanager
async def serve_block(node: Node, model_path: str, start: int, end: int, *, dtype: str = "float32",
                      device: str | None = None, kv_budget_bytes: int = DEFAULT_KV_BUDGET,
                      idle_timeout: float = 300.0, hold_head: bool = False,
                      claim_ttl: float = 120.0) -> AsyncIterator[ServedBlock]:
    ckpt = Checkpoint(model_path)
    model_id = ckpt.model_id
    tdtype, dev = resolve_dtype(dtype), pick_device(device)
    log.info("loading layers %d:%d of %s (%s, %s)", start, end, ckpt.path.name, dtype, dev)
    block = await trio.to_thread.run_sync(lambda: Block(ckpt, start, end, dtype=tdtype, device=dev))
    r = block.load_report
    log.info("loaded %d tensors (%.1f MB) in %.2f s", r.tensors, r.bytes / 1e6, r.seconds)
    head = None
    if hold_head and end == ckpt.num_layers:
        head = Head(ckpt, dtype=tdtype, device=dev, embed=False, lm_head=True)
    tput = await trio.to_thread.run_sync(measure_throughput, block)
    kv = KvBudget(kv_budget_bytes)
    served = ServedBlock(block, model_id, kv, head=head, idle_timeout=idle_timeout)
    ActivationEndpoint.of(node).serve(served)

    def claim(expires: float) -> Claim:
        return Claim(model=model_id, start=start, end=end, kv_tokens=(kv.limit - kv.used) // block.kv_bytes_per_token(),
                     tput=tput, addrs=tuple(str(a) for a in node.listen_addrs), expires=expires,
                     peer=str(node.peer_id))

    publisher = ClaimPublisher(node, claim)
    async with trio.open_nursery() as nursery:
        await nursery.start(lambda task_status: publisher.run(ttl=claim_ttl, task_status=task_status))
        try:
            yield served
        finally:
            nursery.cancel_scope.cancel()
