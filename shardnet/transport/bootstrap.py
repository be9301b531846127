"""Bootstrap supervision: a node behaviour that stays connected to each configured bootstrap peer
(redialling with jittered exponential backoff) and, for a node with a lasting identity, checks
with them that the identity is not live elsewhere in the swarm."""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field

import trio
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

from . import identity, identity_check
from .behaviour import Behaviour
from .config import NodeConfig
from .errors import ShardnetError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BootstrapStatus:
    peers: list[str] = field(default_factory=list)  # the bootstrap peers supervised (ourselves excluded)
    connected: list[str] = field(default_factory=list)  # those with an open connection now
    errors: dict[str, str] = field(default_factory=dict)  # peer -> why its last dial failed (until one works)
    reconnects: int = 0  # connections made after the first one to the same peer


class BootstrapSupervisor(Behaviour):
    """Stay connected to each of ``peers``: dial it, and redial it whenever the connection is
    gone, with a backoff from ``reconnect_initial`` doubling up to ``reconnect_max`` (jittered).
    Each (re)connection adds the peer to the DHT routing table and kicks discovery. Ready at once:
    ``Node.wait_bootstrapped`` is how a caller waits for a first connection."""

    def __init__(self, peers: list[PeerInfo], config: NodeConfig) -> None:
        self.peers = list(peers)
        self.config = config
        #: why the last dial of each bootstrap peer failed (dropped once it connects)
        self.errors: dict[ID, str] = {}
        self.reconnects = 0

    def snapshot(self) -> BootstrapStatus:
        connected = set(self.node.host.get_connected_peers()) if self.node is not None else set()
        return BootstrapStatus([str(p.peer_id) for p in self.peers],
                               [str(p.peer_id) for p in self.peers if p.peer_id in connected],
                               {str(p): e for p, e in self.errors.items()}, self.reconnects)

    def attach(self, node) -> None:
        self.node = node
        self.peers = [p for p in self.peers if p.peer_id != node.peer_id]

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        for info in self.peers:
            self.spawn(self._keep_connected, info)
        task_status.started()
        await trio.sleep_forever()

    async def _keep_connected(self, info: PeerInfo) -> None:
        """Stay connected to one bootstrap peer: reconnect with exponential backoff."""
        node, config = self.node, self.config
        delay = config.reconnect_initial
        announced_loss = False
        connected_before = False
        while True:
            if info.peer_id not in node.host.get_connected_peers():
                try:
                    await node.connect(info)
                except ShardnetError as e:
                    self.errors[info.peer_id] = str(e)
                    node.note_links_changed()
                    if not announced_loss:
                        log.warning("bootstrap %s unreachable (%s); retrying with backoff", identity.short(info.peer_id), e)
                        announced_loss = True
                    await trio.sleep(delay * (0.75 + 0.5 * secrets.randbelow(1000) / 1000))
                    delay = min(delay * 2, config.reconnect_max)
                    continue
                self.errors.pop(info.peer_id, None)
                if announced_loss:
                    log.info("reconnected to bootstrap %s", identity.short(info.peer_id))
                announced_loss = False
                self.reconnects += connected_before
                connected_before = True
                delay = config.reconnect_initial
                await node.dht.add_peer(info.peer_id)
                node.discovery.note(info.peer_id)
                node.discovery.kick()
            await trio.sleep(min(1.0, config.reconnect_initial * 2))

    # -- our identity is ours alone --------------------------------------------------------------
    async def check_identity(self, *, wait: float) -> None:
        """Refuse (DuplicateIdentity) if a bootstrap peer holds a live connection to our peer ID
        besides ours: asked of those connected within ``wait`` s, else (in the background, where
        a duplicate stops the node) of the first to connect."""
        ids = [b.peer_id for b in self.peers]
        if not ids:
            return
        node = self.node
        with trio.move_on_after(wait):
            while True:
                changed = node.links_changed
                if any(p in node.host.get_connected_peers() for p in ids) or all(p in self.errors for p in ids):
                    break
                await changed.wait()
        connected = [p for p in ids if p in node.host.get_connected_peers()]
        if connected:
            await identity_check.check_unique(node, connected)
            return
        self.spawn(self._check_identity_later, ids)

    async def _check_identity_later(self, ids: list[ID]) -> None:
        node = self.node
        while True:
            changed = node.links_changed
            if connected := [p for p in ids if p in node.host.get_connected_peers()]:
                break
            await changed.wait()
        await identity_check.check_unique(node, connected)
