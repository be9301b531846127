"""Mid-request healing: compute peers are separate processes killed with SIGKILL by PID while a
client (in this process) generates; the output must equal plain single-process transformers."""

import os
import signal
import time

import pytest

from shardnet.errors import NoRouteError
from shardnet.inference.client.client import Client
from shardnet.inference.client.speculative import ModelDrafter
from shardnet.inference.model.local_model import LocalModel
from shardnet.models import default_draft_path, default_model_path
from shardnet.testing.helpers import loopback_config
from shardnet.testing.localswarm import LocalSwarm
from shardnet.transport import open_node

pytestmark = pytest.mark.slow

PROMPT = "def main(args):\n    "
NEW = 24
# spans and how many peers serve each; tests kill peers one by one (in file order)
SPANS = {(0, 4): 2, (4, 8): 3}


@pytest.fixture(scope="module")
def peers():
    """{peer_id: (process, (start, end))}; the processes of the spans above, all serving."""
    with LocalSwarm() as swarm:
        swarm.start_bootstrap()
        procs = []
        for (a, b), count in SPANS.items():
            for i in range(count):
                procs.append((swarm.spawn_node(f"p{a}-{i}", "--layers", f"{a}:{b}", "--threads", "1",
                                               command="join"), (a, b)))
        table = {}
        for p, span in procs:
            table[swarm.wait_ready(p, 120)["peer_id"]] = (p, span)
        yield swarm.bootstrap_addr, table


def kill(table, peer):
    p, span = table.pop(peer)
    os.kill(p.pid, signal.SIGKILL)
    p.proc.wait(10)
    return span


async def run(bootstrap, table, *, kill_when, drafter=None, depth=1, k=4):
    """Generate; ``kill_when(event, info, tokens_so_far, route)`` returns a peer to SIGKILL."""
    async with open_node(loopback_config(bootstrap=[bootstrap], dht_mode="client")) as node:
        await node.wait_bootstrapped()
        client = Client(node, LocalModel(default_model_path()), route_timeout=20)
        route, killed, got = [], [], []

        def progress(event, info):
            if event == "route":
                route[:] = [c[0] for c in info["chain"]]
            victim = kill_when(event, info, len(got), route) if not killed else None
            if victim:
                killed.append((victim, kill(table, victim)))

        async for tok in client.generate(PROMPT, max_new_tokens=NEW, stop_at_eos=False, drafter=drafter,
                                         depth=depth, k=k, progress=progress):
            got.append(tok.id)
            progress("token", {})
        return got, client.last_stats, killed, route


def _report(name, stats):
    for h in stats.heals:
        print(f"{name}: healed in {h.seconds:.2f} s ({h.phase}, {h.in_flight} step(s) in flight, "
              f"replayed {h.replayed_tokens} tokens) after {[p[:16] for p in h.failed]} {h.layers} failed: {h.error}")


async def test_a_peer_killed_during_prefill(peers, reference):
    bootstrap, table = peers

    def when(event, info, n, route):  # the prefill has just been sent: kill the chain's last peer
        return route[-1] if event == "sent" and info["step"] == 0 else None

    got, stats, killed, _ = await run(bootstrap, table, kill_when=when)
    _report("prefill", stats)
    assert killed and got == reference
    heal = stats.heals[-1]
    assert heal.failed == [killed[0][0]] and heal.phase == "prefill" and killed[0][0] not in heal.route


async def test_a_peer_killed_mid_decode(peers, reference):
    bootstrap, table = peers

    def when(event, info, n, route):  # the first hop, after 8 tokens
        return route[0] if event == "token" and n == 8 else None

    got, stats, killed, route = await run(bootstrap, table, kill_when=when)
    _report("decode", stats)
    assert killed and got == reference
    heal = stats.heals[-1]
    assert heal.failed == [killed[0][0]] and heal.phase == "decode" and heal.replayed_tokens >= 8
    # only the failed span changed: the other hop is the one the chain had before
    assert heal.route[1:] == route[1:] and heal.route[0] != route[0]


async def test_a_peer_killed_with_speculative_chunks_in_flight(peers, reference):
    bootstrap, table = peers
    drafter = ModelDrafter(default_draft_path())

    def when(event, info, n, route):  # the last hop, once a few chunks are in flight
        return route[-1] if event == "sent" and n >= 6 else None

    got, stats, killed, _ = await run(bootstrap, table, kill_when=when, drafter=drafter, depth=3, k=4)
    _report("speculative", stats)
    assert killed and got == reference
    assert stats.heals and stats.heals[-1].failed == [killed[0][0]]
    assert stats.speculation.chunks > 0


async def test_every_peer_of_a_span_gone_is_a_clear_error_within_the_bound(peers):
    bootstrap, table = peers
    for peer, (_, span) in list(table.items()):
        if span == (0, 4):
            kill(table, peer)
    async with open_node(loopback_config(bootstrap=[bootstrap], dht_mode="client")) as node:
        await node.wait_bootstrapped()
        client = Client(node, LocalModel(default_model_path()), route_timeout=5)
        t0 = time.monotonic()
        with pytest.raises(NoRouteError, match=r"no live peer serves layers 0-3"):
            async for _ in client.generate(PROMPT, max_new_tokens=4):
                pass
        # the dead peers' claims live on in the DHT until they expire: they are tried, fail,
        # and are routed around; the bound is the route timeout plus that probing
        assert time.monotonic() - t0 < 5 + 30
