"""Writes cut at random points, and whether the connection they share survives them.

    python -m bench.cancel_torture [--rounds 1500] [--paths direct,relayed] [--seed 1] [--quick]

Two nodes in one process share one connection, direct or through a relay (a circuit, Noise and
Yamux end to end, over each endpoint's connection to the relay). Several tasks at once open a
stream and write 1 MiB into it in parts of 64 B to 256 KiB, and the write is cut at a random point in one of three ways:
a ``move_on_after`` deadline, the cancellation of the nursery the writer runs in, or a reset of
the stream from another task. After each cut the same task opens a fresh stream on the same
connection and echoes 64 bytes: a failure there is a connection the cut broke. Meanwhile two
more streams on that connection echo a steady flow of random data, checked byte for byte at the
end. Counted: writes cut, follow-up echoes that failed, Noise decryption errors logged anywhere,
connections replaced (the endpoints', and for a relayed path each endpoint's connection to the
relay), and whether the busy streams' bytes came back exact.

tests/integration/test_cancel_safety.py runs this and asserts zero failures. Before the single-writer fix
(compat fix 15) the same scenario broke most connections it cut (docs/benchmarks.md).
"""

from __future__ import annotations

import hashlib
import logging
import random
import sys
import time
from dataclasses import dataclass, field
from functools import partial

import trio

from bench._common import bench_parser, format_table  # noqa: E402
from shardnet.testing.factories import echo_handler  # noqa: E402
from shardnet.testing.helpers import loopback_config  # noqa: E402
from shardnet.transport import open_node  # noqa: E402
from shardnet.transport.config import NodeConfig  # noqa: E402
from shardnet.transport.limits import Limits  # noqa: E402
from shardnet.transport.nat.relay import RelayLimits  # noqa: E402

PAYLOAD = 1 << 20
CUTS = ("deadline", "nursery", "reset")
DECRYPT_ERRORS = ("failed authentication", "decrypt", "invalidtag", "noiseinvalidmessage")


@dataclass
class Result:
    path: str
    writes: int = 0
    cut: int = 0  # writes that were still in progress when cut
    by_kind: dict = field(default_factory=lambda: {k: 0 for k in CUTS})
    follow_up_failures: int = 0
    decryption_errors: int = 0
    connections_replaced: int = 0
    busy_bytes: int = 0
    busy_exact: bool = True
    seconds: float = 0.0
    first_failures: list = field(default_factory=list)

    @property
    def failures(self) -> int:
        return (self.follow_up_failures + self.decryption_errors + self.connections_replaced
                + (not self.busy_exact))


class _DecryptionErrors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage().lower()
        except Exception:
            return
        if record.exc_info and record.exc_info[1] is not None:
            text += " " + type(record.exc_info[1]).__name__.lower() + " " + str(record.exc_info[1]).lower()
        if any(k in text for k in DECRYPT_ERRORS):
            self.count += 1


def torture_config(**kw) -> NodeConfig:
    # Hundreds of streams a second to one peer is the point here, not an attack to refuse.
    return loopback_config(dial_timeout=10.0, limits=Limits(stream_rate_per_peer=1e6, stream_burst_per_peer=10**6),
                           **kw)


async def _sink(stream) -> None:
    try:
        while await stream.read_some(1 << 20, timeout=30):
            pass
    except Exception:
        pass


def _conns(node, peer) -> list:
    return list(node.host.get_network().get_connections(peer))


async def _cut_write(node, target, rng: random.Random, kind: str) -> bool:
    """One 1 MiB write cut in the way ``kind`` says; whether it was still in progress."""
    s = await node.new_stream(target, "/t/sink", timeout=10)
    payload = rng.randbytes(PAYLOAD)
    delay = rng.uniform(0, 0.01)
    finished = False

    async def write() -> None:
        nonlocal finished
        try:
            pos = 0
            while pos < len(payload):  # as applications write: a header, then parts of a body
                n = rng.choice([64, 16 << 10, 100_000, 256 << 10])
                await s.write(payload[pos:pos + n], timeout=30)
                pos += n
            finished = True
        except Exception:
            pass  # a reset from the other task: what the stream owner sees

    if kind == "deadline":
        with trio.move_on_after(delay):
            await write()
    elif kind == "nursery":
        async with trio.open_nursery() as nursery:
            nursery.start_soon(write)
            await trio.sleep(delay)
            nursery.cancel_scope.cancel()
    else:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(write)
            await trio.sleep(delay)
            await s.reset()
    # What an application does with a stream it gave up on: reset it, or close it.
    await (s.reset() if rng.random() < 0.5 else s.close())
    return not finished


async def _follow_up(node, target, rng: random.Random) -> None:
    probe = rng.randbytes(64)
    s = await node.new_stream(target, "/t/echo", timeout=10)
    await s.write(probe, timeout=10)
    got = await s.read_exactly(64, timeout=10)
    await s.close()
    if got != probe:
        raise AssertionError("echo came back different")


