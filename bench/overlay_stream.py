"""Overlay stream (TCP + Noise + Yamux) against raw trio TCP, side by side, between two processes.

    python -m bench.overlay_stream [--mib 64] [--messages 1000] [--wan-rtt-ms 100] [--quick]

Prints, for each transport: one-way throughput of --mib MiB in 1 MiB writes, the median round
trip of --messages small messages, and connect time; then the ratios. With --wan-rtt-ms it also
measures one overlay stream through a user-space proxy that delays each direction by half that
RTT (netem is not available here), to show the stream is not capped by its flow-control window.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time

import trio
from libp2p.peer.id import ID

from bench._common import bench_parser, print_table  # noqa: E402
from bench.wan_emulator import DelayProxy  # noqa: E402
from shardnet.transport import NodeConfig, open_node  # noqa: E402

SINK = "/bench/sink/1.0.0"
ECHO = "/bench/echo/1.0.0"
CHUNK = 1 << 20
SMALL = 64


def bench_config() -> NodeConfig:
    # low_watermark 0: neither node dials the other on its own, so the only connection is the
    # one being measured (and the WAN measurement's cannot bypass the proxy).
    return NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"], low_watermark=0)


# -- server (a separate process) -------------------------------------------------------------
async def serve() -> None:
    async def sink_raw(stream: trio.SocketStream) -> None:
        try:
            header = await _recv_exactly_raw(stream, 8)
        except EOFError:
            return
        total = int.from_bytes(header, "big")
        got = 0
        while got < total:
            data = await stream.receive_some(1 << 20)
            if not data:
                return
            got += len(data)
        await stream.send_all(b"ok")

    async def echo_raw(stream: trio.SocketStream) -> None:
        while True:
            data = await stream.receive_some(SMALL)
            if not data:
                return
            await stream.send_all(data)

    async def sink_overlay(stream) -> None:
        total = int.from_bytes(await stream.read_exactly(8), "big")
        got = 0
        while got < total:
            data = await stream.read_some(1 << 20, timeout=60)
            if not data:
                return
            got += len(data)
        await stream.write(b"ok")

    async def echo_overlay(stream) -> None:
        while True:
            data = await stream.read_some(SMALL, timeout=60)
            if not data:
                return
            await stream.write(data)

    async with open_node(bench_config()) as node, trio.open_nursery() as n:
        node.set_stream_handler(SINK, sink_overlay)
        node.set_stream_handler(ECHO, echo_overlay)
        sink_l = (await n.start(functools.partial(trio.serve_tcp, sink_raw, 0, host="127.0.0.1")))[0]
        echo_l = (await n.start(functools.partial(trio.serve_tcp, echo_raw, 0, host="127.0.0.1")))[0]
        print(json.dumps({"overlay": str(node.listen_addrs[0]),
                          "sink": sink_l.socket.getsockname()[1], "echo": echo_l.socket.getsockname()[1]}),
              flush=True)
        await trio.sleep_forever()


async def _recv_exactly_raw(stream: trio.SocketStream, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        d = await stream.receive_some(n - len(buf))
        if not d:
            raise EOFError
        buf += d
    return buf


# -- client ------------------------------------------------------------------------------------
class RawSide:
    """Raw trio TCP to the server's sink and echo ports."""

    def __init__(self, ports: dict) -> None:
        self.ports = ports
        self.echo: trio.SocketStream | None = None

    async def connect_ms(self) -> float:
        t0 = time.perf_counter()
        s = await trio.open_tcp_stream("127.0.0.1", self.ports["echo"])
        dt = time.perf_counter() - t0
        await s.aclose()
        return dt * 1e3

    async def throughput(self, mib: int, block: bytes) -> float:
        s = await trio.open_tcp_stream("127.0.0.1", self.ports["sink"])
        t0 = time.perf_counter()
        await s.send_all((mib * CHUNK).to_bytes(8, "big"))
        for _ in range(mib):
            await s.send_all(block)
        assert await _recv_exactly_raw(s, 2) == b"ok"
        dt = time.perf_counter() - t0
        await s.aclose()
        return mib * CHUNK / dt / 1e6

    async def round_trip(self, msg: bytes) -> float:
        if self.echo is None:
            self.echo = await trio.open_tcp_stream("127.0.0.1", self.ports["echo"])
        t0 = time.perf_counter()
        await self.echo.send_all(msg)
        await _recv_exactly_raw(self.echo, len(msg))
        return time.perf_counter() - t0


