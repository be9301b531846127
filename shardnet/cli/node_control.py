"""What ``shardnet node`` does while it is up: report peers and messages, answer commands.

With ``--events`` it is a machine interface (used by tests, the demo and scripts): one JSON
object per line on stdout for every event, and one JSON command per line on stdin, each answered
by a ``{"event": "result", "id": ..., "ok": ...}`` line. Without it, it prints human lines.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import trio

from shardnet.protocols import echo
from shardnet.protocols.framing import encode_frame
from shardnet.transport.node import Node

log = logging.getLogger(__name__)

MAX_COMMAND_BYTES = 1 << 20


class NodeControl:
    def __init__(self, node: Node, *, emit: Callable[[dict], None] | None, say: Callable[[str], None]):
        self.node = node
        self.emit = emit
        self.say = say
        node.set_stream_handler(echo.PROTOCOL_ID, echo.serve)

    async def run(self, *, topics: list[str], read_commands: bool) -> None:
        n = self.node
        if self.emit:
            self.emit({"event": "ready", "peer_id": str(n.peer_id), "addrs": [str(a) for a in n.listen_addrs]})
        else:
            self.say(f"node {n.peer_id}")
            for a in n.listen_addrs:
                self.say(f"  {a}")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._report_peers)
            for t in topics:
                await self._subscribe(nursery, t)
            if read_commands:
                nursery.start_soon(self._read_commands, nursery)
            await trio.sleep_forever()

    async def _report_peers(self) -> None:
        async with self.node.peer_events() as events:
            for pid in list(self.node.discovered):
                self._peer_line("discovered", pid)
            async for ev in events:
                self._peer_line(ev.kind, ev.peer_id)

    def _peer_line(self, kind: str, pid) -> None:
        if self.emit:
            self.emit({"event": kind, "peer_id": str(pid)})
        else:
            self.say(f"{kind} peer {pid}")

    async def _subscribe(self, nursery: trio.Nursery, topic: str) -> None:
        ready = trio.Event()

        async def _listen() -> None:
            async with self.node.pubsub.subscribe(topic) as sub:
                ready.set()
                async for msg in sub:
                    text = msg.data.decode("utf-8", "replace")
                    if self.emit:
                        self.emit({"event": "message", "topic": topic, "from": str(msg.sender), "data": text})
                    else:
                        self.say(f"[{topic}] {msg.sender}: {text}")

        nursery.start_soon(_listen)
        await ready.wait()

    async def _read_commands(self, nursery: trio.Nursery) -> None:
        stdin = trio.lowlevel.FdStream(os.dup(0))
        buf = b""
        async with stdin:
            while True:
                chunk = await stdin.receive_some(65536)
                if not chunk:
                    log.info("stdin closed; no more commands")
                    return
                buf += chunk
                if len(buf) > MAX_COMMAND_BYTES and b"\n" not in buf:
                    self.emit({"event": "result", "id": None, "ok": False, "error": "command line too long"})
                    buf = b""
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if line.strip():
                        nursery.start_soon(self._answer, line)

    async def _answer(self, line: bytes) -> None:
        cid = None
        try:
            cmd = json.loads(line)
            if not isinstance(cmd, dict):
                raise ValueError("a command is a JSON object")
            cid = cmd.get("id")
            result = await self._execute(cmd)
            self.emit({"event": "result", "id": cid, "ok": True, **result})
        except Exception as e:  # a bad or failed command is answered, never fatal to the node
            self.emit({"event": "result", "id": cid, "ok": False, "error": f"{type(e).__name__}: {e}"})

    async def _execute(self, cmd: dict) -> dict[str, Any]:
        n = self.node
        op = cmd["cmd"]
        if op == "publish":
            await n.pubsub.publish(cmd["topic"], cmd["data"].encode())
            return {}
        if op == "subscribe":
            raise ValueError("subscribe with --subscribe at start")
        if op == "echo":
            stream = await n.new_stream(cmd["peer"], cmd.get("protocol", echo.PROTOCOL_ID))
            async with stream:
                reply = await echo.echo_once(stream, cmd["data"].encode())
            return {"data": reply.decode("utf-8", "replace"), "relayed": stream.relayed}
        if op == "echo_bulk":  # a link test: mib MiB of 1 MiB frames out and back, pipelined
            return await _echo_bulk(n, cmd["peer"], int(cmd.get("mib", 16)))
        if op == "disconnect":
            await n.disconnect(cmd["peer"])
            return {}
        if op == "ping":
            return {"rtt_ms": await n.ping(cmd["peer"]) * 1000}
        if op == "find_peer":
            info = await n.find_peer(cmd["peer"])
            return {"found": info is not None, "addrs": [str(a) for a in (info.addrs if info else [])]}
        if op == "connect":
            peer = await n.connect(cmd["addr"], timeout=float(cmd.get("timeout", n.config.dial_timeout)))
            return {"peer": str(peer), "connections": n.connections(peer)}
        if op == "status":
            return {"addrs": [str(a) for a in n.listen_addrs],
                    "reservations": [str(r) for r in n.relay_client.reservations],
                    "connections": {str(p): n.connections(p) for p in n.peers()},
                    "nat": n.nat_status(),
                    "behaviours": n.status(),
                    "streams_served": {f"{proto} {path}": count for (proto, path), count in n.streams_served.items()}}
        if op == "peers":
            return {"connected": [str(p) for p in n.peers()], "discovered": [str(p) for p in n.discovered]}
        if op == "topic_peers":
            return {"peers": [str(p) for p in n.pubsub.topic_peers(cmd["topic"])]}
        if op == "put":
            published = await n.dht.put(cmd["name"], cmd["value"].encode())
            return {"key": published.key, "peers": published.peers}
        if op == "get":
            v = await n.dht.get(cmd["publisher"], cmd["name"])
            return {"value": None if v is None else v.decode("utf-8", "replace")}
        if op == "provide":
            peers = await n.dht.provide(cmd["name"])
            return {"stored": True, "peers": peers}
        if op == "find_providers":
            return {"providers": [str(i.peer_id) for i in await n.dht.find_providers(cmd["name"])]}
        raise ValueError(f"unknown command {op!r}")


async def _echo_bulk(n: Node, peer: str, mib: int) -> dict[str, Any]:
    if not 1 <= mib <= 1024:
        raise ValueError("mib must be within 1..1024")
    frame = encode_frame(bytes(echo.MAX_FRAME), echo.MAX_FRAME)
    stream = await n.new_stream(peer, echo.PROTOCOL_ID)
    async with stream:
        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            async def send() -> None:
                for _ in range(mib):
                    await stream.write(frame, timeout=60)

            nursery.start_soon(send)
            got = 0
            while got < mib * len(frame):
                data = await stream.read_some(1 << 20, timeout=60)
                if not data:
                    raise ConnectionError(f"echo stream ended after {got} of {mib * len(frame)} bytes")
                got += len(data)
        seconds = time.perf_counter() - t0
    return {"seconds": seconds, "mib": mib, "mib_per_s": mib / seconds, "relayed": stream.relayed}
