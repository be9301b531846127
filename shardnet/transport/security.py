"""Connection security: Noise only, and the private-swarm admission step on top of it.

py-libp2p's default security options include ``/plaintext/2.0.0`` (a peer states its public key
and proves nothing: anyone could claim any peer ID) and secio; shardnet offers and accepts Noise
alone, so every connection is authenticated by the remote peer's own key pair.

Private swarms (``NodeConfig.swarm_key``) negotiate ``/shardnet/swarm-noise/1.0.0`` instead:
Noise, then both sides exchange admission proofs (swarm_key.py). Every shardnet node also knows
the protocol of the other kind, only to refuse it with a log line saying why, so a mismatch is
explained on both sides whichever side dials:

========================  =====================================================================
public dials private      public proposes /noise: refused ("na"); proposes swarm-noise: the
                          private side accepts; the public side logs "X is in a private swarm;
                          this node has no swarm key" and closes; the private side logs that
                          the dialer left before the handshake (it holds no swarm key)
private dials public      private proposes swarm-noise; the public side accepts only to log "a
                          private swarm's peer; this node has no swarm key" and close; the
                          private side logs that X refused the swarm-key handshake
private dials private,    Noise succeeds; the proofs do not match: both log "X holds another
different keys            swarm key" and close
anything else             (a js/go peer, a scanner) the private side logs that it offered no
                          swarm-key security
========================  =====================================================================

Refusal lines are WARNINGs, at most one per remote host and kind of refusal every 30 s.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import trio
from libp2p.abc import IRawConnection, ISecureConn, ISecureTransport
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.x25519 import create_new_key_pair as new_x25519
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.security.exceptions import HandshakeFailure
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.transport.exceptions import SecurityUpgradeFailure

from .identity import short
from .nat.rawstream import close_quietly
from .swarm_key import ADMISSION_BYTES, SECURITY_PROTOCOL, AdmissionError, SwarmKey

log = logging.getLogger(__name__)

#: Seconds for the Noise handshake plus the admission exchange.
ADMISSION_TIMEOUT = 10.0
_WARN_EVERY = 30.0


class AdmissionRefused(HandshakeFailure, AdmissionError):
    """Raised inside py-libp2p's upgrader (a HandshakeFailure, which it expects) and found again
    by the node's dial error (an AdmissionError, a ShardnetError)."""

    def __init__(self, message: str) -> None:
        HandshakeFailure.__init__(self, message)


def security_options(key_pair: KeyPair, swarm_key: SwarmKey | None) -> dict[TProtocol, ISecureTransport]:
    """The security transports in negotiation order."""
    noise = NoiseTransport(key_pair, noise_privkey=new_x25519().private_key)
    if swarm_key is None:
        return {NOISE_PROTOCOL: noise, TProtocol(SECURITY_PROTOCOL): RefusePrivateSwarm(noise.local_peer)}
    return {TProtocol(SECURITY_PROTOCOL): SwarmKeyNoise(noise, swarm_key, ID.from_pubkey(key_pair.public_key))}


class SwarmKeyNoise(ISecureTransport):
    """Noise, then the admission exchange: each side sends its proof, reads the other's, checks."""

    def __init__(self, noise: NoiseTransport, key: SwarmKey, local_peer: ID,
                 timeout: float = ADMISSION_TIMEOUT) -> None:
        self.noise, self.key, self.local_peer, self.timeout = noise, key, local_peer, timeout

    async def secure_inbound(self, conn: IRawConnection) -> ISecureConn:
        addr = remote_address(conn)
        secure = await self._handshake(self.noise.secure_inbound(conn), conn, addr, "left",
                                       f"refused a connection from {addr}: it left before the swarm-key handshake "
                                       f"finished (a peer without the swarm key)")
        await self._admit(secure, addr)
        return secure

    async def secure_outbound(self, conn: IRawConnection, peer_id: ID) -> ISecureConn:
        addr = remote_address(conn)
        secure = await self._handshake(self.noise.secure_outbound(conn, peer_id), conn, addr, "refused",
                                       f"{short(peer_id)} at {addr} refused the swarm-key handshake: it is not in "
                                       f"this private swarm (it holds no swarm key)")
        await self._admit(secure, addr)
        return secure

    async def _handshake(self, handshake: Any, conn: IRawConnection, addr: str, kind: str,
                         refusal: str) -> ISecureConn:
        with trio.move_on_after(self.timeout) as scope:
            try:
                return await handshake
            except Exception as e:
                log.debug("swarm-key handshake with %s failed: %r", addr, e)
        if scope.cancelled_caught:
            refusal += f" (no answer in {self.timeout:g} s)"
        await close_quietly(conn, timeout=2)
        _refuse(self.local_peer, addr, kind, refusal)

    async def _admit(self, secure: ISecureConn, addr: str) -> None:
        remote = secure.get_remote_peer()
        mine, theirs = self.local_peer.to_bytes(), remote.to_bytes()
        data = None
        with trio.move_on_after(self.timeout):
            try:
                await secure.write(self.key.admission_message(mine, theirs))
                data = await secure.read(ADMISSION_BYTES)
            except Exception as e:
                log.debug("swarm admission with %s failed: %r", addr, e)
        try:
            if not data:
                raise AdmissionError("it closed the connection instead of proving it holds the swarm key")
            self.key.check_admission(data, theirs, mine)
        except AdmissionError as e:
            problem = str(e)
        else:
            log.debug("admitted %s at %s to the private swarm", short(remote), addr)
            return
        await close_quietly(secure, timeout=2)
        _refuse(self.local_peer, addr, "mismatch",
                f"refused {short(remote)} at {addr}: {problem} (this node's key: {self.key.fingerprint})")


