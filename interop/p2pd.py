"""Driving go-libp2p through its daemon, p2pd (interop/go/bin, fetched by interop/go/fetch_p2pd.sh),
over its control socket: varint-length-delimited protobuf requests and responses
(interop/go/bin/p2pd.proto), one control connection per request; a stream request turns its
connection into the stream itself."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import time
from pathlib import Path

import trio
from libp2p.peer.id import ID
from multiaddr import Multiaddr

GO_BIN = Path(__file__).resolve().parent / "go" / "bin"


def p2pd_available() -> str | None:
    if not (GO_BIN / "p2pd").is_file() or not (GO_BIN / "p2pd_pb2.py").is_file():
        return "run interop/go/fetch_p2pd.sh first (interop/run.sh does)"
    return None


def _pb():
    spec = importlib.util.spec_from_file_location("p2pd_pb2", GO_BIN / "p2pd_pb2.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def unix_maddr_bytes(path: Path) -> bytes:
    """``/unix/<path>`` in binary as go-multiaddr writes it: the path keeps its leading slash.
    (py-multiaddr drops it, and go then dials a relative path: see docs/interop-notes.md.)"""
    raw = str(path).encode()
    return varint(0x0190) + varint(len(raw)) + raw


class P2pdError(RuntimeError):
    pass


class Framed:
    """Varint-delimited messages over a trio stream, keeping any bytes read past a message."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream, self.buf = stream, b""

    async def _more(self) -> None:
        chunk = await self.stream.receive_some(65536)
        if not chunk:
            raise P2pdError("p2pd closed the connection")
        self.buf += chunk

    async def read_msg(self, cls):
        while True:
            n, shift, i = 0, 0, 0
            while i < len(self.buf):
                b = self.buf[i]
                n |= (b & 0x7F) << shift
                shift += 7
                i += 1
                if not b & 0x80:
                    break
            else:
                await self._more()
                continue
            if len(self.buf) - i < n:
                await self._more()
                continue
            body, self.buf = self.buf[i:i + n], self.buf[i + n:]
            msg = cls()
            msg.ParseFromString(body)
            return msg

    async def write_msg(self, msg) -> None:
        data = msg.SerializeToString()
        await self.stream.send_all(varint(len(data)) + data)

    async def read_exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            await self._more()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out


