"""The NAT lab itself (shardnet/testing/natlab.py), checked with plain sockets before any libp2p runs in
it: masquerade hides private hosts, a cone NAT keeps a socket's port towards every destination,
a symmetric NAT does not, unsolicited inbound packets vanish, and TCP simultaneous open (the hole
punch DCUtR relies on) gets through two cone NATs but not through a symmetric one."""

import json
import subprocess
import sys
import time

import pytest

from shardnet.testing import natlab

pytestmark = pytest.mark.skipif(natlab.available() is not None, reason=f"NAT lab: {natlab.available()}")

# Each helper prints one JSON line. "serve": accept N connections, report each peer address.
SERVE = """
import json, socket, sys
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("0.0.0.0", int(sys.argv[1]))); srv.listen(); print("ready", flush=True)
for _ in range(int(sys.argv[2])):
    c, addr = srv.accept(); print(json.dumps(addr), flush=True); c.close()
"""
# "dial": from a fixed local port, connect to each host:port given; report success or the error.
DIAL = """
import json, socket, sys
out = []
for target in sys.argv[2:]:
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", int(sys.argv[1]))); s.settimeout(3)
    host, port = target.rsplit(":", 1)
    try:
        s.connect((host, int(port))); out.append("ok")
    except OSError as e:
        out.append(type(e).__name__)
    s.close()
print(json.dumps(out))
"""
# "punch": bind the port, keep dialing the peer's public address until connected or deadline.
PUNCH = """
import json, socket, sys, time
deadline = time.time() + float(sys.argv[3])
while time.time() < deadline:
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(("0.0.0.0", int(sys.argv[1]))); s.settimeout(1)
    try:
        s.connect((sys.argv[2], int(sys.argv[1])))
        print(json.dumps({"ok": True, "peer": s.getpeername()})); sys.exit(0)
    except OSError:
        s.close(); time.sleep(0.2)
print(json.dumps({"ok": False}))
"""


def _serve(lab, host, port, n):
    p = lab.popen(host, [sys.executable, "-c", SERVE, str(port), str(n)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def _peers(p):
    out = p.communicate(timeout=20)[0]
    return [tuple(json.loads(line)) for line in out.splitlines()]


def test_masquerade_and_port_mapping():
    with natlab.NatLab() as lab:
        lab.add_public("s1")
        lab.add_public("s2")
        lab.add_private("cone", "cone")
        lab.add_private("sym", "symmetric")
        servers = [_serve(lab, s, 7000, 2) for s in ("s1", "s2")]
        for host in ("cone", "sym"):
            res = lab.run(host, [sys.executable, "-c", DIAL, "41000", f"{lab.ip('s1')}:7000", f"{lab.ip('s2')}:7000"])
            assert json.loads(res.stdout) == ["ok", "ok"]
        seen = [_peers(p) for p in servers]  # [server][client] -> (ip, port)
        # the servers see the routers' WAN addresses, never the private ones
        assert {seen[0][0][0], seen[1][0][0]} == {lab.public_ip("cone")}
        assert {seen[0][1][0], seen[1][1][0]} == {lab.public_ip("sym")}
        # cone: the private port is kept, towards both servers; symmetric: random, per destination
        assert seen[0][0][1] == seen[1][0][1] == 41000
        assert seen[0][1][1] != seen[1][1][1]


def test_unsolicited_inbound_is_dropped_silently():
    with natlab.NatLab() as lab:
        lab.add_public("out")
        lab.add_private("home", "cone")
        server = _serve(lab, "home", 7000, 1)  # listening, but behind the NAT
        res = lab.run("out", [sys.executable, "-c", DIAL, "0", f"{lab.public_ip('home')}:7000"])
        assert json.loads(res.stdout) == ["TimeoutError"]  # dropped: no RST to abort a hole punch
        server.kill()
        server.wait()


@pytest.mark.parametrize("nat_b,expect", [("cone", True), ("symmetric", False)])
def test_tcp_simultaneous_open_through_two_nats(nat_b, expect):
    with natlab.NatLab() as lab:
        lab.add_private("a", "cone")
        lab.add_private("b", nat_b)
        t0 = time.monotonic()
        procs = [lab.popen(me, [sys.executable, "-c", PUNCH, "4001", lab.public_ip(other), "6"],
                           stdout=subprocess.PIPE, text=True) for me, other in (("a", "b"), ("b", "a"))]
        results = [json.loads(p.communicate(timeout=30)[0]) for p in procs]
        assert [r["ok"] for r in results] == [expect, expect], results
        if expect:
            assert results[0]["peer"] == [lab.public_ip("b"), 4001]
        assert time.monotonic() - t0 < 15


def test_teardown_removes_namespaces_and_processes():
    lab = natlab.NatLab().__enter__()
    lab.add_private("a", "cone")
    sleeper = lab.popen("a", [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(600)"],
                        stdout=subprocess.PIPE, text=True)
    assert sleeper.stdout.readline().strip() == "up"  # running inside the namespace
    names = [h.netns for h in lab.hosts.values()] + [lab.hub]
    lab.close()
    assert sleeper.wait(timeout=10) != 0  # killed with its namespace
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in names)