async def _busy(node, target, stop: trio.Event, result: Result, seed: int) -> None:
    """A stream that keeps echoing random data while the others are cut; checked exactly."""
    rng = random.Random(seed)
    s = await node.new_stream(target, "/t/echo", timeout=10)
    sent, got = hashlib.sha256(), hashlib.sha256()
    n_sent = n_got = 0

    async def reader() -> None:
        nonlocal n_got
        while n_got < n_sent or not stop.is_set():
            data = await s.read_some(1 << 20, timeout=30)
            if not data:
                break
            got.update(data)
            n_got += len(data)

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            while not stop.is_set():
                chunk = rng.randbytes(rng.choice([100, 5000, 70000, 300000]))
                sent.update(chunk)
                n_sent += len(chunk)
                await s.write(chunk, timeout=30)
                await trio.sleep(rng.uniform(0, 0.003))
            with trio.fail_after(30):
                while n_got < n_sent:
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
        await s.close()
    except Exception as e:
        result.first_failures.append(f"busy stream: {type(e).__name__}: {e}")
        result.busy_exact = False
        return
    result.busy_bytes += n_got
    if sent.digest() != got.digest():
        result.busy_exact = False


async def torture(path: str, rounds: int, seed: int = 1, tasks: int = 4) -> Result:
    """Run ``rounds`` cut writes over a ``path`` ("direct" or "relayed") connection."""
    result = Result(path)
    errors = _DecryptionErrors()
    logging.getLogger().addHandler(errors)
    started = time.monotonic()
    try:
        relay_cfg = torture_config(relay_service=RelayLimits(circuit_bytes=1 << 40, circuit_duration=3600))
        async with open_node(relay_cfg) as relay, open_node(torture_config()) as a, open_node(torture_config()) as b:
            for node in (a, b):
                for h, fn in (("/t/sink", _sink), ("/t/echo", partial(echo_handler, timeout=60, until_closed=True))):
                    node.set_stream_handler(h, fn)
            if path == "direct":
                target = await a.connect(b.listen_addrs[0])
            else:
                from libp2p.peer.peerinfo import PeerInfo

                await b.relay_client.reserve(PeerInfo(relay.peer_id, [relay.listen_addrs[0]]))
                target = await a.connect(f"{relay.listen_addrs[0]}/p2p-circuit/p2p/{b.peer_id}")
            watched = [(a, b.peer_id), (b, a.peer_id)]
            if path == "relayed":
                watched += [(a, relay.peer_id), (b, relay.peer_id)]
            before = {(id(n), p): [id(c) for c in _conns(n, p)] for n, p in watched}

            async def cutter(i: int) -> None:
                rng = random.Random(seed * 1000 + i)
                for _ in range(rounds // tasks):
                    kind = rng.choice(CUTS)
                    result.writes += 1
                    try:
                        if await _cut_write(a, target, rng, kind):
                            result.cut += 1
                            result.by_kind[kind] += 1
                        await _follow_up(a, target, rng)
                    except Exception as e:
                        result.follow_up_failures += 1
                        if len(result.first_failures) < 5:
                            result.first_failures.append(f"{kind}: {type(e).__name__}: {e}")
                        with trio.move_on_after(10):  # go on over a new connection
                            try:
                                await a.connect(b.listen_addrs[0] if path == "direct" else
                                                f"{relay.listen_addrs[0]}/p2p-circuit/p2p/{b.peer_id}")
                            except Exception:
                                pass

            stop = trio.Event()
            async with trio.open_nursery() as outer:
                outer.start_soon(_busy, a, target, stop, result, seed)
                outer.start_soon(_busy, b, a.peer_id, stop, result, seed + 1)
                async with trio.open_nursery() as cutters:
                    for i in range(tasks):
                        cutters.start_soon(cutter, i)
                stop.set()
            after = {(id(n), p): [id(c) for c in _conns(n, p)] for n, p in watched}
            result.connections_replaced = sum(before[k] != after[k] for k in before)
    finally:
        logging.getLogger().removeHandler(errors)
    result.decryption_errors = errors.count
    result.seconds = time.monotonic() - started
    return result


def table(results: list[Result]) -> str:
    return format_table(
        ["path", "writes", "cut", "(deadline/nursery/reset)", "follow-up failed", "decrypt errors",
         "conns replaced", "busy MiB", "exact", "seconds"],
        [[r.path, r.writes, r.cut, "(" + "/".join(str(r.by_kind[k]) for k in CUTS) + ")", r.follow_up_failures,
          r.decryption_errors, r.connections_replaced, f"{r.busy_bytes / 2**20:.1f}", "yes" if r.busy_exact else "NO",
          f"{r.seconds:.1f}"] for r in results], gap=2)


def main() -> None:
    ap = bench_parser(__doc__, paragraph=True, quick="a short run for the tests: 20 cut writes per path")
    ap.add_argument("--rounds", type=int, default=1500, help="cut writes per path")
    ap.add_argument("--paths", default="direct,relayed")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    if args.quick:
        args.rounds = 20
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    results = []
    for path in args.paths.split(","):
        r = trio.run(torture, path, args.rounds, args.seed)
        results.append(r)
        for f in r.first_failures:
            print(f"  {path}: {f}", file=sys.stderr)
    print(table(results))


if __name__ == "__main__":
    main()
