"""``shardnet demo``: a local swarm of real processes, shown working, then stopped.

Until model serving lands, the demo exercises the overlay itself: a bootstrap node and N nodes as
separate processes discover each other through the DHT, exchange a gossipsub message, open a
custom-protocol stream between two nodes introduced only by the bootstrap, and ping each other.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from .localswarm import LocalSwarm
from .transport.errors import ShardnetError

TOPIC = "shardnet-demo"


def run_overlay_demo(*, nodes: int, timeout: float, say: Callable[[str], None]) -> None:
    if nodes < 2:
        raise ShardnetError("the demo needs at least 2 nodes")
    t_start = time.monotonic()
    with LocalSwarm() as swarm:
        say("starting a bootstrap node ...")
        boot = swarm.start_bootstrap(timeout)
        say(f"  bootstrap at {boot}")
        members = []
        for i in range(nodes):
            p, ready = swarm.start_node(f"node{i + 1}", "--subscribe", TOPIC, timeout=timeout)
            members.append((p, ready["peer_id"]))
            say(f"  node{i + 1} (pid {p.pid}) is {ready['peer_id']}")
        ids = {pid for _, pid in members}

        say("waiting for every node to discover every other through the DHT ...")
        t0 = time.monotonic()
        for p, me in members:
            want = ids - {me}
            seen: set[str] = set()
            while not want <= seen:
                ev = p.next_event(timeout - (time.monotonic() - t_start))
                if ev.get("event") == "discovered":
                    seen.add(ev["peer_id"])
        say(f"  all {nodes} nodes know each other after {time.monotonic() - t0:.2f} s")

        (first, first_id), (last, last_id) = members[0], members[-1]
        say(f"custom-protocol stream node1 -> node{nodes} (echo) ...")
        r = first.command({"cmd": "echo", "peer": last_id, "data": "hello over the overlay"}, timeout)
        if not r["ok"]:
            raise ShardnetError(f"echo failed: {r['error']}")
        say(f"  echoed back: {r['data']!r}")

        r = first.command({"cmd": "ping", "peer": last_id}, timeout)
        if not r["ok"]:
            raise ShardnetError(f"ping failed: {r['error']}")
        say(f"  ping node1 -> node{nodes}: {r['rtt_ms']:.2f} ms")

        say(f"gossipsub: node1 publishes on {TOPIC!r} ...")
        deadline = time.monotonic() + timeout
        for p, _ in members[1:]:  # meshes form within a heartbeat or two
            while len(p.command({"cmd": "topic_peers", "topic": TOPIC}, timeout)["peers"]) == 0:
                if time.monotonic() > deadline:
                    raise ShardnetError("gossip mesh did not form")
                time.sleep(0.2)
        first.command({"cmd": "publish", "topic": TOPIC, "data": "hello, swarm"}, timeout)
        for i, (p, _) in enumerate(members[1:], start=2):
            ev = p.wait_event(lambda e: e.get("event") == "message", timeout)
            say(f"  node{i} received {ev['data']!r} from {ev['from'][:12]}…")
        say("stopping every process ...")
    say(f"done in {time.monotonic() - t_start:.1f} s")