class OverlaySide:
    """One overlay connection (TCP + Noise + Yamux) to the server node."""

    def __init__(self, node, addr: str) -> None:
        self.node, self.addr = node, addr
        self.peer = None
        self.echo = None

    async def connect_ms(self) -> float:
        if self.peer is not None:
            await self.node.disconnect(self.peer)
        t0 = time.perf_counter()
        self.peer = await self.node.connect(self.addr)
        dt = time.perf_counter() - t0
        self.echo = None
        return dt * 1e3

    async def throughput(self, mib: int, block: bytes) -> float:
        return await overlay_throughput(self.node, self.peer, mib, block)

    async def round_trip(self, msg: bytes) -> float:
        if self.echo is None:
            self.echo = await self.node.new_stream(self.peer, ECHO)
        t0 = time.perf_counter()
        await self.echo.write(msg)
        await self.echo.read_exactly(len(msg))
        return time.perf_counter() - t0


async def overlay_throughput(node, peer, mib: int, block: bytes) -> float:
    s = await node.new_stream(peer, SINK)
    t0 = time.perf_counter()
    await s.write((mib * CHUNK).to_bytes(8, "big"))
    for _ in range(mib):
        await s.write(block, timeout=120)
    assert await s.read_exactly(2, timeout=120) == b"ok"
    mbps = mib * CHUNK / (time.perf_counter() - t0) / 1e6
    await s.close()
    return mbps


