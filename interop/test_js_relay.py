"""shardnet's relay as infrastructure for js-libp2p: one js peer reserves a slot on a shardnet
relay, another reaches it through the circuit with js-libp2p's ordinary dial API, round after
round; circuits cut at the relay's data or time limit end as resets and are logged.

js-libp2p's dialer races duplicate circuits to the same peer and aborts the losers; before the
single-writer fix (compat fix 15) an aborted circuit could cut a frame the relay was writing to
the reserved peer, whose connection to the relay then failed with "Invalid chacha20poly1305
decryption" and took its reservation with it.
"""

import base64
import functools
import logging
import random
import time

import pytest
import trio
from libp2p.peer.id import ID

from checks import until
from foreign import ForeignError, JsPeer, js_available
from shardnet.transport import open_node
from shardnet.transport.nat.relay import RelayLimits

ROUNDS = 50
RELAY_LOG = "shardnet.transport.nat.relay"


async def call(js, cmd, **kw):
    return await trio.to_thread.run_sync(functools.partial(js.call, cmd, **kw))


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


async def _js(tmp_path, name, **opts) -> JsPeer:
    """A js peer with the circuit transport (and no DCUtR: every round must cross the relay;
    neither js peer listens on TCP, so neither can reach the other except through the relay),
    started from a worker thread while the relay in this trio loop serves its reservation."""
    why = js_available()
    if why:
        pytest.fail(f"js-libp2p peer unavailable: {why}")  # never skipped silently
    start = functools.partial(JsPeer, tmp_path, name, circuit=True, dcutr=False,
                              debug="libp2p:circuit-relay*,libp2p:tcp:connection*", **opts)
    return await trio.to_thread.run_sync(start)


async def _reserved(js, relay) -> str:
    """The circuit address js holds on ``relay`` once its reservation is made."""
    def circuit(r):
        return [a for a in r["addrs"] if "/p2p-circuit" in a and str(relay.peer_id) in a]
    got = await until(lambda: call(js, "addrs"), circuit, within=30)
    assert circuit(got), f"js never reserved on the shardnet relay: {got}"
    return f"{relay.listen_addrs[0]}/p2p-circuit/p2p/{js.peer_id}"


async def _relay_conn_ids(js, relay) -> list[str]:
    return [c["id"] for c in (await call(js, "conns"))["conns"] if c["peer"] == str(relay.peer_id)]


def _shardnet_conns(relay, js) -> list[int]:
    return [id(c) for c in relay.host.get_network().get_connections(ID.from_base58(js.peer_id))]


async def test_a_js_peer_reserved_on_a_shardnet_relay_is_reached_by_another_for_50_rounds(
        tmp_path, node_config, caplog):
    caplog.set_level(logging.INFO, logger=RELAY_LOG)
    rng = random.Random(19)
    async with open_node(node_config(relay_service=RelayLimits(reservation_ttl=600))) as relay:
        target = await _js(tmp_path, "js-target", listen=[f"{relay.listen_addrs[0]}/p2p-circuit"])
        dialler = await _js(tmp_path, "js-dialler", listen=[])
        try:
            circuit = await _reserved(target, relay)
            target_conn = await _relay_conn_ids(target, relay)
            shardnet_side = _shardnet_conns(relay, target)
            expire = relay.relay_service.reservations[ID.from_base58(target.peer_id)]
            assert len(target_conn) == 1 and len(shardnet_side) == 1
            for i in range(ROUNDS):
                data = rng.randbytes(rng.choice([64, 4096, 30000]))
                r = await call(dialler, "echo", addr=circuit, data=b64(data), timeout=30)
                assert base64.b64decode(r["data"]) == data, f"round {i}: echo came back different"
                via = [c["remote"] for c in (await call(dialler, "conns"))["conns"] if c["peer"] == target.peer_id]
                assert via and all("/p2p-circuit" in a for a in via), f"round {i}: not through the relay: {via}"
                await call(dialler, "hang_up", peer=target.peer_id)  # the next round dials anew
                # the reserved peer's connection to the relay and its slot survive every round
                assert await _relay_conn_ids(target, relay) == target_conn, f"round {i}: js's relay connection changed"
                assert _shardnet_conns(relay, target) == shardnet_side, f"round {i}: the relay's connection changed"
                assert relay.relay_service.reservations[ID.from_base58(target.peer_id)] == expire
                # js-libp2p accepts 5 inbound connections a second from one address (its
                # inboundConnectionThreshold), and every circuit comes from the relay's
                await trio.sleep(0.3)
            assert relay.relay_service.stats["circuits"] >= ROUNDS
        finally:
            dialler.stop()
            target.stop()
        logs = target.log_path.read_text(errors="replace") + dialler.log_path.read_text(errors="replace")
        assert "decryption" not in logs.lower(), logs[-2000:]
        opened = [r for r in caplog.records if r.getMessage().endswith(" open") and "circuit" in r.getMessage()]
        assert len(opened) >= ROUNDS


@pytest.mark.parametrize("limit", ["data", "time"])
async def test_a_circuit_cut_at_the_relay_limit_ends_as_a_reset_and_is_logged(tmp_path, node_config, caplog, limit):
    caplog.set_level(logging.INFO, logger=RELAY_LOG)
    limits = (RelayLimits(reservation_ttl=600, circuit_bytes=64 << 10) if limit == "data"
              else RelayLimits(reservation_ttl=600, circuit_duration=3))
    async with open_node(node_config(relay_service=limits)) as relay:
        target = await _js(tmp_path, "js-target", listen=[f"{relay.listen_addrs[0]}/p2p-circuit"])
        dialler = await _js(tmp_path, "js-dialler", listen=[])
        try:
            circuit = await _reserved(target, relay)
            target_conn = await _relay_conn_ids(target, relay)
            small = b"ping" * 16
            r = await call(dialler, "echo", addr=circuit, data=b64(small), timeout=30)
            assert base64.b64decode(r["data"]) == small
            if limit == "data":
                big = random.Random(1).randbytes(256 << 10)  # four times the limit
                try:
                    r = await call(dialler, "echo", addr=circuit, data=b64(big), timeout=30)
                    # js closes the streams of a relayed connection whose relay stream was reset
                    # (their status reads "closed"): the echo comes back short
                    assert len(base64.b64decode(r["data"])) < len(big)
                except ForeignError as e:
                    assert "reset" in str(e).lower() or "abort" in str(e).lower(), e
            else:  # nothing in flight: the relayed connection just goes away
                await until(lambda: call(dialler, "conns"),
                            lambda r: target.peer_id not in [c["peer"] for c in r["conns"]], within=15)
            lines = [r.getMessage() for r in caplog.records if " cut: " in r.getMessage()]
            why = "data limit of 65536 bytes" if limit == "data" else "duration limit of 3 s"
            assert any(why in line and target.peer_id[:16] in line for line in lines), lines
            assert any("bytes forward" in line for line in lines)
            # what js saw of the relay's end of the circuit: a reset (its debug log; js's API
            # reports a relayed connection's end the same way whatever the cause)
            await until(lambda: trio.to_thread.run_sync(dialler.log_path.read_text),
                        lambda log: "circuit-relay:connection" in log and "StreamResetError" in log, within=10)
            log = dialler.log_path.read_text()
            assert any("circuit-relay:connection" in line and "StreamResetError" in line for line in log.splitlines()), \
                log[-3000:]
            # the reserved peer keeps its relay connection and slot through the cut
            assert await _relay_conn_ids(target, relay) == target_conn
            assert relay.relay_service.reservations[ID.from_base58(target.peer_id)] > time.time()
        finally:
            dialler.stop()
            target.stop()
