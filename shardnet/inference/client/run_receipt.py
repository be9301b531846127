"""Run receipts: what a client signs about one ``generate`` (see protocols/receipts.py).

``Client.generate`` keeps the facts of its last run (``last_run``); ``seal_run_receipt`` turns
them, with each peer's stage receipt of the final session, into a signed JSON-ready document.
"""

from __future__ import annotations

import base64
import time
from typing import TYPE_CHECKING

import trio

from shardnet._version import __version__
from shardnet.errors import ShardnetError
from shardnet.inference.model.block import dtype_name
from shardnet.protocols import receipts as rc

if TYPE_CHECKING:
    from shardnet.inference.client.decode import GenerationStats
    from shardnet.inference.client.healing import HealingSession
    from shardnet.inference.client.request import RequestContext
    from shardnet.inference.client.sampling import SamplingParams
    from shardnet.inference.client.speculative import Drafter


def last_run(*, prompt: list[int], output: list[int], params: SamplingParams, stats: GenerationStats,
             session: HealingSession, drafter: Drafter | None, k: int, depth: int, audit_rate: float) -> dict:
    """The facts of a run a receipt needs. ``output`` fills as tokens are generated; a caller
    may add ``checked`` (speculative output compared with plain decoding: True or False)."""
    return {"prompt": prompt, "output": output, "params": params, "stats": stats, "session": session,
            "drafter": drafter, "k": k, "depth": depth, "audit_rate": audit_rate}


async def seal_run_receipt(request: RequestContext, run: dict | None, *, wait: float = 10.0) -> dict:
    """The run receipt of ``run`` (see ``last_run``), made through ``request``, signed by the
    client node's key. Fetches each peer's stage receipt of the final session, waiting up to
    ``wait`` seconds."""
    from shardnet.inference.receipt_service import fetch_session_receipts

    if run is None or not run["session"].entered:
        raise ShardnetError("no generation to write a receipt for")
    if not request.receipts:
        raise ShardnetError("this client was made with receipts=False")
    node, model = request.node, request.model
    stats, hs = run["stats"], run["session"]
    final, route = hs.entered[-1]
    sid = final.session.hex()
    blobs: list[bytes | None] = [None] * len(route)

    async def one(i: int, peer: str) -> None:
        blobs[i] = await fetch_session_receipts(node, peer, sid, wait=wait)

    async with trio.open_nursery() as nursery:
        for i, c in enumerate(route):
            nursery.start_soon(one, i, c.peer)
    missing = [c.peer[:16] for c, b in zip(route, blobs) if b is None]
    if missing:
        raise ShardnetError(f"no stage receipt from {', '.join(missing)} within {wait:g} s")
    params, drafter = run["params"], run["drafter"]
    body = {
        "schema": rc.SCHEMA, "model": model.model_id, "num_layers": model.ckpt.num_layers,
        "client": str(node.peer_id), "created": time.time(),
        "prompt_sha256": rc.tokens_hash(run["prompt"]), "prompt_tokens": len(run["prompt"]),
        "output_ids": list(run["output"]), "output_sha256": rc.tokens_hash(run["output"]),
        "sampling": {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
                     **params.receipt_fields()},
        "seed": params.seed, "logits_on_last": request.logits_on_last, "wire": request.wire,
        # what the client computed in (embeddings, and the head unless logits_on_last); each stage
        # receipt says the same of its block, and whether its steps were batched with others'
        "dtype": dtype_name(model.dtype),
        "sessions": [{"session": sid, "sent_chain": final.up.sent_hash.hex(),
                      "received_chain": final.ret.received_hash.hex(),
                      "stages": [base64.b64encode(b).decode() for b in blobs]}],
        "healed_from": [{"session": s.session.hex(), "chain": [c.peer for c in r]} for s, r in hs.entered[:-1]],
        "rtts_ms": {c.peer: round(request.planner.rtt(c.peer) * 1000, 3) for c in route},
        "peer_rtts_ms": {c.peer: {p: round(t * 1000, 3) for p, t in c.rtts} for c in route},
        "tok_per_s": round(stats.tokens_per_s, 3), "prefill_s": round(stats.prefill_s, 4),
        "speculative": None if drafter is None else {
            **drafter_record(drafter), "k": run["k"], "depth": run["depth"],
            "greedy_checked_equal_to_plain": run.get("checked")},
        # honest-compute checks of this run: how many steps were re-run on other peers, with what verdicts
        "checks": None if stats.audit is None else dict(stats.audit.to_json(), rate=run["audit_rate"],
                                                        retracted_tokens=stats.retracted),
        "version": __version__,
    }
    return rc.seal_run(node.key_pair, body)


def drafter_record(drafter) -> dict:
    """What a receipt says of a run's drafter: ``drafter`` ngram, suffix, auto (with the
    ``candidates`` it chose between) or model (a draft model)."""
    name = getattr(drafter, "name", None)
    if name == "auto":
        return {"drafter": "auto", "candidates": ["model" if n == "draft" else n for n in drafter.candidates]}
    return {"drafter": name if name in ("ngram", "suffix") else "model"}
