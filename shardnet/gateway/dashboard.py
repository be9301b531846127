"""The swarm dashboard: one web page of what the swarm serves, seen from one node.

Per model: the layer coverage map (a row per peer across the layers it serves; a layer nobody
serves is red), and each peer's throughput, round trip, reachability and link, load, dtype and
quantization, uptime. Then this node's clients: live tokens/s, sessions, recent heals and
convictions. Rendered on the server (``render_view``); the page's small script fetches
``/dashboard/view`` every few seconds and swaps it in, so there is one renderer and no build
step. ``/dashboard/state`` is the same data as JSON.

Served by the gateway (``shardnet serve``) for its model, and by ``shardnet dashboard`` for
every model the swarm lists.
"""

from __future__ import annotations

import html
import json
import time
from dataclasses import dataclass

import trio

from shardnet.errors import ShardnetError
from shardnet.inference.client.activity import ClientActivity
from shardnet.inference.swarm_status import loading_note, swarm_report
from shardnet.transport.node import Node

from .http import http_app, respond

#: seconds the page waits between refreshes
REFRESH_S = 2.0
#: how long one refresh may wait for the swarm's claims (seconds)
STATE_WAIT = 3.0


@dataclass(frozen=True)
class ShownModel:
    model_id: str
    name: str
    num_layers: int


async def dashboard_state(node: Node, models: list[ShownModel], activity: ClientActivity) -> dict:
    """What the page shows, as data: each model's swarm report, and this node's client activity
    (the node's ``ClientActivity``, from its ``InferenceServices``)."""
    reports: list[dict] = [{}] * len(models)

    async def one(i: int, m: ShownModel) -> None:
        try:
            reports[i] = await swarm_report(node, m.model_id, m.num_layers, wait=STATE_WAIT)
        except (ShardnetError, trio.TooSlowError) as e:
            reports[i] = {"model": m.model_id, "num_layers": m.num_layers, "error": str(e), "peers": [],
                          "coverage": [], "missing_layers": list(range(m.num_layers)), "complete": False}
        reports[i]["name"] = m.name

    async with trio.open_nursery() as nursery:
        for i, m in enumerate(models):
            nursery.start_soon(one, i, m)
    return {"node": str(node.peer_id), "time": time.time(), "models": reports,
            "activity": activity.to_json()}


def _short(peer: str) -> str:
    return peer[:8] + "…" + peer[-6:] if len(peer) > 16 else peer


