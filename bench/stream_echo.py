"""One stream between two nodes in one process: throughput and small-message round trip.

    python -m bench.stream_echo [--label NAME] [--quick]

64 MiB in 1 MiB writes (best of 4 passes) and 500 echoes of 64 bytes (median), over loopback.
In-process, so it shows what the stream path itself costs per message (task switches, framing,
encryption) without a second process's scheduling. Run it in two trees (a ``git worktree`` of
another commit: from that tree's root, with ``PYTHONPATH`` set to it) to compare them;
docs/benchmarks.md does so for the single-writer change.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import trio

from bench._common import bench_parser
from shardnet.testing.helpers import loopback_config
from shardnet.transport import open_node  # noqa: E402

MIB = 64
PASSES = 4
ECHOES = 500


async def measure(mib: int, passes: int, echoes: int) -> tuple[float, float]:
    async with open_node(loopback_config()) as a, open_node(loopback_config()) as b:
        got = {"n": 0}
        done = trio.Event()

        async def sink(s) -> None:
            while got["n"] < mib << 20:
                data = await s.read_some(1 << 20, timeout=30)
                if not data:
                    break
                got["n"] += len(data)
            done.set()

        async def echo(s) -> None:
            while data := await s.read_some(1 << 16, timeout=30):
                await s.write(data)

        b.set_stream_handler("/bench/sink", sink)
        b.set_stream_handler("/bench/echo", echo)
        await a.connect(b.listen_addrs[0])
        chunk = b"x" * (1 << 20)
        best = 0.0
        for _ in range(passes):
            got["n"], done = 0, trio.Event()
            s = await a.new_stream(b.peer_id, "/bench/sink")
            t0 = time.perf_counter()
            for _ in range(mib):
                await s.write(chunk)
            await done.wait()
            best = max(best, mib / (time.perf_counter() - t0))
        s = await a.new_stream(b.peer_id, "/bench/echo")
        rtts = []
        for _ in range(echoes):
            t0 = time.perf_counter()
            await s.write(b"y" * 64)
            await s.read_exactly(64)
            rtts.append(time.perf_counter() - t0)
        return best, statistics.median(rtts)


def main() -> None:
    ap = bench_parser(__doc__, paragraph=True, quick="a short run for the tests: 4 MiB, 2 passes, 20 echoes")
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    import shardnet

    mib, passes, echoes = (4, 2, 20) if args.quick else (MIB, PASSES, ECHOES)
    tput, rtt = trio.run(measure, mib, passes, echoes)
    print(f"{args.label or Path(shardnet.__file__).parent.parent}: {tput:.0f} MiB/s (best of {passes}), "
          f"median 64-byte round trip {rtt * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
