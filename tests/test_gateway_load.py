"""Concurrent users through `shardnet serve`, as processes, with the official `openai` client
and default limits: many requests at once come back with the texts they get alone, and users
sending requests for two minutes see no failure while replicas die and come back. The helpers
are bench/gateway_load.py's (the bench prints the same figures, before and after)."""

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from gateway_load import Load, api, burst, complete, one_request, swarm_with_gateway, users  # noqa: E402

pytestmark = pytest.mark.slow

PROMPTS = ["def main(args):\n    ", "import os\n", "class Parser:\n    def ", "for i in range(",
           "    return ", "# Copyright", "with open(path) as f:\n", "if __name__ == "]


def test_64_concurrent_requests_get_the_texts_they_get_alone():
    """More requests at once than a compute peer allows one upstream peer sessions (16): the
    rest wait in line instead of failing, and every text is the one-by-one text."""
    with swarm_with_gateway(replicas=1) as (_, _, url):
        client = api(url)
        alone = {p: complete(client, p) for p in PROMPTS}  # one by one
        load = Load()
        start = threading.Barrier(64)
        t0 = time.monotonic()

        def one(i: int) -> None:
            c = api(url)
            start.wait()
            one_request(c, load, alone[PROMPTS[i % len(PROMPTS)]], PROMPTS[i % len(PROMPTS)])

        threads = [threading.Thread(target=one, args=(i,)) for i in range(64)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        print(f"\n{load.summary('64 at once: ')} in {time.monotonic() - t0:.1f} s")
        assert load.requests == 64, load.summary()
        assert load.failures == 0, (load.summary(), load.examples)
        # and a second burst, right after (nothing left over from the first: slots, probes)
        again = burst(url, 16, alone[PROMPTS[0]])
        print(again.summary("16 more at once: "))
        assert again.failures == 0, (again.summary(), again.examples)


def test_16_users_for_two_minutes_while_replicas_die_and_come_back():
    """Two peers per span. A third of the way in, one replica of the first span is killed
    (SIGKILL) and restarted with the same identity; once it serves again, the other replica of
    that span is killed, so the restarted peer is the span's only one: it must be routed through
    again (it failed during requests, and claimed its layers anew). Not one request may fail."""
    seconds = 120.0
    with swarm_with_gateway(replicas=2) as (swarm, peers, url):
        expected = complete(api(url))
        first = [(pid, p) for pid, p, span in peers if span == (0, 4)]
        (a_id, a), (b_id, b) = first
        load = Load()
        events: list[str] = []
        t0 = time.monotonic()

        def chaos() -> None:
            time.sleep(seconds / 4)
            os.kill(a.pid, signal.SIGKILL)
            a.proc.wait(10)
            events.append(f"{time.monotonic() - t0:.0f} s: killed {a_id[:12]} (replica of 0:4)")
            time.sleep(5)
            again = swarm.spawn_node(a.name, "--layers", "0:4", "--threads", "1", command="join")
            ready = swarm.wait_ready(again, 90)
            assert ready["peer_id"] == a_id
            events.append(f"{time.monotonic() - t0:.0f} s: {a_id[:12]} serves again")
            time.sleep(12)  # past one background refresh of the gateway's claims
            os.kill(b.pid, signal.SIGKILL)
            b.proc.wait(10)
            events.append(f"{time.monotonic() - t0:.0f} s: killed {b_id[:12]}: {a_id[:12]} is 0:4's only peer")

        failed_chaos: list[BaseException] = []

        def run_chaos() -> None:
            try:
                chaos()
            except BaseException as e:  # reported below
                failed_chaos.append(e)

        t = threading.Thread(target=run_chaos)
        t.start()
        users(url, 16, seconds, expected, load=load)
        t.join(120)
        print("\n" + "\n".join(events))
        print(load.summary("16 users x 120 s, replicas killed and restarted: "))
        assert not failed_chaos, failed_chaos
        assert len(events) == 3, events
        assert load.failures == 0, (load.summary(), load.examples)
        # and the restarted peer alone serves its span now
        last = Load()
        one_request(api(url), last, expected)
        assert last.failures == 0, last.examples