def _uptime(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    s = int(seconds)
    return f"{s // 86400}d {s % 86400 // 3600}h" if s >= 86400 else f"{s // 3600}h {s % 3600 // 60}m" \
        if s >= 3600 else f"{s // 60}m {s % 60}s"


def _model_view(r: dict) -> str:
    e = html.escape
    n = r["num_layers"]
    missing = set(r.get("missing_layers", []))
    head = "".join(f"<th>{i}</th>" for i in range(n))
    rows = []
    for p in r["peers"]:
        a, b = p["layers"]
        serving = p.get("loading") != [a, b]  # a peer that only loads its span serves none of it yet
        cells = "".join(f'<td class="{("served" if serving else "loading") if a <= i < b else "empty"}" '
                        f'data-layer="{i}"></td>' for i in range(n))
        rows.append(f'<tr class="peer" data-peer="{e(p["peer_id"])}" data-start="{a}" data-end="{b}">'
                    f'<th title="{e(p["peer_id"])}">{e(_short(p["peer_id"]))}</th>{cells}</tr>')
    cover = "".join(
        f'<td class="{"missing" if i in missing else "covered"}" data-layer="{i}">'
        f'{"" if i in missing else c["peers"]}</td>'
        for i, c in enumerate(r.get("coverage") or [{"peers": 0}] * n))
    status = (f'<span class="bad">layers {e(_ranges(sorted(missing)))} not served</span>' if missing
              else f'<span class="good">every layer served; bottleneck {r.get("bottleneck_tput", 0):.1f} tok/s</span>')
    if r.get("error"):
        status = f'<span class="bad">{e(r["error"])}</span>'
    table = "".join(
        f'<tr data-peer="{e(p["peer_id"])}"><td title="{e(p["peer_id"])}">{e(_short(p["peer_id"]))}</td>'
        f'<td>{p["layers"][0]}:{p["layers"][1]}{e(loading_note(p))}</td><td>{p["tput"]:.1f}</td><td>{p["rtt_ms"]:.1f}</td>'
        f'<td>{e(p["reachability"])}</td><td>{e(p["link"])}</td><td>{p["load"] * 100:.0f}%</td>'
        f'<td>{e(p.get("dtype", "?"))}{"" if p.get("quant", "none") == "none" else " / " + e(p["quant"])}</td>'
        f'<td>{_uptime(p.get("uptime_s"))}</td></tr>' for p in r["peers"])
    return (f'<section class="model" data-model="{e(r["model"])}"><h2>{e(r.get("name") or r["model"][:16])} '
            f'<small>{e(r["model"][:16])}… · {n} layers · {len(r["peers"])} live peer(s)</small></h2>'
            f'<p>{status}</p><table class="coverage"><tr><th>layer</th>{head}</tr>{"".join(rows)}'
            f'<tr class="total"><th>peers</th>{cover}</tr></table>'
            f'<table class="peers"><tr><th>peer</th><th>layers</th><th>tok/s</th><th>rtt ms</th><th>reach</th>'
            f'<th>link</th><th>load</th><th>dtype</th><th>uptime</th></tr>{table}</table></section>')


def _ranges(layers: list[int]) -> str:
    out, start = [], None
    for i, x in enumerate(layers):
        if start is None:
            start = x
        if i + 1 == len(layers) or layers[i + 1] != x + 1:
            out.append(f"{start}" if start == x else f"{start}-{x}")
            start = None
    return ", ".join(out)


def _activity_view(a: dict) -> str:
    e = html.escape
    events = "".join(
        f'<li class="{e(ev["kind"])}">{time.strftime("%H:%M:%S", time.localtime(ev["time"]))} '
        f'{"convicted" if ev["kind"] == "conviction" else "healed around"} '
        f'{", ".join(e(_short(p)) for p in ev.get("failed", []))} '
        f'({e(ev.get("phase", ""))}{", " + e(ev["error"][:80]) if ev.get("error") else ""})</li>'
        for ev in reversed(a["recent_events"]))
    return (f'<section class="activity"><h2>This node\'s clients</h2><p><b class="tps">{a["tokens_per_s"]:.1f}</b> '
            f'tok/s (last minute) · {a["sessions_active"]} session(s) running · {a["tokens_total"]} tokens in '
            f'{a["sessions_total"]} session(s) · {a["heals_total"]} heal(s), {a["convictions_total"]} '
            f'conviction(s)</p><ul class="events">{events or "<li>no heals or convictions yet</li>"}</ul></section>')


def render_view(state: dict) -> str:
    """The page's live part (what each refresh replaces)."""
    models = "".join(_model_view(r) for r in state["models"]) or "<p>no model to show yet</p>"
    stamp = time.strftime("%H:%M:%S", time.localtime(state["time"]))
    return (f'<p class="meta">seen from {html.escape(_short(state["node"]))} at <span class="stamp">{stamp}</span>'
            f'</p>{models}{_activity_view(state["activity"])}')


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>shardnet swarm</title>
<style>
body {{ font: 14px system-ui, sans-serif; margin: 1.5em; color: #222; }}
h1 {{ font-size: 1.3em; }} h2 {{ font-size: 1.1em; margin-top: 1.5em; }} small {{ color: #777; font-weight: normal; }}
table {{ border-collapse: collapse; margin: .5em 0; }}
table.coverage td {{ width: 22px; height: 18px; border: 1px solid #fff; text-align: center; font-size: 11px; }}
table.coverage th {{ font-weight: normal; font-size: 11px; padding: 0 .5em; text-align: right; }}
td.served {{ background: #3b82f6; }} td.loading {{ background: #bfdbfe; }} td.empty {{ background: #f1f5f9; }}
td.covered {{ background: #bbf7d0; }} td.missing {{ background: #ef4444; color: #fff; }}
table.peers td, table.peers th {{ padding: 2px 10px; border-bottom: 1px solid #e5e7eb; text-align: left; }}
.good {{ color: #15803d; }} .bad {{ color: #b91c1c; font-weight: bold; }}
.meta {{ color: #777; }} li.conviction {{ color: #b91c1c; }}
</style></head>
<body><h1>shardnet swarm</h1><div id="view">{view}</div>
<script>
async function refresh() {{
  try {{
    const r = await fetch("/dashboard/view", {{cache: "no-store"}});
    if (r.ok) document.getElementById("view").innerHTML = await r.text();
  }} catch (e) {{}}
  setTimeout(refresh, {refresh_ms});
}}
setTimeout(refresh, {refresh_ms});
</script></body></html>
"""


def render_page(state: dict) -> str:
    return PAGE.format(view=render_view(state), refresh_ms=int(REFRESH_S * 1000))


#: the paths the dashboard answers, and what each serves
PATHS = ("/dashboard", "/dashboard/view", "/dashboard/state")


class DashboardPages:
    """Answers the dashboard's paths for a node; ``models()`` says which models to show,
    ``activity`` is what the node's clients did."""

    def __init__(self, node: Node, models, activity: ClientActivity) -> None:
        self.node, self.models, self.activity = node, models, activity

    async def page(self, path: str) -> tuple[bytes, str]:
        """The body and content type of ``path`` (one of PATHS)."""
        state = await dashboard_state(self.node, await self.models(), self.activity)
        if path == "/dashboard/state":
            return json.dumps(state).encode(), "application/json"
        text = render_view(state) if path == "/dashboard/view" else render_page(state)
        return text.encode(), "text/html; charset=utf-8"


class SwarmModels:
    """The models the swarm lists (model cards), looked up at most every ``ttl`` seconds; for a
    dashboard with no model of its own. ``only``: names or IDs to keep (all when empty)."""

    def __init__(self, node: Node, only: tuple[str, ...] = (), ttl: float = 30.0) -> None:
        self.node, self.only, self.ttl = node, only, ttl
        self._cached: tuple[float, list[ShownModel]] | None = None

    async def __call__(self) -> list[ShownModel]:
        from shardnet.inference.weights.cards import list_models

        now = trio.current_time()
        if self._cached is None or now - self._cached[0] > self.ttl or not self._cached[1]:
            try:
                listed = await list_models(self.node, timeout=STATE_WAIT)
            except ShardnetError:
                listed = []
            shown = [ShownModel(m.card.model_id, (m.card.names or (m.card.model_id[:16],))[0], m.card.num_layers)
                     for m in listed if not self.only or m.card.model_id in self.only
                     or set(m.card.names) & set(self.only)]
            self._cached = (now, shown)
        return self._cached[1]


def dashboard_app(node: Node, models, activity: ClientActivity):
    """The dashboard alone as an ASGI app (``shardnet dashboard``): its paths, ``/`` redirecting
    to it, 404 elsewhere."""
    pages = DashboardPages(node, models, activity)

    @http_app
    async def app(scope, receive, send) -> None:
        path = scope["path"].rstrip("/") or "/"
        headers: list[tuple[bytes, bytes]] = []
        if scope["method"] != "GET":
            status, body, ctype = 405, b"only GET\n", "text/plain; charset=utf-8"
        elif path == "/":
            status, body, ctype = 302, b"", "text/plain; charset=utf-8"
            headers.append((b"location", b"/dashboard"))
        elif path in PATHS:
            status, (body, ctype) = 200, await pages.page(path)
        else:
            status, body, ctype = 404, b"not found: the dashboard is at /dashboard\n", "text/plain; charset=utf-8"
        await respond(send, status, body, ctype, [(b"cache-control", b"no-store"), *headers])

    return app
