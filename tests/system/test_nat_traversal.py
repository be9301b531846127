"""NAT traversal in the NAT lab (shardnet/testing/natlab.py): real `shardnet` processes in network
namespaces behind nftables masquerade."""

import sys
import threading
import time

import pytest

from shardnet.testing import natlab
from shardnet.testing.localswarm import ShardnetProcess

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(natlab.available() is not None, reason=f"NAT lab: {natlab.available()}")]


def _relay_and_two_nats(lab, tmp_path, *, b_nat: str = "cone"):
    """A public relay, host a behind a cone NAT and host b behind ``b_nat``; the relay's process
    and address."""
    lab.add_public("relay")
    lab.add_private("a", "cone")
    lab.add_private("b", b_nat)
    return lab.start_relay("relay", tmp_path)


def test_peers_behind_two_nats_talk_through_a_relay(tmp_path):
    with natlab.NatLab() as lab:
        relay, relay_addr = _relay_and_two_nats(lab, tmp_path)
        a, a_id = lab.start_node("a", tmp_path, "--relay", relay_addr, "--no-hole-punch")
        b, b_id = lab.start_node("b", tmp_path, "--no-hole-punch")
        st = natlab.wait_reserved(a, relay_addr)
        circuit = f"{relay_addr}/p2p-circuit/p2p/{a_id}"
        assert any(addr == circuit for addr in st["addrs"]), st["addrs"]  # advertised
        # the NAT is real: B cannot dial A's public address directly
        direct = b.command({"cmd": "connect", "addr": f"/ip4/{lab.public_ip('a')}/tcp/4001/p2p/{a_id}",
                            "timeout": 3})
        assert direct["ok"] is False, direct
        r = b.command({"cmd": "connect", "addr": circuit})
        assert r["ok"], r
        assert r["connections"] and all(c["relayed"] for c in r["connections"]), r
        echo = b.command({"cmd": "echo", "peer": a_id, "data": "through two NATs"})
        assert echo["ok"] and echo["data"] == "through two NATs", echo
        seen_by_a = a.command({"cmd": "status"})["connections"][b_id]
        assert seen_by_a and all(c["relayed"] for c in seen_by_a), seen_by_a


def test_inference_across_three_nats(tmp_path):
    """Two compute peers behind two NATs, the client behind a third. Every edge (client -> p0 ->
    p1 -> client) starts on the relay and is hole-punched; greedy output equals transformers
    on the first run and again once activation streams run over the punched connections."""
    from shardnet.inference.model.local_model import LocalModel
    from shardnet.models import default_model_path
    from shardnet.testing.helpers import transformers_greedy

    prompt, n = "def main(", 12
    want = prompt + LocalModel(default_model_path()).decode(transformers_greedy(default_model_path(), prompt, n))

    procs = []
    with natlab.NatLab() as lab:
        lab.add_public("relay")
        for name in ("p0", "p1", "client"):
            lab.add_private(name, "cone")
        try:
            relay, relay_addr = lab.start_relay("relay", tmp_path)
            peers = []
            for i, layers in enumerate(("0:4", "4:8")):
                p = ShardnetProcess(f"p{i}", ["join", "--events", "--identity", str(tmp_path / f"p{i}.key"),
                                              "--listen", "/ip4/0.0.0.0/tcp/4001", "--layers", layers, "--threads", "1",
                                              "--bootstrap", relay_addr, "--relay", relay_addr],
                                    workdir=tmp_path, prefix=lab.prefix(f"p{i}"))
                procs.append(p)
                peers.append(p)
            ids = [p.wait_event(lambda e: e.get("event") == "ready", 120)["peer_id"] for p in peers]
            for run in range(2):
                client = ShardnetProcess(f"client{run}", ["generate", "--bootstrap", relay_addr, "--relay", relay_addr,
                                                          "-n", str(n), "--route-timeout", "60", prompt],
                                         workdir=tmp_path, prefix=lab.prefix("client"))
                procs.append(client)
                text = client.wait_for_line(lambda s: s.startswith("-- ") or s.startswith("error"), 180)
                lines = [line for line in client.seen if not line.startswith("-- ")]
                assert "\n".join(lines) == want, (run, lines, want, client.tail_log())
                assert "tok/s" in text
                client.stop()
                if run == 0:  # the compute peers know each other by now: their edge goes direct
                    natlab.wait_direct(peers[0], ids[1], timeout=60)
            served = peers[1].command({"cmd": "status"})["streams_served"]
            assert served.get("/shardnet/activation/1.0.0 direct", 0) >= 1, served
        finally:
            for p in procs:
                p.stop()


