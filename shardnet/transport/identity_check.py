"""One identity, one live node: a node started with a key that another live node already uses
finds out from its bootstrap peers and refuses to start, leaving the original its records.

Every node serves ``/shardnet/identity-check/1.0.0``. The asker sends (varint-framed CBOR) the
addresses it listens on; the server looks at its other connections to the asker's peer ID (not
the one the question came on), runs identify over each of those very connections, and answers
with a listen address of each node that answered. It only ever speaks about the asker's own ID; a node that
advertises exactly the asker's listen addresses is the asker itself on a second connection.
When it found one, the asker is the newcomer: the server also puts back the original's listen
addresses (just told by identify) in its peerstore, where the newcomer's identify had replaced
them, so that lookups through it keep returning where the original is.

A node with a persistent identity asks each bootstrap peer once, right after it first connects;
any live other connection means another process holds our key, and the node stops with
:class:`DuplicateIdentity`. Both of two nodes started at the same instant may refuse; an original
that died without closing its connections counts until keepalive closes them (15 s).
"""

from __future__ import annotations

import logging

import cbor2
import trio
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from .config import dial_place
from .errors import ShardnetError
from .nat.pbwire import FrameBuffer, MessageError, frame
from .nat.rawstream import close_quietly, read_message

log = logging.getLogger(__name__)

PROTOCOL_ID = "/shardnet/identity-check/1.0.0"
IDENTIFY_PROTOCOL = TProtocol("/ipfs/id/1.0.0")
TIMEOUT = 5.0  # seconds for one question and its answer (the server's probes included)
PROBE_TIMEOUT = 3.0  # seconds for the server's identify over one other connection
MAX_ADDRS = 32
MAX_MESSAGE = 8192


class DuplicateIdentity(ShardnetError):
    """Another live node uses this node's identity."""

    code = "duplicate_identity"


def _decode(body: bytes) -> dict:
    try:
        msg = cbor2.loads(body)
    except Exception as e:
        raise MessageError(f"not CBOR: {e}") from None
    if not isinstance(msg, dict):
        raise MessageError("not a map")
    return msg


async def _identify_over(conn) -> list[Multiaddr] | None:
    """Run identify on this one connection (not any connection to the peer): the listen
    addresses the node at its other end advertises, or None if it did not answer."""
    from libp2p.identity.identify.identify import parse_identify_response
    from libp2p.network.stream.exceptions import StreamEOF
    from libp2p.protocol_muxer.multiselect_client import MultiselectClient
    from libp2p.protocol_muxer.multiselect_communicator import MultiselectCommunicator

    with trio.move_on_after(PROBE_TIMEOUT):
        stream = None
        try:
            stream = await conn.new_stream()
            await MultiselectClient().select_one_of([IDENTIFY_PROTOCOL], MultiselectCommunicator(stream))
            stream.set_protocol(IDENTIFY_PROTOCOL)
            data = b""
            try:
                while len(data) < 64 * 1024 and (chunk := await stream.read(4096)):
                    data += chunk
            except StreamEOF:
                pass
            msg = parse_identify_response(data)
            out = []
            for raw in list(msg.listen_addrs)[:MAX_ADDRS]:
                try:
                    out.append(Multiaddr(raw))
                except Exception:
                    continue
            return out
        except Exception as e:
            log.debug("identity check: identify over another connection failed: %s", e)
            return None
        finally:
            if stream is not None:
                await close_quietly(stream)
    return None


def _shown(addrs: list[Multiaddr], fallback: str) -> str:
    """The address to name in the refusal: a routable listen address, else any, else ``fallback``."""
    text = [str(a) for a in addrs if "/p2p-circuit" not in str(a)] or [str(a) for a in addrs]
    routable = [a for a in text if not a.startswith(("/ip4/127.", "/ip6/::1/"))]
    return (routable or text or [fallback])[0]


def _remote_addr(conn) -> str:
    try:
        addrs = conn.get_transport_addresses()
        return str(addrs[0]) if addrs else "an unknown address"
    except Exception:
        return "an unknown address"