async def measure(sides: dict, args: argparse.Namespace) -> dict:
    """Raw and overlay measured alternately, so drift in machine load hits both alike."""
    block, msg = os.urandom(CHUNK), os.urandom(SMALL)
    out = {name: {"connect": [], "mbps": [], "rtt": []} for name in sides}
    for _ in range(args.repeats):
        for name, side in sides.items():
            out[name]["connect"].append(await side.connect_ms())
            out[name]["mbps"].append(await side.throughput(args.mib, block))
    rounds = 10
    for _ in range(rounds):
        for name, side in sides.items():
            for _ in range(max(1, args.messages // rounds)):
                out[name]["rtt"].append(await side.round_trip(msg))
    if args.verbose:
        for name, v in out.items():
            print(f"{name} passes (MB/s): {' '.join(f'{x:.0f}' for x in v['mbps'])}")
    return {name: {"mbps": statistics.median(v["mbps"]), "rtt_ms": statistics.median(v["rtt"]) * 1e3,
                   "connect_ms": statistics.median(v["connect"])} for name, v in out.items()}


async def client(args: argparse.Namespace) -> None:
    server = subprocess.Popen([sys.executable, "-m", "bench.overlay_stream", "--serve"], stdout=subprocess.PIPE,
                              text=True, env=dict(os.environ))
    try:
        info = json.loads(server.stdout.readline())
        async with open_node(bench_config()) as node:
            result = await measure({"raw": RawSide(info), "overlay": OverlaySide(node, info["overlay"])}, args)
            default_connect = await measure_default_config_connect(info["overlay"], args.repeats)
            wan = None
            if args.wan_rtt_ms:
                await node.disconnect(ID.from_base58(info["overlay"].rsplit("/p2p/", 1)[1]))
                wan = await measure_wan(node, info["overlay"], args.wan_rtt_ms, args.wan_mib)
    finally:
        server.terminate()
        server.wait(10)
    raw, ovl = result["raw"], result["overlay"]
    print_table(
        f"{args.mib} MiB x {args.repeats} passes and {args.messages} round trips of {SMALL} bytes each, "
        f"raw and overlay interleaved; medians; data path: {'py-libp2p as shipped' if args.untuned else 'shardnet'}",
        ["", "raw TCP", "overlay", "ratio", ""],
        [["throughput (MB/s)", f"{raw['mbps']:.1f}", f"{ovl['mbps']:.1f}", f"{ovl['mbps'] / raw['mbps']:.3f}",
          "(overlay/raw, target >= 0.25)"],
         ["median RTT (ms)", f"{raw['rtt_ms']:.3f}", f"{ovl['rtt_ms']:.3f}", f"{ovl['rtt_ms'] / raw['rtt_ms']:.2f}",
          "(overlay/raw, target <= 5)"],
         ["connect (ms)", f"{raw['connect_ms']:.2f}", f"{ovl['connect_ms']:.2f}",
          f"{ovl['connect_ms'] / raw['connect_ms']:.1f}", "(overlay target < 50 ms)"]], notes=True)
    print(f"{'connect, py-libp2p default ConnectionConfig (ms)':52}{default_connect:10.2f}"
          f"   (happy-eyeballs delay; shardnet sets max_connections_per_peer=1)")
    if wan is not None:
        mbps, path_rtt = wan
        print(f"overlay stream over a {args.wan_rtt_ms:g} ms RTT path (ping {path_rtt * 1e3:.1f} ms): "
              f"{mbps:.1f} MB/s ({args.wan_mib} MiB; target >= 20 MB/s)")


async def measure_default_config_connect(addr: str, repeats: int) -> float:
    """Connect time of a py-libp2p host built with its defaults, for comparison."""
    from libp2p import new_host
    from libp2p.peer.peerinfo import info_from_p2p_addr
    from multiaddr import Multiaddr

    from shardnet.transport.identity import generate

    info = info_from_p2p_addr(Multiaddr(addr))
    times = []
    for _ in range(repeats):
        host = new_host(key_pair=generate())
        async with host.run([Multiaddr("/ip4/127.0.0.1/tcp/0")]):
            t0 = time.perf_counter()
            await host.connect(info)
            times.append((time.perf_counter() - t0) * 1e3)
            await host.disconnect(info.peer_id)
        await host.get_network().close()
    return statistics.median(times)


async def measure_wan(node, addr: str, rtt_ms: float, mib: int) -> tuple[float, float]:
    port = int(addr.split("/")[4])
    peer_id = ID.from_base58(addr.rsplit("/p2p/", 1)[1])
    block = os.urandom(CHUNK)
    async with trio.open_nursery() as n:
        proxy = DelayProxy(("127.0.0.1", port), one_way_delay_s=rtt_ms / 2000)
        listen_port = await n.start(proxy.serve)
        # no connection left and no direct address known: the dial can only go through the proxy
        with trio.fail_after(10):
            while peer_id in node.peers():
                await node.disconnect(peer_id)
                await trio.sleep(0.05)
        node.host.get_peerstore().clear_addrs(peer_id)
        peer = await node.connect(f"/ip4/127.0.0.1/tcp/{listen_port}/p2p/{peer_id}")
        path_rtt = await node.ping(peer)
        if path_rtt < 0.9 * rtt_ms / 1000:
            raise RuntimeError(f"ping {path_rtt * 1e3:.1f} ms: the connection bypassed the delay proxy")
        await overlay_throughput(node, peer, 4, block)  # let the window grow, as a long stream would
        mbps = await overlay_throughput(node, peer, mib, block)
        await node.disconnect(peer)
        n.cancel_scope.cancel()
    return mbps, path_rtt


def main() -> None:
    p = bench_parser(__doc__,
                     quick="a short run for the tests: 2 MiB x 2 passes, 20 messages, 2 MiB over a 10 ms RTT path")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5, help="throughput passes; the median is shown")
    p.add_argument("--messages", type=int, default=1000)
    p.add_argument("--wan-rtt-ms", type=float, default=100.0, help="0 to skip the WAN measurement")
    p.add_argument("--wan-mib", type=int, default=64)
    p.add_argument("--verbose", action="store_true", help="print every throughput pass")
    p.add_argument("--untuned", action="store_true",
                   help="measure py-libp2p's data path as shipped (shardnet's data-path fixes off)")
    args = p.parse_args()
    if args.quick:
        args.mib, args.repeats, args.messages, args.wan_rtt_ms, args.wan_mib = 2, 2, 20, 10.0, 2
    if args.untuned:
        os.environ["SHARDNET_UNTUNED_DATA_PATH"] = "1"  # read by both processes before any node starts
    import logging

    logging.basicConfig(level=logging.ERROR)
    logging.disable(logging.CRITICAL)  # py-libp2p logs routine churn loudly, some loggers at INFO
    trio.run(serve if args.serve else client, *([] if args.serve else [args]))


if __name__ == "__main__":
    main()
