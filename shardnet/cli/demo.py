"""``shardnet demo``: a local swarm of real processes, shown working, then stopped.

The default demo starts a bootstrap node and N compute peers (separate processes on loopback),
each serving a contiguous block of the shipped model's layers, then generates text through them
from this process, printing tokens as they arrive, the layer map and tokens per second.
``--overlay-only`` shows the overlay alone: discovery through the DHT, a custom-protocol stream
between nodes introduced only by the bootstrap, ping, and gossipsub.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import click

from shardnet.testing.localswarm import LocalSwarm
from shardnet.transport.errors import ShardnetError

from .common import fail, model_dir, model_path_option, say

DEFAULT_PROMPT = "def __init__(self"

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

        (first, _), (_, last_id) = members[0], members[-1]
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
        # meshes form within a heartbeat or two; the publisher must also know every subscriber
        # (a node that saw only another subscriber could otherwise miss the message)
        for p, me in members:
            want = ids - {me} if p is first else None
            while True:
                peers = set(p.command({"cmd": "topic_peers", "topic": TOPIC}, timeout)["peers"])
                if (want <= peers) if want is not None else peers:
                    break
                if time.monotonic() > deadline:
                    raise ShardnetError("gossip mesh did not form")
                time.sleep(0.2)
        first.command({"cmd": "publish", "topic": TOPIC, "data": "hello, swarm"}, timeout)
        for i, (p, _) in enumerate(members[1:], start=2):
            ev = p.wait_event(lambda e: e.get("event") == "message", timeout)
            say(f"  node{i} received {ev['data']!r} from {ev['from'][:12]}…")
        say("stopping every process ...")
    say(f"done in {time.monotonic() - t_start:.1f} s")


def run_model_demo(*, model_path, peers: int, prompt: str | None, max_new_tokens: int, timeout: float,
                   say: Callable[[str], None]) -> None:
    import sys

    import trio

    from shardnet.inference.client.client import Client
    from shardnet.inference.model.checkpoint import Checkpoint
    from shardnet.inference.model.layout import split_layers
    from shardnet.inference.model.local_model import LocalModel
    from shardnet.transport import NodeConfig, open_node

    path = model_path
    ckpt = Checkpoint(path)
    ranges = split_layers(ckpt.num_layers, peers)
    prompt = prompt or DEFAULT_PROMPT
    t_start = time.monotonic()
    with LocalSwarm() as swarm:
        say(f"model {path.name}: {ckpt.num_layers} layers, id {ckpt.model_id[:16]}…")
        say("starting a bootstrap node ...")
        boot = swarm.start_bootstrap(timeout)
        say(f"starting {peers} compute peers (each loads only its layers) ...")
        threads = max(1, (os.cpu_count() or 1) // (peers + 1))  # the peers and the client share the cores
        started = [swarm.spawn_node(f"peer{i + 1}", "--layers", f"{a}:{b}", "--model", str(path), "--threads",
                                    str(threads), command="join")
                   for i, (a, b) in enumerate(ranges)]
        for i, (p, (a, b)) in enumerate(zip(started, ranges)):
            ready = swarm.wait_ready(p, timeout)  # "ready" follows "serving"
            say(f"  peer{i + 1} (pid {p.pid}) serves layers {a}:{b} as {ready['peer_id'][:16]}…")

        async def generate() -> None:
            model = await trio.to_thread.run_sync(LocalModel, path)
            async with open_node(NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"], bootstrap=[boot],
                                            dht_mode="client")) as node:
                await node.wait_bootstrapped(timeout)
                client = Client(node, model)
                say(f"generating from {prompt!r} (greedy, {max_new_tokens} tokens):\n")
                sys.stdout.write(prompt)
                async for tok in client.generate(prompt, max_new_tokens=max_new_tokens):
                    sys.stdout.write(tok.text)
                    sys.stdout.flush()
                st = client.last_stats
                say("\n")
                say("layer map (the chain the client used):")
                for c in st.chain:
                    say(f"  layers {c.start:>2}:{c.end:<2}  {c.peer}")
                say(f"{st.new_tokens} tokens at {st.tokens_per_s:.1f} tok/s (decode), "
                    f"prefill of {st.prompt_tokens} tokens in {st.prefill_s * 1000:.0f} ms")

        trio.run(generate)
        say("stopping every process ...")
    say(f"done in {time.monotonic() - t_start:.1f} s")


@click.command()
@model_path_option
@click.option("--prompt", default=None, help="Prompt (default: the start of a Python function).")
@click.option("--max-new-tokens", "-n", default=48, show_default=True)
@click.option("--peers", default=3, show_default=True, help="Compute peers to start.")
@click.option("--timeout", default=120.0, show_default=True, help="Give up after this many seconds.")
@click.option("--overlay-only", is_flag=True, help="Only show the overlay (discovery, streams, gossip).")
def demo(model_path, prompt, max_new_tokens, peers, timeout, overlay_only) -> None:
    """Start a local swarm serving the shipped model, generate, print the layer map, stop it all."""
    try:
        if overlay_only:
            run_overlay_demo(nodes=peers, timeout=timeout, say=say)
        else:
            run_model_demo(model_path=model_dir(model_path), peers=peers, prompt=prompt,
                           max_new_tokens=max_new_tokens, timeout=timeout, say=say)
    except ShardnetError as e:
        fail(str(e))
