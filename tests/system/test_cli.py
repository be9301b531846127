"""The ``shardnet`` command line and the embedding example, as real processes."""

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardnet.testing.helpers import (
    FAKE_ID,
    REPO_ROOT,
    assert_one_line_failure,
    free_port,
    shardnet,
)
from shardnet.testing.localswarm import LocalSwarm

ROOT = REPO_ROOT
@pytest.fixture
def swarm(tmp_path):
    with LocalSwarm(tmp_path) as s:
        s.start_bootstrap()
        yield s


def test_ping_a_live_node(swarm):
    r = shardnet("ping", swarm.bootstrap_addr, "--count", "2")
    assert r.returncode == 0, r.stderr
    rtts = re.findall(r"time=([0-9.]+) ms", r.stdout)
    assert len(rtts) == 2 and all(float(x) > 0 for x in rtts), r.stdout


def test_peers_lists_the_swarm(swarm):
    _, a = swarm.start_node("a")
    _, b = swarm.start_node("b")
    r = shardnet("peers", "--bootstrap", swarm.bootstrap_addr, "--wait", "2", "--json")
    assert r.returncode == 0, r.stderr
    import json

    listing = json.loads(r.stdout)
    found = {p["peer_id"]: p for p in listing["peers"]}
    assert {a["peer_id"], b["peer_id"]} <= set(found)
    assert all(found[p]["link"] in ("direct", "known") for p in (a["peer_id"], b["peer_id"]))
    assert listing["reachability"] == "unknown", listing  # one machine: nobody can tell


@pytest.mark.parametrize("cmd", [
    ["ping", "/ip4/1.2.3/tcp/1"],
    ["ping", "/ip4/127.0.0.1/tcp/1"],
    ["peers", "--bootstrap", "/ip4/127.0.0.1/tcp/notaport/p2p/" + FAKE_ID],
    ["node", "--listen", "/ip9/x"],
    ["bootstrap", "--announce", "garbage"],
])
def test_malformed_multiaddrs_fail_in_one_line(cmd, tmp_path):
    r = shardnet(*cmd, env={"SHARDNET_IDENTITY": str(tmp_path / "id.key")})
    assert_one_line_failure(r, r"multiaddr|no /p2p/")
    assert r.returncode == 1


def test_unreachable_peers_fail_in_one_line():
    port = free_port()
    r = shardnet("ping", f"/ip4/127.0.0.1/tcp/{port}/p2p/{FAKE_ID}", "--timeout", "5")
    assert_one_line_failure(r, r"could not connect .*refused")
    r = shardnet("peers", "--bootstrap", f"/ip4/127.0.0.1/tcp/{port}/p2p/{FAKE_ID}")
    assert_one_line_failure(r, r"could not reach any bootstrap peer .*refused")


def test_busy_port_is_refused(tmp_path):
    # py-libp2p listens with SO_REUSEPORT: an unchecked second bind would succeed silently
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    try:
        r = shardnet("bootstrap", "--identity", str(tmp_path / "b.key"), "--listen",
                     f"/ip4/127.0.0.1/tcp/{port}")
        assert_one_line_failure(r, rf"port {port} is already in use")
    finally:
        holder.close()


