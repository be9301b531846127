"""The dashboard's rendering, from data alone: a row per peer across its span, missing layers
red, what the peers table and the activity line say, text escaped."""

from shardnet.gateway.dashboard import render_page, render_view

PEER_A, PEER_B = "12D3KooWAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA", "12D3KooW<b>BBBBBBBBBBBBBBBBBBBBBBBBBBBBBBB"


def state(missing=()):
    peers = [{"peer_id": PEER_A, "layers": [0, 2], "tput": 50.0, "rtt_ms": 1.5, "reachability": "public",
              "link": "direct", "load": 0.25, "dtype": "float16", "quant": "int8", "uptime_s": 3700}]
    if not missing:
        peers.append({"peer_id": PEER_B, "layers": [2, 4], "tput": 20.0, "rtt_ms": 40.0, "reachability": "private",
                      "link": "relayed", "load": 0.0, "dtype": "bfloat16", "quant": "none", "uptime_s": None})
    coverage = [{"layer": i, "peers": 0 if i in missing else 1, "tput": 0.0} for i in range(4)]
    return {"node": PEER_A, "time": 0.0,
            "models": [{"model": "ab" * 32, "name": "tiny", "num_layers": 4, "peers": peers, "coverage": coverage,
                        "missing_layers": list(missing), "complete": not missing, "bottleneck_tput": 20.0}],
            "activity": {"tokens_per_s": 12.5, "sessions_active": 2, "tokens_total": 40, "sessions_total": 3,
                         "heals_total": 1, "convictions_total": 1,
                         "recent_events": [{"time": 0.0, "kind": "conviction", "failed": [PEER_B], "phase": "audit",
                                            "error": "computed wrong"}]}}


def test_each_peer_spans_its_layers_and_every_layer_is_covered():
    view = render_view(state())
    assert view.count('class="peer"') == 2
    assert f'data-peer="{PEER_A}" data-start="0" data-end="2"' in view
    assert view.count('class="served"') == 4 and 'class="missing"' not in view
    assert "every layer served; bottleneck 20.0 tok/s" in view
    assert "<b>" not in view and "&lt;b&gt;" in view  # a peer ID is text, never markup
    assert "float16 / int8" in view and "1h 1m" in view and "—" in view
    assert '<b class="tps">12.5</b>' in view and "convicted" in view


def test_layers_nobody_serves_are_red_and_named():
    view = render_view(state(missing=(2, 3)))
    assert view.count('class="missing"') == 2 and 'class="missing" data-layer="2"' in view
    assert "layers 2-3 not served" in view


def test_the_page_refreshes_its_view_by_itself():
    page = render_page(state())
    assert page.startswith("<!doctype html>") and 'fetch("/dashboard/view"' in page and "setTimeout(refresh, 2000)" in page


def test_a_peer_loading_its_span_is_shown_as_loading():
    s = state(missing=(2, 3))
    s["models"][0]["peers"].append({"peer_id": PEER_B, "layers": [2, 4], "loading": [2, 4], "tput": 0.0,
                                    "rtt_ms": 3.0, "reachability": "public", "link": "direct", "load": 0.0})
    s["models"][0]["peers"][0]["loading"] = [1, 3]
    view = render_view(s)
    assert view.count('class="loading"') == 2 and view.count('class="served"') == 2
    assert "2:4  loading" in view and "0:2  loading 1:3" in view