async def serve(node, raw) -> None:
    """The server side (a py-libp2p stream handler's body)."""
    asker: ID = raw.muxed_conn.peer_id
    try:
        with trio.fail_after(TIMEOUT):
            msg = await read_message(raw, FrameBuffer(MAX_MESSAGE), _decode)
        listen = msg.get("listen")
        listen = listen if isinstance(listen, list) else []
        asker_addrs = {dial_place(a) for a in listen[:MAX_ADDRS] if isinstance(a, str)}
        others = [c for c in node.host.get_network().get_connections(asker) if c.muxed_conn is not raw.muxed_conn]
        live: list[str] = []
        original: list[Multiaddr] = []

        async def probe(conn) -> None:
            addrs = await _identify_over(conn)
            if addrs is not None and asker_addrs and {dial_place(a) for a in addrs} == asker_addrs:
                return  # the asker itself on a second connection (both sides dialled at once)
            if addrs is not None:  # it answered: another live node with our asker's key
                live.append(_shown(addrs, _remote_addr(conn)))
                original.extend(a for a in addrs if a not in original)

        async with trio.open_nursery() as nursery:
            for conn in others[:8]:
                nursery.start_soon(probe, conn)
        if live:
            log.warning("peer %s connected a second time while live at %s: told the newcomer its identity "
                        "is in use, and kept the original's addresses", str(asker)[:16], ", ".join(live))
            _restore_addrs(node, asker, original)
        with trio.fail_after(TIMEOUT):
            await raw.write(frame(cbor2.dumps({"live": sorted(live)})))
        if live:
            # identify on the newcomer's connection replaces the peer's addresses with its own,
            # perhaps still after our answer: restore them again once it has gone (it stops on
            # our answer)
            network = node.host.get_network()
            with trio.move_on_after(TIMEOUT):
                while any(c.muxed_conn is raw.muxed_conn for c in network.get_connections(asker)):
                    await trio.sleep(0.1)
            _restore_addrs(node, asker, original)
            await trio.sleep(1.0)  # an identify answer already on its way when the newcomer went
            _restore_addrs(node, asker, original)
    except (MessageError, trio.TooSlowError) as e:
        log.debug("identity check from %s: %s", str(asker)[:16], e)
    finally:
        await close_quietly(raw)


def _restore_addrs(node, peer: ID, addrs: list[Multiaddr]) -> None:
    """Make ``addrs`` (what the original advertised just now) the peer's addresses again."""
    store = node.host.get_peerstore()
    try:
        store.clear_addrs(peer)
        for a in addrs:
            store.add_addr(peer, a, 7200)  # identify's TTL
    except Exception as e:
        log.debug("identity check: restoring addresses of %s: %s", str(peer)[:16], e)


async def ask(node, server: ID) -> list[str]:
    """Ask ``server`` whether it holds other live connections to our peer ID: their addresses."""
    with trio.fail_after(TIMEOUT + PROBE_TIMEOUT):
        raw = await node.host.new_stream(server, [TProtocol(PROTOCOL_ID)])
        try:
            listen = [dial_place(a) for a in node.listen_addrs]
            await raw.write(frame(cbor2.dumps({"listen": listen[:MAX_ADDRS]})))
            reply = await read_message(raw, FrameBuffer(MAX_MESSAGE), _decode)
        finally:
            await close_quietly(raw)
    live = reply.get("live", [])
    return [a for a in live if isinstance(a, str)][:MAX_ADDRS] if isinstance(live, list) else []


async def check_unique(node, servers: list[ID]) -> None:
    """Ask each of ``servers`` (connected peers); raise DuplicateIdentity if any holds a live
    connection to our ID besides ours. A server that cannot answer is skipped."""
    found: dict[ID, list[str]] = {}

    async def one(server: ID) -> None:
        try:
            live = await ask(node, server)
        except Exception as e:  # an old node without the protocol, a slow one: no evidence
            log.debug("identity check with %s: %s: %s", str(server)[:16], type(e).__name__, e)
            return
        if live:
            found[server] = live

    async with trio.open_nursery() as nursery:
        for s in servers:
            nursery.start_soon(one, s)
    if found:
        server, addrs = next(iter(found.items()))
        me = str(node.peer_id)
        raise DuplicateIdentity(
            f"identity {me[:6]}…{me[-6:]} is already live in the swarm at {addrs[0]}; stop that node first, "
            f"or give this one another --identity (reported by {str(server)[:16]})")

