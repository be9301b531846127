"""Overlay stream (TCP + Noise + Yamux) against raw trio TCP, side by side, between two processes.

    python bench/overlay_stream.py [--mib 64] [--messages 1000] [--wan-rtt-ms 100]

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
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.delay_proxy import DelayProxy  # noqa: E402
from shardnet.transport import NodeConfig, open_node  # noqa: E402

SINK = "/bench/sink/1.0.0"
ECHO = "/bench/echo/1.0.0"
CHUNK = 1 << 20
SMALL = 64


# -- server (a separate process) -------------------------------------------------------------
async def serve() -> None:
    async def sink_raw(stream: trio.SocketStream) -> None:
        header = await _recv_exactly_raw(stream, 8)
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

    async with open_node(NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"])) as node, trio.open_nursery() as n:
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
async def measure_raw(ports: dict, mib: int, messages: int, repeats: int) -> dict:
    block = os.urandom(CHUNK)
    passes = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        s = await trio.open_tcp_stream("127.0.0.1", ports["sink"])
        connect = time.perf_counter() - t0
        t0 = time.perf_counter()
        await s.send_all((mib * CHUNK).to_bytes(8, "big"))
        for _ in range(mib):
            await s.send_all(block)
        assert await _recv_exactly_raw(s, 2) == b"ok"
        passes.append(mib * CHUNK / (time.perf_counter() - t0) / 1e6)
        await s.aclose()
    mbps = statistics.median(passes)
    e = await trio.open_tcp_stream("127.0.0.1", ports["echo"])
    rtts = []
    msg = os.urandom(SMALL)
    for _ in range(messages):
        t0 = time.perf_counter()
        await e.send_all(msg)
        await _recv_exactly_raw(e, SMALL)
        rtts.append(time.perf_counter() - t0)
    await e.aclose()
    return {"mbps": mbps, "rtt_ms": statistics.median(rtts) * 1e3, "connect_ms": connect * 1e3}


async def measure_overlay(node, addr: str, mib: int, messages: int, repeats: int) -> dict:
    t0 = time.perf_counter()
    peer = await node.connect(addr)
    connect = time.perf_counter() - t0
    mbps = statistics.median([await overlay_throughput(node, peer, mib) for _ in range(repeats)])
    e = await node.new_stream(peer, ECHO)
    rtts = []
    msg = os.urandom(SMALL)
    for _ in range(messages):
        t0 = time.perf_counter()
        await e.write(msg)
        await e.read_exactly(SMALL)
        rtts.append(time.perf_counter() - t0)
    await e.close()
    await node.disconnect(peer)
    return {"mbps": mbps, "rtt_ms": statistics.median(rtts) * 1e3, "connect_ms": connect * 1e3}


async def overlay_throughput(node, peer, mib: int) -> float:
    block = os.urandom(CHUNK)
    s = await node.new_stream(peer, SINK)
    t0 = time.perf_counter()
    await s.write((mib * CHUNK).to_bytes(8, "big"))
    for _ in range(mib):
        await s.write(block, timeout=120)
    assert await s.read_exactly(2, timeout=120) == b"ok"
    mbps = mib * CHUNK / (time.perf_counter() - t0) / 1e6
    await s.close()
    return mbps


async def client(args: argparse.Namespace) -> None:
    server = subprocess.Popen([sys.executable, __file__, "--serve"], stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(server.stdout.readline())
        raw = await measure_raw(info, args.mib, args.messages, args.repeats)
        async with open_node(NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"])) as node:
            ovl = await measure_overlay(node, info["overlay"], args.mib, args.messages, args.repeats)
            wan = None
            if args.wan_rtt_ms:
                wan = await measure_wan(node, info["overlay"], args.wan_rtt_ms, args.wan_mib)
    finally:
        server.terminate()
        server.wait(10)
    print(f"{args.mib} MiB x {args.repeats} passes (median), {args.messages} round trips of {SMALL} bytes")
    print(f"{'':24}{'raw TCP':>12}{'overlay':>12}{'ratio':>10}")
    print(f"{'throughput (MB/s)':24}{raw['mbps']:12.1f}{ovl['mbps']:12.1f}{ovl['mbps'] / raw['mbps']:10.3f}"
          f"   (overlay/raw, target >= 0.25)")
    print(f"{'median RTT (ms)':24}{raw['rtt_ms']:12.3f}{ovl['rtt_ms']:12.3f}{ovl['rtt_ms'] / raw['rtt_ms']:10.2f}"
          f"   (overlay/raw, target <= 5)")
    print(f"{'connect (ms)':24}{raw['connect_ms']:12.2f}{ovl['connect_ms']:12.2f}"
          f"{ovl['connect_ms'] / raw['connect_ms']:10.1f}   (overlay target < 50 ms)")
    if wan is not None:
        mbps, path_rtt = wan
        print(f"overlay stream over a {args.wan_rtt_ms:g} ms RTT path (ping {path_rtt * 1e3:.1f} ms): "
              f"{mbps:.1f} MB/s ({args.wan_mib} MiB; target >= 20 MB/s)")


async def measure_wan(node, addr: str, rtt_ms: float, mib: int) -> float:
    host_port = addr.split("/")
    port = int(host_port[4])
    peer_id = addr.rsplit("/p2p/", 1)[1]
    async with trio.open_nursery() as n:
        proxy = DelayProxy(("127.0.0.1", port), one_way_delay_s=rtt_ms / 2000)
        listen_port = await n.start(proxy.serve)
        # forget the direct address so the dial can only go through the proxy
        from libp2p.peer.id import ID

        node.host.get_peerstore().clear_addrs(ID.from_base58(peer_id))
        peer = await node.connect(f"/ip4/127.0.0.1/tcp/{listen_port}/p2p/{peer_id}")
        path_rtt = await node.ping(peer)  # proves the connection runs through the proxy
        await overlay_throughput(node, peer, 4)  # let the receive window grow, as a long stream would
        mbps = await overlay_throughput(node, peer, mib)
        await node.disconnect(peer)
        n.cancel_scope.cancel()
    return mbps, path_rtt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="throughput passes; the median is shown")
    p.add_argument("--messages", type=int, default=1000)
    p.add_argument("--wan-rtt-ms", type=float, default=100.0, help="0 to skip the WAN measurement")
    p.add_argument("--wan-mib", type=int, default=64)
    args = p.parse_args()
    import logging

    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    trio.run(serve if args.serve else client, *([] if args.serve else [args]))


if __name__ == "__main__":
    main()
