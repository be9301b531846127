"""NAT traversal in the NAT lab (shardnet/natlab.py): real `shardnet` processes in network
namespaces behind nftables masquerade."""

import time

import pytest

from shardnet import natlab
from shardnet.localswarm import ShardnetProcess

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(natlab.available() is not None, reason=f"NAT lab: {natlab.available()}")]


def _start_relay(lab, tmp_path, procs):
    relay = ShardnetProcess("relay", ["relay", "--identity", str(tmp_path / "relay.key"), "--listen",
                                      "/ip4/0.0.0.0/tcp/4001", "--reservation-ttl", "30"],
                            workdir=tmp_path, prefix=lab.prefix("relay"))
    procs.append(relay)
    rid = relay.wait_for_line(lambda s: s.startswith("relay node "), 60).split()[-1]
    relay.wait_for_line(lambda s: s.startswith("ready"), 30)
    return f"/ip4/{lab.ip('relay')}/tcp/4001/p2p/{rid}"


def _start_node(lab, tmp_path, procs, name, *extra):
    p = ShardnetProcess(name, ["node", "--events", "--identity", str(tmp_path / f"{name}.key"), "--listen",
                               "/ip4/0.0.0.0/tcp/4001", *extra], workdir=tmp_path, prefix=lab.prefix(name))
    procs.append(p)
    ready = p.wait_event(lambda e: e.get("event") == "ready", 60)
    return p, ready["peer_id"]


def _wait_reserved(p, relay_addr, timeout=30):
    rid = relay_addr.rsplit("/p2p/", 1)[1]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = p.command({"cmd": "status"})
        if rid in st["reservations"]:
            return st
        time.sleep(0.5)
    raise AssertionError(f"no reservation at {rid} within {timeout} s: {st}")


def test_peers_behind_two_nats_talk_through_a_relay(tmp_path):
    procs = []
    with natlab.NatLab() as lab:
        lab.add_public("relay")
        lab.add_private("a", "cone")
        lab.add_private("b", "cone")
        try:
            relay_addr = _start_relay(lab, tmp_path, procs)
            a, a_id = _start_node(lab, tmp_path, procs, "a", "--relay", relay_addr)
            b, b_id = _start_node(lab, tmp_path, procs, "b")
            st = _wait_reserved(a, relay_addr)
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
        finally:
            for p in procs:
                p.stop()


def test_inference_across_three_nats_through_a_relay(tmp_path):
    """Two compute peers behind two NATs, the client behind a third: every edge of the chain
    (client -> p0 -> p1 -> client) runs through the relay; greedy output equals transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    from shardnet.inference.client import LocalModel
    from shardnet.models import default_model_path

    prompt, n = "def main(", 12
    model = LocalModel(default_model_path())
    ref = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32).eval()
    ids = model.encode(prompt)
    with torch.inference_mode():
        out = ref.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    want = prompt + model.decode(out[0, len(ids):].tolist())

    procs = []
    with natlab.NatLab() as lab:
        lab.add_public("relay")
        for name in ("p0", "p1", "client"):
            lab.add_private(name, "cone")
        try:
            relay_addr = _start_relay(lab, tmp_path, procs)
            for i, layers in enumerate(("0:4", "4:8")):
                p = ShardnetProcess(f"p{i}", ["join", "--events", "--identity", str(tmp_path / f"p{i}.key"),
                                              "--listen", "/ip4/0.0.0.0/tcp/4001", "--layers", layers, "--threads", "1",
                                              "--bootstrap", relay_addr, "--relay", relay_addr],
                                    workdir=tmp_path, prefix=lab.prefix(f"p{i}"))
                procs.append(p)
            for p in procs[1:]:
                p.wait_event(lambda e: e.get("event") == "ready", 120)
            client = ShardnetProcess("client", ["generate", "--bootstrap", relay_addr, "--relay", relay_addr,
                                                "-n", str(n), "--route-timeout", "60", prompt],
                                     workdir=tmp_path, prefix=lab.prefix("client"))
            procs.append(client)
            text = client.wait_for_line(lambda s: s.startswith("-- ") or s.startswith("error"), 180)
            lines = [line for line in client.seen if not line.startswith("-- ")]
            assert "\n".join(lines) == want, (lines, want, client.tail_log())
            assert "tok/s" in text
        finally:
            for p in procs:
                p.stop()
