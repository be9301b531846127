"""A tiny chat over the shardnet overlay: an app embedding the overlay as a library.

    python examples/chat.py --bootstrap /ip4/127.0.0.1/tcp/4001/p2p/12D3KooW... --name alice

Lines typed on stdin go to everyone in the room (a gossipsub topic). ``/dm PEER_ID text`` sends a
direct message over the app's own protocol, ``/chat/dm/1.0.0``. Each user publishes a signed
DHT record with their nickname, so ``/who PEER_ID`` works for anyone in the swarm.
"""

from __future__ import annotations

import argparse
import os
import sys

import trio

import shardnet

ROOM_PREFIX = "chat/room/"
DM_PROTOCOL = "/chat/dm/1.0.0"
MAX_DM = 4096


def say(text: str) -> None:
    print(text, flush=True)


async def main(args: argparse.Namespace) -> None:
    cfg = shardnet.NodeConfig(listen=[args.listen], bootstrap=args.bootstrap)
    async with shardnet.open_node(cfg) as node:
        room = ROOM_PREFIX + args.room

        async def on_dm(stream: shardnet.Stream) -> None:
            data = await stream.read_some(MAX_DM, timeout=10)
            say(f"[dm] {stream.remote_peer}: {data.decode(errors='replace')}")

        node.set_stream_handler(DM_PROTOCOL, on_dm)
        if args.bootstrap:
            await node.wait_bootstrapped()
        await node.dht.put("chat/nick", args.name.encode())
        async with node.pubsub.subscribe(room) as sub, trio.open_nursery() as nursery:

            async def print_room() -> None:
                async for msg in sub:
                    if msg.sender != node.peer_id:
                        say(msg.data.decode(errors="replace"))

            nursery.start_soon(print_room)
            say(f"joined {room} as {args.name} ({node.peer_id})")
            stdin = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
            buf = b""
            while True:
                chunk = await stdin.receive_some(4096)
                if not chunk:
                    break
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    await handle_line(node, room, args.name, line.decode(errors="replace").strip())
            nursery.cancel_scope.cancel()


async def handle_line(node: shardnet.Node, room: str, name: str, line: str) -> None:
    if not line:
        return
    try:
        if line.startswith("/dm "):
            _, peer, text = line.split(" ", 2)
            async with await node.new_stream(peer, DM_PROTOCOL) as s:
                await s.write(f"{name}: {text}".encode()[:MAX_DM])
        elif line.startswith("/who "):
            nick = await node.dht.get(line.split()[1], "chat/nick")
            say(f"[who] {nick.decode() if nick else 'unknown'}")
        elif line == "/peers":
            say(f"[peers] {len(node.pubsub.topic_peers(room))} in the room")
        else:
            await node.pubsub.publish(room, f"{name}: {line}".encode())
    except (shardnet.ShardnetError, ValueError) as e:
        say(f"[error] {e}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bootstrap", action="append", default=[], help="bootstrap multiaddr")
    p.add_argument("--name", required=True)
    p.add_argument("--room", default="lobby")
    p.add_argument("--listen", default="/ip4/127.0.0.1/tcp/0")
    try:
        trio.run(main, p.parse_args())
    except KeyboardInterrupt:
        pass
    except shardnet.ShardnetError as e:
        sys.exit(f"error: {e}")
