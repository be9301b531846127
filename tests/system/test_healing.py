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
from shardnet.inference.server.prefix_store import PAGE
from shardnet.models import default_draft_path, default_model_path
from shardnet.testing.helpers import loopback_config
from shardnet.testing.localswarm import LocalSwarm
from shardnet.transport import open_node

pytestmark = pytest.mark.slow

PROMPT = "def main(args):\n    "
NEW = 24
# spans and how many peers serve each; tests kill peers one by one (in file order)
SPANS = {(0, 4): 2, (4, 8): 5}


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


async def run(bootstrap, table, *, kill_when, drafter=None, depth=1, k=4, tree=False):
    """Generate; ``kill_when(event, info, tokens_so_far, route)`` returns a peer to SIGKILL."""
    async with open_node(loopback_config(bootstrap=[bootstrap], dht_mode="client")) as node:
        await node.wait_bootstrapped()
        client = Client(node, LocalModel(default_model_path()), route_timeout=20)
        return await generate(client, PROMPT, table, kill_when=kill_when, drafter=drafter, depth=depth, k=k,
                              tree=tree)


async def generate(client, prompt, table, *, kill_when, drafter=None, depth=1, k=4, tree=False):
    """``run``'s generation through ``client``: (tokens, stats, [(killed, span)], route)."""
    route, killed, got = [], [], []

    def progress(event, info):
        if event == "route":
            route[:] = [c[0] for c in info["chain"]]
        victim = kill_when(event, info, len(got), route) if not killed else None
        if victim:
            killed.append((victim, kill(table, victim)))

    async for tok in client.generate(prompt, max_new_tokens=NEW, stop_at_eos=False, drafter=drafter,
                                     depth=depth, k=k, tree=tree, branches=k if tree else None,
                                     progress=progress):
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


async def test_a_peer_killed_while_a_tree_of_drafts_is_being_kept(peers, reference):
    """Tree speculation (issue 38): the last hop is killed once a tree's result is in, so the
    next step (which keeps the accepted path) finds it gone: the heal replays the history, kept
    path included, into a new peer, and the output is still plain greedy decoding's."""
    bootstrap, table = peers
    drafter = ModelDrafter(default_draft_path())

    def when(event, info, n, route):
        return route[-1] if event == "token" and n >= 6 else None

    got, stats, killed, _ = await run(bootstrap, table, kill_when=when, drafter=drafter, k=4, tree=True)
    _report("tree", stats)
    assert killed and got == reference
    assert stats.heals and stats.heals[-1].failed == [killed[0][0]]
    assert stats.speculation.drafted > 4 * stats.speculation.verified  # trees went, before and after


async def test_a_peer_killed_mid_decode_of_a_turn_that_reuses_the_last_ones_pages(peers):
    """Prefix reuse on (peers keep a scoped client's pages by default): a chat's first turn leaves
    its pages on its chain's blocks, the second resends it (and more) and reuses them, and its last
    hop is killed mid-decode: the heal replays the whole history into a peer holding none of the
    pages. Both turns equal single-process transformers (float32, the shipped model's dtype)."""
    from shardnet.testing.helpers import transformers_greedy
    from tokenizers import Tokenizer

    bootstrap, table = peers
    tokenizer = Tokenizer.from_file(str(default_model_path() / "tokenizer.json"))
    first = PROMPT + "".join(f"x{i} = args[{i}] * {i + 1}\n    " for i in range(20))
    assert len(tokenizer.encode(first).ids) > 2 * PAGE
    async with open_node(loopback_config(bootstrap=[bootstrap], dht_mode="client")) as node:
        await node.wait_bootstrapped()
        client = Client(node, LocalModel(default_model_path()), route_timeout=20, prefix="chat")
        got1, _, _, route1 = await generate(client, first, table, kill_when=lambda *a: None)
        assert got1 == transformers_greedy(default_model_path(), first, NEW)
        second = first + tokenizer.decode(got1) + "\n    return x0\n\ndef other(args):\n    "

        def when(event, info, n, route):  # the last hop, after 6 tokens of the second turn
            return route[-1] if event == "token" and n == 6 else None

        got2, stats, killed, route2 = await generate(client, second, table, kill_when=when)
    _report("prefix", stats)
    assert route2 == route1  # the second turn went where the first's pages are
    assert killed and got2 == transformers_greedy(default_model_path(), second, NEW)
    heal = stats.heals[-1]
    assert heal.failed == [killed[0][0]] and heal.phase == "decode" and heal.replayed_tokens >= 6


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