def test_hole_punch_through_two_cone_nats(tmp_path):
    with natlab.NatLab() as lab:
        relay, relay_addr = _relay_and_two_nats(lab, tmp_path)
        a, a_id = lab.start_node("a", tmp_path, "--bootstrap", relay_addr, "--relay", relay_addr)
        b, b_id = lab.start_node("b", tmp_path, "--bootstrap", relay_addr)
        natlab.wait_reserved(a, relay_addr)
        r = b.command({"cmd": "connect", "addr": f"{relay_addr}/p2p-circuit/p2p/{a_id}"})
        assert r["ok"], r
        st_a = natlab.wait_direct(a, b_id)
        natlab.wait_direct(b, a_id)
        punch = st_a["nat"]["hole_punches"][b_id]  # A accepted the relayed connection: it punched
        assert punch["ok"] and punch["attempts"] >= 1, punch
        echo = b.command({"cmd": "echo", "peer": a_id, "data": "punched"})
        assert echo["ok"] and echo["data"] == "punched" and echo["relayed"] is False, echo
        # the relayed connection is retired once idle: only the direct one stays
        st = natlab.wait_status(a, lambda st: not any(c["relayed"] for c in st["connections"].get(b_id, [])), 10,
                          "retirement of the relayed connection")
        served = st["streams_served"]
        assert served.get("/shardnet/echo/1.0.0 direct", 0) >= 1, served

        # scenario 3: the relay goes away; A and B keep talking over their own connection
        relay.stop()
        for i in range(3):
            echo = b.command({"cmd": "echo", "peer": a_id, "data": f"still here {i}"})
            assert echo["ok"] and echo["data"] == f"still here {i}" and echo["relayed"] is False, echo
            echo = a.command({"cmd": "echo", "peer": b_id, "data": f"and here {i}"})
            assert echo["ok"] and echo["relayed"] is False, echo
            time.sleep(1)


def test_peers_that_dial_each_other_through_the_relay_at_once_punch_once(tmp_path):
    """Both sides accept a relayed connection from the other, so both would start DCUtR: two
    upgrades at once dial the same address pair twice in opposite roles and all fail. The glare
    rule lets one go on (holepunch.py); the pair ends direct."""
    with natlab.NatLab() as lab:
        relay, relay_addr = _relay_and_two_nats(lab, tmp_path)
        a, a_id = lab.start_node("a", tmp_path, "--bootstrap", relay_addr, "--relay", relay_addr)
        b, b_id = lab.start_node("b", tmp_path, "--bootstrap", relay_addr, "--relay", relay_addr)
        natlab.wait_reserved(a, relay_addr)
        natlab.wait_reserved(b, relay_addr)
        replies = {}
        dials = [threading.Thread(target=lambda me=me, other=other, name=name: replies.__setitem__(
                     name, me.command({"cmd": "connect", "addr": f"{relay_addr}/p2p-circuit/p2p/{other}"})))
                 for me, other, name in ((a, b_id, "a"), (b, a_id, "b"))]
        for t in dials:
            t.start()
        for t in dials:
            t.join(60)
        assert replies["a"]["ok"] and replies["b"]["ok"], replies
        st_a = natlab.wait_direct(a, b_id, timeout=40)
        st_b = natlab.wait_direct(b, a_id, timeout=10)
        echo = b.command({"cmd": "echo", "peer": a_id, "data": "once"})
        assert echo["ok"] and echo["relayed"] is False, echo
        stats = [st["nat"]["hole_punch_stats"] for st in (st_a, st_b)]
        assert sum(s.get("succeeded", 0) for s in stats) >= 1, stats


