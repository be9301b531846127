"""mDNS discovery between two processes on a private link (two network namespaces joined by a
veth pair, documentation addresses), so no multicast leaves the test."""

import os
import subprocess
import uuid

import pytest

from shardnet.testing.localswarm import ShardnetProcess

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root (CI runs as root)"),
]


def sh(*args):
    subprocess.run(args, check=True, capture_output=True, timeout=30)


@pytest.fixture
def lan():
    tag = uuid.uuid4().hex[:6]
    ns = [f"sn{tag}a", f"sn{tag}b"]
    va, vb = f"v{tag}a", f"v{tag}b"
    try:
        for n in ns:
            sh("ip", "netns", "add", n)
            sh("ip", "-n", n, "link", "set", "lo", "up")
        sh("ip", "link", "add", va, "netns", ns[0], "type", "veth", "peer", "name", vb, "netns", ns[1])
        for n, v, ip in ((ns[0], va, "198.51.100.1/24"), (ns[1], vb, "198.51.100.2/24")):
            sh("ip", "-n", n, "addr", "add", ip, "dev", v)
            sh("ip", "-n", n, "link", "set", v, "up", "multicast", "on")
        yield ns
    finally:
        for n in ns:
            subprocess.run(["ip", "netns", "del", n], capture_output=True, timeout=30)


def test_two_nodes_find_each_other_with_mdns(lan, tmp_path):
    procs = []
    try:
        for i, n in enumerate(lan):
            p = ShardnetProcess(f"m{i}", ["node", "--events", "--mdns", "--identity", str(tmp_path / f"{i}.key"),
                                          "--listen", "/ip4/0.0.0.0/tcp/0"],
                                workdir=tmp_path, prefix=["ip", "netns", "exec", n])
            procs.append(p)
        ready = [p.wait_event(lambda e: e.get("event") == "ready", 60) for p in procs]
        a, b = procs
        b_id = ready[1]["peer_id"]
        assert any(addr.startswith("/ip4/198.51.100.2/") for addr in ready[1]["addrs"]), ready[1]
        a.wait_event(lambda e: e.get("event") == "discovered" and e["peer_id"] == b_id, 30)
        r = a.command({"cmd": "echo", "peer": b_id, "data": "found you on the LAN"})
        assert r["ok"] and r["data"] == "found you on the LAN", r
    finally:
        for p in procs:
            p.stop()
