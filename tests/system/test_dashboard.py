"""The swarm dashboard in a real browser (Debian's chromium, headless, driven by playwright) over
a live swarm of real processes: the page shows each peer and its span, refreshes by itself, and
turns a span red when its only peer is killed. Screenshots go to the test's directory (and to
$SHARDNET_SCREENSHOT_DIR when set: docs/dashboard.png is one)."""

import json
import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest

from shardnet.testing.helpers import free_port, http_request, wait_healthy
from shardnet.testing.localswarm import LocalSwarm, ShardnetProcess

pytestmark = pytest.mark.slow

CHROMIUM = "/usr/bin/chromium"
# as the machine notes say: without the background-networking flags chromium tries Google's hosts
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def screenshot(page, tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    page.screenshot(path=str(path), full_page=True)
    if out := os.environ.get("SHARDNET_SCREENSHOT_DIR"):
        shutil.copy(path, Path(out) / name)
    return path


def test_the_dashboard_shows_the_swarm_and_a_killed_peers_span_in_red(tmp_path):
    if not Path(CHROMIUM).exists():
        if os.environ.get("SHARDNET_REQUIRE_BROWSER"):  # (.ci/run installs it)
            pytest.fail(f"{CHROMIUM} is missing: apt-get install chromium")
        pytest.skip("needs Debian's chromium: apt-get install chromium (.ci/run installs it)")
    from playwright.sync_api import expect, sync_playwright

    with LocalSwarm() as swarm:
        swarm.start_bootstrap()
        first, *others = swarm.join_spans([(0, 4), (4, 8), (4, 8)], "--threads", "1")
        peers = {e["peer_id"]: span for e, span in zip([first, *others], [(0, 4), (4, 8), (4, 8)])}
        url, _ = swarm.start_gateway()
        wait_healthy(url)
        status, _ = http_request(url, "POST", "/v1/completions",
                                 json.dumps({"model": "tiny-llama", "prompt": "def main(", "max_tokens": 8}),
                                 {"content-type": "application/json"})
        assert status == 200
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
            try:
                page = browser.new_page(viewport={"width": 1100, "height": 700})
                page.goto(url + "/dashboard")
                # every live peer, across its span; every layer covered
                for peer, (a, b) in peers.items():
                    row = page.locator(f'tr.peer[data-peer="{peer}"]')
                    expect(row).to_have_count(1)
                    assert (row.get_attribute("data-start"), row.get_attribute("data-end")) == (str(a), str(b))
                    assert row.locator("td.served").count() == b - a
                expect(page.locator("td.missing")).to_have_count(0)
                expect(page.locator("text=every layer served")).to_be_visible()
                assert float(page.locator("b.tps").inner_text()) > 0  # the completion's tokens
                stamp = page.locator("span.stamp").inner_text()
                screenshot(page, tmp_path, "dashboard.png")
                # the only peer of layers 0-3 goes away: the page turns them red by itself
                first_proc = next(p for p in swarm.procs if p.name.startswith("join"))  # (the 0:4 peer)
                first_proc.stop(signal.SIGKILL)
                for layer in range(4):
                    expect(page.locator(f'tr.total td.missing[data-layer="{layer}"]')).to_be_visible(timeout=45_000)
                expect(page.locator(f'tr.peer[data-peer="{first["peer_id"]}"]')).to_have_count(0)
                expect(page.locator('tr.total td.missing[data-layer="4"]')).to_have_count(0)
                expect(page.locator("text=layers 0-3 not served")).to_be_visible()
                assert page.locator("span.stamp").inner_text() != stamp  # refreshed without a reload
                screenshot(page, tmp_path, "dashboard-gap.png")
            finally:
                browser.close()


def test_shardnet_dashboard_alone_lists_the_swarms_models(tmp_path):
    """The standalone command (no model files) shows what the swarm's model cards list."""
    with LocalSwarm() as swarm:
        swarm.start_bootstrap()
        events = swarm.join_spans([(0, 8)], "--threads", "1")
        port = free_port()
        p = ShardnetProcess("dashboard", ["dashboard", "--bootstrap", swarm.bootstrap_addr, "--port", str(port)],
                            workdir=swarm.workdir)
        swarm.procs.append(p)
        line = p.wait_for_line(lambda s: "swarm dashboard on" in s, 60)
        url = re.search(r"http://[\d.]+:\d+", line).group(0)
        deadline = time.monotonic() + 60
        while True:  # the peer's model card goes out a moment after it starts
            status, data = http_request(url, "GET", "/dashboard/state")
            assert status == 200
            state = json.loads(data)
            if state["models"] and state["models"][0]["peers"]:
                break
            assert time.monotonic() < deadline, state
            time.sleep(1)
        model = state["models"][0]
        assert model["name"] == "tiny-llama" and model["num_layers"] == 8 and model["complete"]
        assert [pp["peer_id"] for pp in model["peers"]] == [events[0]["peer_id"]]
        status, page = http_request(url, "GET", "/")
        assert status == 302
        status, page = http_request(url, "GET", "/dashboard")
        assert status == 200 and b'data-model="' in page and events[0]["peer_id"].encode() in page
