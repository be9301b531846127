"""A real swarm: 1 bootstrap + 5 nodes, each a separate ``shardnet`` process on loopback."""

import time

import psutil
import pytest

from shardnet.testing.localswarm import LocalSwarm

pytestmark = pytest.mark.slow

N_NODES = 5
DISCOVERY_BOUND_S = 30.0
TOPIC = "swarm-test"


def _listening_ports(pid: int) -> set[int]:
    try:
        return {c.laddr.port for c in psutil.Process(pid).net_connections("tcp") if c.status == "LISTEN"}
    except psutil.NoSuchProcess:
        return set()


def _wait_all_discovered(nodes, ids, bound):
    deadline = time.monotonic() + bound
    seen = {pid: set() for _, pid in nodes}
    for p, me in nodes:
        want = set(ids) - {me}
        while not want <= seen[me]:
            ev = p.next_event(deadline - time.monotonic())
            if ev.get("event") == "discovered":
                seen[me].add(ev["peer_id"])
    return time.monotonic() - (deadline - bound)


def test_swarm_of_processes(tmp_path):
    with LocalSwarm(tmp_path) as swarm:
        boot_addr = swarm.start_bootstrap()
        boot = swarm.bootstrap
        nodes = []
        for i in range(N_NODES):
            p, ready = swarm.start_node(f"n{i}", "--subscribe", TOPIC)
            nodes.append((p, ready["peer_id"]))
        ids = [pid for _, pid in nodes]
        boot_id = boot_addr.rsplit("/p2p/", 1)[1]

        # 1. every node finds every other through the DHT within a bounded time
        took = _wait_all_discovered(nodes, ids, DISCOVERY_BOUND_S)
        print(f"all {N_NODES} nodes discovered each other in {took:.2f} s")
        for p, me in nodes:
            r = p.command({"cmd": "find_peer", "peer": ids[(ids.index(me) + 2) % N_NODES]})
            assert r["ok"] and r["found"] and r["addrs"], r

        # 2. a custom-protocol stream between two nodes introduced only by the bootstrap
        (p0, id0), (p4, id4) = nodes[0], nodes[-1]
        r = p0.command({"cmd": "echo", "peer": id4, "data": "across the overlay"})
        assert r == {"event": "result", "id": r["id"], "ok": True, "data": "across the overlay", "relayed": False}

        # 3. a gossipsub message reaches all nodes
        deadline = time.monotonic() + 20
        for p, _ in nodes:
            while not p.command({"cmd": "topic_peers", "topic": TOPIC})["peers"]:
                assert time.monotonic() < deadline, "gossip mesh did not form"
                time.sleep(0.2)
        p0.command({"cmd": "publish", "topic": TOPIC, "data": "to everyone"})
        for p, _ in nodes[1:]:
            ev = p.wait_event(lambda e: e.get("event") == "message", 15)
            assert (ev["data"], ev["from"], ev["topic"]) == ("to everyone", id0, TOPIC)

        # 4. stopping the bootstrap leaves the others connected and able to reach each other
        boot_pid = boot.pid
        boot_ports = _listening_ports(boot_pid)
        assert boot.stop() == 0
        assert not psutil.pid_exists(boot_pid) or psutil.Process(boot_pid).status() == psutil.STATUS_ZOMBIE
        time.sleep(1.0)
        for p, me in nodes:
            r = p.command({"cmd": "peers"})
            assert r["ok"]
            others = set(r["connected"]) - {boot_id}
            assert others, f"{me} lost every peer with the bootstrap"
        for i, (p, _) in enumerate(nodes):
            target = ids[(i + 1) % N_NODES]
            r = p.command({"cmd": "echo", "peer": target, "data": f"still here {i}"}, 20)
            assert r["ok"] and r["data"] == f"still here {i}", r
            r = p.command({"cmd": "ping", "peer": target}, 20)
            assert r["ok"] and r["rtt_ms"] > 0, r
        p4.command({"cmd": "publish", "topic": TOPIC, "data": "after bootstrap"})
        for p, _ in nodes[:-1]:
            ev = p.wait_event(lambda e: e.get("event") == "message", 15)
            assert ev["data"] == "after bootstrap"

        # 5. shutdown leaves no child processes and no open sockets
        pids = [p.pid for p, _ in nodes]
        ports = set().union(*(_listening_ports(pid) for pid in pids)) | boot_ports
        assert len(ports) >= N_NODES + 1
        children_before = {c.pid for c in psutil.Process().children(recursive=True)}
        assert set(pids) <= children_before
    for pid in pids + [boot_pid]:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert not ({c.pid for c in psutil.Process().children(recursive=True)} & (set(pids) | {boot_pid}))
    listening_now = {c.laddr.port for c in psutil.net_connections("tcp") if c.status == "LISTEN"}
    assert not (ports & listening_now), ports & listening_now


def test_nodes_exit_cleanly_on_sigint_and_sigterm(tmp_path):
    import signal

    with LocalSwarm(tmp_path) as swarm:
        swarm.start_bootstrap()
        a, _ = swarm.start_node("a")
        b, _ = swarm.start_node("b")
        assert a.stop(signal.SIGINT) == 0
        assert b.stop(signal.SIGTERM) == 0
        assert "Traceback" not in a.log_path.read_text() + b.log_path.read_text()