class RefusePrivateSwarm(ISecureTransport):
    """A public node's answer to swarm-key security: a clear refusal, never a connection."""

    def __init__(self, local_peer: ID) -> None:
        self.local_peer = local_peer

    async def secure_inbound(self, conn: IRawConnection) -> ISecureConn:
        addr = remote_address(conn)
        await close_quietly(conn, timeout=2)
        _refuse(self.local_peer, addr, "public-in",
                f"refused a connection from {addr}: it is in a private swarm (it asked for swarm-key security) "
                f"and this node has no swarm key (--swarm-key)")

    async def secure_outbound(self, conn: IRawConnection, peer_id: ID) -> ISecureConn:
        addr = remote_address(conn)
        await close_quietly(conn, timeout=2)
        _refuse(self.local_peer, addr, "public-out",
                f"{short(peer_id)} at {addr} is in a private swarm (it accepts only swarm-key security); "
                f"this node has no swarm key (--swarm-key)")


def guard_upgrader(upgrader: Any, local_peer: ID) -> None:
    """On a private-swarm node: a failed security negotiation (the other side speaks no
    swarm-key security) becomes a logged refusal naming the reason."""
    negotiate = upgrader.upgrade_security

    async def upgrade_security(raw_conn: IRawConnection, is_initiator: bool, peer_id: ID | None = None):
        try:
            return await negotiate(raw_conn, is_initiator, peer_id)
        except SecurityUpgradeFailure as e:
            if _admission_error(e) is not None or "negotiate" not in str(e):
                raise
            addr = remote_address(raw_conn)
            if is_initiator:
                reason = (f"{short(peer_id)} at {addr} does not offer swarm-key security: it is not in a "
                          f"private swarm")
            else:
                reason = (f"refused a connection from {addr}: it offered no swarm-key security (it holds no "
                          f"swarm key, or is not a shardnet peer)")
            _warn(local_peer, addr, "unspoken", reason)
            raise SecurityUpgradeFailure(reason) from AdmissionRefused(reason)

    upgrader.upgrade_security = upgrade_security


def _admission_error(e: BaseException | None, depth: int = 0) -> AdmissionError | None:
    """The first AdmissionError among ``e``, its causes and (for exception groups) members."""
    if e is None or depth > 20:
        return None
    if isinstance(e, AdmissionError):
        return e
    children = [e.__cause__ or (None if e.__suppress_context__ else e.__context__)]
    for attr in ("errors", "exceptions"):
        group = getattr(e, attr, None)
        if isinstance(group, (list, tuple)):
            children += [c for c in group if isinstance(c, BaseException)]
    for child in children:
        found = _admission_error(child, depth + 1)
        if found is not None:
            return found
    return None


def admission_reason(e: BaseException) -> str | None:
    """The refusal message somewhere in a dial failure's causes, if admission refused it."""
    found = _admission_error(e)
    return str(found) if found is not None else None


def remote_address(conn: Any) -> str:
    try:
        host, port = conn.get_remote_address()
        return f"{host}:{port}"
    except Exception:
        return "an unknown address"


def _refuse(local_peer: ID, addr: str, kind: str, message: str):
    _warn(local_peer, addr, kind, message)
    raise AdmissionRefused(message)


_last_warned: dict[tuple[ID, str, str], float] = {}


def _warn(local_peer: ID, addr: str, kind: str, message: str) -> None:
    """One line per remote host and kind of refusal per 30 s: a flood of refused dials is not a
    flood of log lines."""
    now = time.monotonic()
    key = (local_peer, addr.rsplit(":", 1)[0], kind)
    if now - _last_warned.get(key, -_WARN_EVERY) < _WARN_EVERY:
        return
    if len(_last_warned) > 4096:
        _last_warned.clear()
    _last_warned[key] = now
    log.warning("swarm admission: %s", message)