class P2pd:
    """One go-libp2p daemon process."""

    def __init__(self, workdir: Path, name: str = "go", *flags: str) -> None:
        self.pb = _pb()
        self.control = workdir / f"{name}.sock"
        self.log = open(workdir / f"{name}.log", "wb")
        self.proc = subprocess.Popen(
            [str(GO_BIN / "p2pd"), "-listen", f"/unix{self.control}", "-hostAddrs", "/ip4/127.0.0.1/tcp/0",
             "-quic=false", "-tls=false", *flags],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.pid = self.proc.pid
        deadline = time.monotonic() + 20
        while not self.control.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise P2pdError(f"p2pd did not start (see {self.log.name})")
            time.sleep(0.05)
        self.peer_id: str = ""
        self.addrs: list[str] = []

    async def start(self) -> P2pd:
        r = await self.request(type=self.pb.Request.IDENTIFY)
        self.peer_id = str(ID(r.identify.id))
        self.addrs = [f"{Multiaddr(a)}/p2p/{self.peer_id}" for a in r.identify.addrs]
        return self

    async def _open(self) -> Framed:
        with trio.fail_after(10):
            while True:
                try:
                    return Framed(await trio.open_unix_socket(str(self.control)))
                except ConnectionRefusedError:  # the socket file exists a moment before p2pd accepts
                    await trio.sleep(0.05)

    async def request(self, **fields):
        conn = await self._open()
        try:
            with trio.fail_after(30):
                await conn.write_msg(self.pb.Request(**fields))
                r = await conn.read_msg(self.pb.Response)
        finally:
            await conn.stream.aclose()
        if r.type != self.pb.Response.OK:
            raise P2pdError(r.error.msg)
        return r

    async def connect(self, addr: str) -> None:
        ma = Multiaddr(addr)
        peer = ID.from_base58(ma.value_for_protocol("p2p"))
        await self.request(type=self.pb.Request.CONNECT, connect=self.pb.ConnectRequest(
            peer=peer.to_bytes(), addrs=[ma.decapsulate(Multiaddr(f"/p2p/{peer}")).to_bytes()], timeout=10))

    async def stream_open(self, peer: str, protocol: str) -> Framed:
        """A stream to ``peer``: the returned connection carries its bytes."""
        conn = await self._open()
        await conn.write_msg(self.pb.Request(type=self.pb.Request.STREAM_OPEN, streamOpen=self.pb.StreamOpenRequest(
            peer=ID.from_base58(peer).to_bytes(), proto=[protocol], timeout=10)))
        r = await conn.read_msg(self.pb.Response)
        if r.type != self.pb.Response.OK:
            await conn.stream.aclose()
            raise P2pdError(r.error.msg)
        return conn

    async def serve_protocol(self, protocol: str, handler, nursery: trio.Nursery, sock: Path) -> None:
        """Inbound streams for ``protocol`` reach ``handler(framed, stream_info)`` through a unix
        socket of ours that the daemon connects to."""
        s = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
        await s.bind(str(sock))
        s.listen(16)
        listeners = [trio.SocketListener(s)]

        async def one(stream) -> None:
            framed = Framed(stream)
            info = await framed.read_msg(self.pb.StreamInfo)
            async with stream:
                await handler(framed, info)

        nursery.start_soon(trio.serve_listeners, one, listeners)
        await self.request(type=self.pb.Request.STREAM_HANDLER, streamHandler=self.pb.StreamHandlerRequest(
            addr=unix_maddr_bytes(sock), proto=[protocol], balanced=False))

    async def dht(self, kind: str, *, seconds: int = 30, **fields) -> list:
        """A DHT request (``seconds``: the daemon's own timeout for it); the values (or peers)
        of its streamed answer."""
        conn = await self._open()
        try:
            with trio.fail_after(seconds + 10):
                req = self.pb.DHTRequest(type=getattr(self.pb.DHTRequest, kind), timeout=seconds, **fields)
                await conn.write_msg(self.pb.Request(type=self.pb.Request.DHT, dht=req))
                r = await conn.read_msg(self.pb.Response)
                if r.type != self.pb.Response.OK:
                    raise P2pdError(r.error.msg)
                if r.dht.type != self.pb.DHTResponse.BEGIN:
                    return [r.dht]
                out = []
                while True:
                    d = await conn.read_msg(self.pb.DHTResponse)
                    if d.type == self.pb.DHTResponse.END:
                        return out
                    out.append(d)
        finally:
            await conn.stream.aclose()

    async def subscribe(self, topic: str) -> Framed:
        """A subscription: read ``PSMessage``s from the returned connection."""
        conn = await self._open()
        await conn.write_msg(self.pb.Request(type=self.pb.Request.PUBSUB, pubsub=self.pb.PSRequest(
            type=self.pb.PSRequest.SUBSCRIBE, topic=topic)))
        r = await conn.read_msg(self.pb.Response)
        if r.type != self.pb.Response.OK:
            raise P2pdError(r.error.msg)
        return conn

    async def publish(self, topic: str, data: bytes) -> None:
        await self.request(type=self.pb.Request.PUBSUB, pubsub=self.pb.PSRequest(
            type=self.pb.PSRequest.PUBLISH, topic=topic, data=data))

    async def topic_peers(self, topic: str) -> list[str]:
        r = await self.request(type=self.pb.Request.PUBSUB, pubsub=self.pb.PSRequest(
            type=self.pb.PSRequest.LIST_PEERS, topic=topic))
        return [str(ID(p)) for p in r.pubsub.peerIDs]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()