def test_bootstrap_prints_its_full_multiaddr_and_stops_on_sigterm(tmp_path):
    p = subprocess.Popen([sys.executable, "-m", "shardnet", "bootstrap", "--identity", str(tmp_path / "b.key"),
                          "--listen", "/ip4/127.0.0.1/tcp/0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        lines = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = p.stdout.readline()
            lines.append(line)
            if line.startswith("ready"):
                break
        addrs = [ln.strip() for ln in lines if ln.strip().startswith("/ip4/127.0.0.1/tcp/")]
        assert addrs and re.fullmatch(r"/ip4/127\.0\.0\.1/tcp/\d+/p2p/12D3KooW\w+", addrs[0]), lines
    finally:
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=20)
    assert p.returncode == 0, err
    assert "stopped" in out and "Traceback" not in err


@pytest.mark.slow
def test_overlay_demo_runs_and_cleans_up():
    r = shardnet("demo", "--overlay-only", timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all 3 nodes know each other" in r.stdout
    assert "echoed back: 'hello over the overlay'" in r.stdout
    assert r.stdout.count("received 'hello, swarm'") == 2


@pytest.mark.slow
def test_chat_example(swarm, tmp_path):
    def start(name):
        return subprocess.Popen([sys.executable, str(ROOT / "examples" / "chat.py"), "--name", name,
                                 "--bootstrap", swarm.bootstrap_addr], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=open(tmp_path / f"{name}.log", "w"),
                                text=True, bufsize=1, env={**os.environ, "PYTHONPATH": str(ROOT)})

    def read_until(proc, pattern, timeout=30):
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if sel.select(max(0.0, deadline - time.monotonic())):
                line = proc.stdout.readline()
                if not line:
                    break
                m = re.search(pattern, line)
                if m:
                    return m
        raise AssertionError(f"no line matching {pattern!r}")

    alice, bob = start("alice"), start("bob")
    try:
        a_id = read_until(alice, r"joined chat/room/lobby as alice \((\w+)\)").group(1)
        read_until(bob, r"joined chat/room/lobby as bob")
        for _ in range(100):  # until the room's mesh includes alice
            bob.stdin.write("/peers\n")
            bob.stdin.flush()
            if int(read_until(bob, r"\[peers\] (\d+)").group(1)) >= 1:
                break
            time.sleep(0.2)
        alice.stdin.write("hello bob\n")
        alice.stdin.flush()
        read_until(bob, r"^alice: hello bob$")
        bob.stdin.write(f"/dm {a_id} psst\n/who {a_id}\n")
        bob.stdin.flush()
        read_until(alice, r"\[dm\] \w+: bob: psst")
        read_until(bob, r"\[who\] alice")
    finally:
        for p in (alice, bob):
            p.stdin.close()
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                os.kill(p.pid, signal.SIGKILL)
                p.wait(5)
    assert alice.returncode == 0 and bob.returncode == 0


def test_node_control_answers_bad_commands_and_keeps_serving(swarm):
    p, _ = swarm.start_node("c")
    p.proc.stdin.write(b"this is not json\n[1, 2]\n")
    p.proc.stdin.flush()
    for _ in range(2):
        ev = p.wait_event(lambda e: e.get("event") == "result", 10)
        assert ev["ok"] is False and ev["error"]
    for bad in ({"cmd": "nope"}, {"cmd": "ping", "peer": "not-a-peer-id"}, {"cmd": "echo"},
                {"cmd": "echo", "peer": FAKE_ID, "data": "x"}):
        r = p.command(bad, 30)
        assert r["ok"] is False and r["error"], r
    assert p.command({"cmd": "peers"})["ok"] is True


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from shardnet.inference.model.random_model import init_random

    return init_random(tmp_path_factory.mktemp("cli-model") / "m", "llama", layers=4, hidden=32, heads=2,
                       kv_heads=1, vocab=300, seed=4)


def on_a_terminal(*args, timeout=120):
    """Run shardnet with stdout and stderr both on one pseudo-terminal, as a user sees it."""
    import pty
    import select

    master, slave = pty.openpty()
    p = subprocess.Popen([sys.executable, "-m", "shardnet", *args], stdin=subprocess.DEVNULL, stdout=slave,
                         stderr=slave)
    os.close(slave)
    chunks = []
    deadline = time.monotonic() + timeout
    try:
        while True:
            ready, _, _ = select.select([master], [], [], max(0.0, deadline - time.monotonic()))
            assert ready, b"".join(chunks).decode(errors="replace")
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO: the child has closed the terminal
                break
            if not data:
                break
            chunks.append(data)
    finally:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=20)
        os.close(master)
    return p.returncode, b"".join(chunks).decode(errors="replace").replace("\r\n", "\n")


@pytest.mark.slow
def test_join_then_generate_through_two_peers(swarm, tiny_model, tmp_path):
    swarm.join_spans([(0, 2), (2, 4)], "--model", str(tiny_model))
    r = shardnet("generate", "--model", str(tiny_model), "--bootstrap", swarm.bootstrap_addr, "-n", "6",
                 "hello world", timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("hello world")
    assert re.search(r"-- \d+ tokens, [0-9.]+ tok/s decode", r.stdout), r.stdout
    assert re.search(r"-- chain: \S+ \[0:2\] -> \S+ \[2:4\]", r.stdout), r.stdout
    # On a terminal showing both streams, no log line lands inside the text; and --identity is used.
    key = tmp_path / "gen.key"
    code, screen = on_a_terminal("generate", "--model", str(tiny_model), "--bootstrap", swarm.bootstrap_addr,
                                 "-n", "6", "--identity", str(key), "hello world")
    assert code == 0, screen
    text = r.stdout.split("\n-- ")[0]
    assert text + "\n" in screen and "route:" in screen.split(text)[0], screen
    peer_id = re.search(r"peer id:\s+(\S+)", shardnet("id", "--identity", str(key)).stdout).group(1)
    assert f"created identity {peer_id}" in screen, screen


@pytest.mark.slow
def test_generate_with_speculation_and_chunks_in_flight(swarm, tmp_path):
    """The shipped model and draft, served by one `join`: speculative greedy output equals plain
    greedy output (each drafter, and auto, the default, which says what it chose), seeded
    sampling with 3 chunks in flight repeats itself exactly, and a client with no files here
    fetches the draft the model's card names."""
    from shardnet.inference.model.checkpoint import Checkpoint
    from shardnet.models import default_model_path

    p = swarm.spawn_node("all", "--threads", "1", command="join")
    swarm.wait_ready(p, 120)

    def gen(*extra):
        r = shardnet("generate", "--bootstrap", swarm.bootstrap_addr, "-n", "24", *extra, "def main(", timeout=120)
        assert r.returncode == 0, r.stderr
        text, _, report = r.stdout.partition("\n-- ")
        return text, report, r.stderr

    plain, report, _ = gen("--speculate", "none")
    assert "speculation" not in report, report
    for extra in (["--speculate", "draft", "-k", "5", "--depth", "3"], ["--speculate", "ngram", "--depth", "2"], []):
        text, report, _ = gen(*extra)
        assert text == plain, extra
    assert re.search(r"-- speculation: auto \(draft \d+ chunks, [0-9.]+ tok/s; suffix .*; plain .*\); drafting with "
                     r"\w+ last: \d+ traversals( \(\d+ of them trees of drafts\))?, [0-9.]+ tokens each, "
                     r"\d+% of drafts accepted", report), report
    sampled = ["--temperature", "0.8", "--top-k", "40", "--seed", "7", "--speculate", "draft", "--depth", "3"]
    first, _, _ = gen(*sampled)
    again, _, _ = gen(*sampled)
    assert first == again and first != plain
    # no files here: the model by its ID from the swarm, and the draft its card names (join serves
    # the shipped draft beside the shipped model)
    model_id = Checkpoint(default_model_path()).model_id
    text, report, log = gen("--model", model_id, "--cache-dir", str(tmp_path / "cache"), "--speculate", "draft")
    assert text == plain and "fetching the draft model" in log, log
    assert re.search(r"-- speculation: draft: \d+ traversals", report), report


def test_generate_without_peers_fails_in_one_line(swarm, tiny_model):
    r = shardnet("generate", "--model", str(tiny_model), "--bootstrap", swarm.bootstrap_addr,
                 "--route-timeout", "2", "hi", timeout=120)
    assert_one_line_failure(r, r"no live peer serves layers 0-3 \(model has 4 layers")


@pytest.mark.parametrize("args,pattern", [
    (["--layers", "3:2"], r"outside the model's 0:4"),
    (["--layers", "0:9"], r"outside the model's 0:4"),
    (["--layers", "x"], r"not START:END"),
    (["--region", ""], r"--region '': a region is 1 to 64 characters"),
    (["--region", "eu\nwest"], r"a region is printable text on one line"),
])
def test_join_with_bad_layers_fails_in_one_line(tiny_model, tmp_path, args, pattern):
    r = shardnet("join", "--model", str(tiny_model), "--identity", str(tmp_path / "k"), *args)
    assert_one_line_failure(r, pattern)


def test_join_with_a_non_model_directory_fails_in_one_line(tmp_path):
    r = shardnet("join", "--model", str(tmp_path), "--identity", str(tmp_path / "k"))
    assert_one_line_failure(r, r"has no config.json")


@pytest.mark.slow
def test_model_demo_serves_the_shipped_model():
    r = shardnet("demo", "--max-new-tokens", "16", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    for i in (1, 2, 3):
        assert re.search(rf"peer{i} \(pid \d+\) serves layers \d+:\d+", out), out
    assert re.search(r"layers +0:3 +12D3KooW\w+\n +layers +3:5 +12D3KooW\w+\n +layers +5:8 +12D3KooW\w+", out), out
    assert re.search(r"\d+ tokens at [0-9.]+ tok/s", out), out
    assert "def __init__(self" in out
