"""Concurrent users through `shardnet serve`, as processes, with the official `openai` client
and default limits: many requests at once come back with the texts they get alone, and users
sending requests for 75 s see no failure while replicas die and come back. The helpers
are bench/gateway_load.py's (the bench prints the same figures, before and after)."""

import concurrent.futures
import threading
import time

import pytest

from bench.gateway_load import (
    PROMPTS,
    Load,
    TieCheck,
    burst,
    complete,
    one_request,
    replica_chaos,
    swarm_with_gateway,
    users,
)
from shardnet.testing.helpers import openai_client

pytestmark = pytest.mark.slow



@pytest.mark.parametrize("join_args", [("--batch-tokens", "0"), ()], ids=["one-at-a-time", "batched"])
def test_64_concurrent_requests_get_the_texts_they_get_alone(join_args):
    """More requests at once than a compute peer allows one upstream peer sessions (16): the
    rest wait in line instead of failing, and every text is the one-by-one text; with the peers
    batching concurrent sessions' steps (continuous batching) as without, where a text may also
    swap two tokens at a near tie (bench/gateway_load.py's TieCheck: batched float16 passes round
    differently from a step alone) and nothing else."""
    ties = TieCheck() if join_args == () else None  # one at a time: every step alone, every text the same
    with swarm_with_gateway(replicas=1, join_args=join_args) as (_, _, url):
        client = openai_client(url, timeout=170)
        alone = {p: complete(client, p) for p in PROMPTS}  # one by one
        load = Load()
        start = threading.Barrier(64)
        t0 = time.monotonic()

        def one(i: int) -> None:
            c = openai_client(url, timeout=170)
            start.wait()
            one_request(c, load, alone[PROMPTS[i % len(PROMPTS)]], PROMPTS[i % len(PROMPTS)], ties=ties)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(64)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        print(f"\n{load.summary('64 at once: ')} in {time.monotonic() - t0:.1f} s")
        assert load.requests == 64, load.summary()
        assert load.failures == 0, (load.summary(), load.examples)
        # and a second burst, right after (nothing left over from the first: slots, probes)
        again = burst(url, 16, alone[PROMPTS[0]], ties)
        print(again.summary("16 more at once: "))
        assert again.failures == 0, (again.summary(), again.examples)


def test_16_users_see_no_failure_while_replicas_die_and_come_back():
    """Two peers per span (bench/gateway_load.py's replica_chaos). A quarter of the way in, one
    replica of the first span is killed (SIGKILL) and restarted with the same identity; once it
    serves again, the other replica of that span is killed, so the restarted peer is the span's
    only one: it must be routed through again (it failed during requests, and claimed its
    layers anew). Not one request may fail."""
    seconds = 75.0  # (the bench's run: 120 s; here the restarted peer serves alone for ~20 s of it)
    ties = TieCheck()  # (the peers batch: near ties allowed, as above)
    with swarm_with_gateway(replicas=2) as (swarm, peers, url):
        expected = complete(openai_client(url, timeout=170))
        events: list[str] = []
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            chaos = pool.submit(replica_chaos, swarm, peers, seconds, events)
            load = users(url, 16, seconds, expected, ties=ties)
            chaos.result()  # (raises what went wrong there)
        print("\n" + "\n".join(events))
        print(load.summary("16 users x 75 s, replicas killed and restarted: "))
        assert len(events) == 3, events
        assert load.failures == 0, (load.summary(), load.examples)
        # and the restarted peer alone serves its span now
        last = Load()
        one_request(openai_client(url, timeout=170), last, expected, ties=ties)
        assert last.failures == 0, last.examples