def test_symmetric_nat_punch_fails_in_bounded_time_and_the_relay_keeps_working(tmp_path):
    with natlab.NatLab() as lab:
        relay, relay_addr = _relay_and_two_nats(lab, tmp_path, b_nat="symmetric")
        a, a_id = lab.start_node("a", tmp_path, "--bootstrap", relay_addr, "--relay", relay_addr)
        b, b_id = lab.start_node("b", tmp_path, "--bootstrap", relay_addr)
        natlab.wait_reserved(a, relay_addr)
        t0 = time.monotonic()
        assert b.command({"cmd": "connect", "addr": f"{relay_addr}/p2p-circuit/p2p/{a_id}"})["ok"]
        while True:  # A (which accepted the relayed connection) punches, and says how it went
            punch = a.command({"cmd": "status"})["nat"]["hole_punches"].get(b_id)
            if punch is not None:
                break
            assert time.monotonic() - t0 < 60, "no hole punch outcome within 60 s"
            time.sleep(0.5)
        assert punch["ok"] is False and punch["attempts"] == 3, punch
        assert "no direct connection" in punch["detail"], punch
        assert punch["seconds"] < 30, punch  # 3 attempts of at most 5 s each, plus the exchanges
        st = a.command({"cmd": "status"})
        assert st["connections"][b_id] and all(c["relayed"] for c in st["connections"][b_id]), st
        echo = b.command({"cmd": "echo", "peer": a_id, "data": "via the relay"})
        assert echo["ok"] and echo["data"] == "via the relay" and echo["relayed"] is True, echo
        log_text = a.log_path.read_text()
        assert "hole punch to" in log_text and "failed after 3 attempt" in log_text, a.tail_log()


def test_autonat_tells_public_from_private_and_private_peers_find_a_relay(tmp_path):
    with natlab.NatLab() as lab:
        lab.add_public("relay")
        lab.add_public("pub")
        lab.add_private("priv", "cone")
        relay, relay_addr = lab.start_relay("relay", tmp_path)
        pub, _ = lab.start_node("pub", tmp_path, "--bootstrap", relay_addr)
        priv, priv_id = lab.start_node("priv", tmp_path, "--bootstrap", relay_addr)
        rid = relay_addr.rsplit("/p2p/", 1)[1]
        deadline = time.monotonic() + 60
        while True:
            st_pub, st_priv = pub.command({"cmd": "status"}), priv.command({"cmd": "status"})
            if (st_pub["nat"]["reachability"] != "unknown" and st_priv["nat"]["reachability"] != "unknown"
                    and st_priv["nat"]["relay_slots"]):
                break
            assert time.monotonic() < deadline, (st_pub["nat"], st_priv["nat"])
            time.sleep(0.5)
        assert st_pub["nat"]["reachability"] == "public", st_pub["nat"]
        assert st_pub["nat"]["public_addrs"] == [f"/ip4/{lab.ip('pub')}/tcp/4001"], st_pub["nat"]
        assert st_priv["nat"]["reachability"] == "private", st_priv["nat"]
        assert lab.public_ip("priv") in st_priv["nat"]["observed_ips"], st_priv["nat"]
        # no --relay given: the private peer found the relay among its peers and advertises it
        assert rid in st_priv["nat"]["relay_slots"], st_priv["nat"]
        assert f"{relay_addr}/p2p-circuit/p2p/{priv_id}" in st_priv["addrs"], st_priv["addrs"]
        # and a public peer reaches it through that address
        assert pub.command({"cmd": "connect", "addr": f"{relay_addr}/p2p-circuit/p2p/{priv_id}"})["ok"]
        echo = pub.command({"cmd": "echo", "peer": priv_id, "data": "found you"})
        assert echo["ok"] and echo["data"] == "found you", echo
        # `shardnet status` answers the same question for a newcomer on either machine
        for host, want in (("priv", "private"), ("pub", "public")):
            r = lab.run(host, [sys.executable, "-m", "shardnet", "status", "--bootstrap", relay_addr,
                               "--listen", "/ip4/0.0.0.0/tcp/4002"], timeout=60, check=False)
            assert r.returncode == 0, r.stderr[-2000:]
            assert f"reachability: {want}" in r.stdout, r.stdout
            if want == "private":
                assert "reachable through relays at:" in r.stdout and "/p2p-circuit" in r.stdout, r.stdout
            else:
                assert f"public addresses: /ip4/{lab.ip('pub')}/tcp/4002" in r.stdout, r.stdout
