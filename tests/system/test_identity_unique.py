"""One identity, one live node: a second node with an identity already live in the swarm refuses
to start (identity_check.py), and the original keeps its connection and its records."""

import json
import re
import subprocess

import pytest
import trio

from shardnet.inference.model.checkpoint import Checkpoint
from shardnet.models import default_model_path
from shardnet.testing.localswarm import LocalSwarm, ShardnetProcess, shardnet_argv
from shardnet.transport import identity, open_node
from shardnet.transport.identity_check import DuplicateIdentity


async def test_a_second_node_with_a_live_identity_is_refused_and_the_first_keeps_its_addresses(loopback_config):
    kp = identity.generate()
    async with open_node(loopback_config()) as boot:
        cfg = loopback_config(bootstrap=[str(boot.listen_addrs[0])], key_pair=kp)
        async with open_node(cfg) as first:
            own = {str(a).split("/p2p/")[0] for a in first.listen_addrs}
            with pytest.raises(DuplicateIdentity, match=r"identity \S+ is already live in the swarm at /ip4/127\.0\.0\.1/tcp/\d+; "):
                async with open_node(cfg) as second:
                    pytest.fail(f"the duplicate started: {second.listen_addrs}")
            with trio.fail_after(10):  # the duplicate's connection goes with it
                while len(boot.host.get_network().get_connections(first.peer_id)) > 1:
                    await trio.sleep(0.05)
            assert first.peer_id in boot.peers() and await boot.ping(first.peer_id) > 0
            # the bootstrap comes back to the original's addresses (the duplicate's identify had
            # replaced them), and stays there
            def held():
                return {str(a).split("/p2p/")[0] for a in boot.addrs_of(first.peer_id)}

            with trio.fail_after(10):
                while held() != own:
                    await trio.sleep(0.05)
            await trio.sleep(1.5)
            assert held() == own
            # a throwaway identity, or the same one once the first has gone, starts as usual
            async with open_node(loopback_config(bootstrap=cfg.bootstrap)) as other:
                assert other.peer_id != first.peer_id
        with trio.fail_after(10):
            while boot.host.get_network().get_connections(first.peer_id):
                await trio.sleep(0.05)
        async with open_node(cfg) as again:
            assert again.peer_id == first.peer_id


@pytest.mark.slow
def test_a_duplicate_process_exits_with_one_error_line_and_the_original_stays_in_status_and_peers(tmp_path):
    """A compute peer serves the whole model; a second `join` with its identity file is refused
    before it loads or claims anything; `status` and `peers` still show the original at its own
    address, and it still answers."""
    n_layers = Checkpoint(default_model_path()).num_layers
    with LocalSwarm(tmp_path) as swarm:
        swarm.start_bootstrap()
        first, ready = swarm.start_node("first", "--layers", f"0:{n_layers}", "--threads", "1", command="join")
        pid = ready["peer_id"]
        first_addrs = {a.split("/p2p/")[0] for a in ready["addrs"]}
        dup = ShardnetProcess("dup", ["join", "--identity", str(tmp_path / "first.key"), "--listen",
                                      "/ip4/127.0.0.1/tcp/0", "--bootstrap", swarm.bootstrap_addr, "--layers", "0:2"],
                              workdir=tmp_path)
        swarm.procs.append(dup)
        rc = dup.proc.wait(120)
        log = dup.log_path.read_text(errors="replace")
        errors = [line for line in log.splitlines() if line.startswith("error:")]
        assert rc != 0 and len(errors) == 1, log[-2000:]
        port = ready["addrs"][0].split("/tcp/")[1].split("/")[0]  # named at the original's own address
        assert re.match(rf"error: identity {pid[:6]}…{pid[-6:]} is already live in the swarm at /ip4/127\.0\.0\.1/tcp/{port}; ",
                        errors[0]), errors
        assert "loading layers" not in log  # refused before it loaded (or claimed) anything
        assert first.alive()
        r = subprocess.run(shardnet_argv("peers", "--bootstrap", swarm.bootstrap_addr, "--json", "--wait", "3"),
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        found = {p["peer_id"]: p for p in json.loads(r.stdout)["peers"]}
        assert pid in found, found
        listed = {a.split("/p2p/")[0] for a in found[pid]["addrs"]}
        assert listed and listed <= first_addrs, (listed, first_addrs)
        r = subprocess.run(shardnet_argv("status", "--bootstrap", swarm.bootstrap_addr, "--json", "--wait", "10"),
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        sw = json.loads(r.stdout)["swarm"]
        assert sw["complete"] and [p["peer_id"] for p in sw["peers"]] == [pid], sw
        r = subprocess.run(shardnet_argv("ping", ready["addrs"][0], "--count", "1"), capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stderr[-2000:]
