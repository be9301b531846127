"""What the swarm serves for one model, seen from one node: live claims, the layer coverage map,
each peer's range, throughput, reachability, load and our link and round trip to it. As data
(``swarm_report``, for ``shardnet status --json`` and monitors) and as a terminal table."""

from __future__ import annotations

import time

from shardnet.inference.claims import STATUS_PROVIDERS_PER_RANGE, find_claims
from shardnet.inference.client.routing import format_layers, uncovered_layers
from shardnet.inference.server.placement import coverage
from shardnet.transport.node import Node


async def swarm_report(node: Node, model_id: str, num_layers: int, *, wait: float = 10.0) -> dict:
    claims = await find_claims(node, model_id, num_layers=num_layers, per_range=STATUS_PROVIDERS_PER_RANGE,
                               timeout=wait, every_provider=True)
    pings = await node.ping_many([c.peer for c in claims], timeout=3.0)
    rtts = {peer: p.rtt for peer, p in pings.items() if p.rtt is not None}
    live = [c for c in claims if c.peer in rtts]
    rows = coverage(live, num_layers)
    missing = uncovered_layers(live, num_layers)
    return {
        "model": model_id,
        "num_layers": num_layers,
        "complete": not missing,
        "missing_layers": missing,
        "bottleneck_tput": min((r["tput"] for r in rows), default=0.0),
        "coverage": [{"layer": r["layer"], "peers": len(r["peers"]), "tput": round(r["tput"], 1)} for r in rows],
        "peers": sorted(({"peer_id": c.peer, "layers": [c.start, c.end], "tput": round(c.tput, 1),
                          "reachability": c.reach, "load": round(c.load, 3), "kv_tokens_free": c.kv_tokens,
                          "link": node.link(c.peer) or "none", "rtt_ms": round(rtts[c.peer] * 1000, 2),
                          "dtype": c.dtype, "quant": c.quant, "loading": list(c.loading) if c.loading else None,
                          "uptime_s": round(max(0.0, time.time() - c.since)) if c.since else None,
                          "successor_rtts_ms": {p: round(t * 1000, 2) for p, t in c.rtts}}
                         for c in live), key=lambda p: (p["layers"], p["peer_id"])),
        "unreachable_claims": sorted({c.peer for c in claims if c.peer not in rtts}),
    }


def format_report(r: dict) -> list[str]:
    lines = [f"model {r['model'][:16]}…: {r['num_layers']} layers, {len(r['peers'])} live peer(s)"]
    bar = "".join(" " if c["peers"] == 0 else str(min(c["peers"], 9)) for c in r["coverage"])
    lines.append(f"coverage (peers per layer): [{bar}]")
    if r["missing_layers"]:
        lines.append(f"NOT SERVED: layers {format_layers(r['missing_layers'])}")
    else:
        lines.append(f"every layer served; bottleneck {r['bottleneck_tput']:.1f} tok/s")
    lines.append(f"{'peer':<20} {'layers':>7} {'tok/s':>8} {'reach':>8} {'load':>5} {'link':>8} {'rtt ms':>7}")
    for p in r["peers"]:
        a, b = p["layers"]
        lines.append(f"{p['peer_id'][:18] + '…':<20} {f'{a}:{b}':>7} {p['tput']:>8.1f} {p['reachability']:>8} "
                     f"{p['load'] * 100:>4.0f}% {p['link']:>8} {p['rtt_ms']:>7.1f}{loading_note(p)}")
    if r["unreachable_claims"]:
        lines.append(f"{len(r['unreachable_claims'])} claim(s) from peers that do not answer (gone; expiring)")
    return lines


def loading_note(p: dict) -> str:
    """' loading' for a peer that serves nothing yet, ' loading c:d' for one moving there."""
    loading = p.get("loading")
    if not loading:
        return ""
    return "  loading" if loading == p["layers"] else f"  loading {loading[0]}:{loading[1]}"
