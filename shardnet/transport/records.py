"""Signed DHT values in shardnet's own namespace (sans-IO: encode, verify, choose).

Key: ``/shardnet/<digest>`` where digest = base32(sha256(domain, publisher peer ID, name))[:32].
Only the holder of the publisher's key can write a valid record under it: the record carries the
public key and a signed body {key, name, seq, timestamp, data} (see envelope.py); the DHT
validator recomputes the key from (public key, name) and checks the signature, rejects anything
else, and among valid records for a key keeps the highest ``seq``, so an old value cannot displace
a new one. The key is hashed because py-libp2p DHT servers refuse lookup keys longer than 50
bytes that are not multihashes, so ``/shardnet/<peer-id>/<name>`` could not be routed.
"""

from __future__ import annotations

import base64
import hashlib
import time
from dataclasses import dataclass

from libp2p.crypto.keys import KeyPair, PublicKey
from libp2p.peer.id import ID
from libp2p.records.validator import Validator

from . import envelope
from .errors import RecordError

NAMESPACE = "shardnet"
SIGNING_DOMAIN = b"shardnet-dht-record/1"
RECORD_VERSION = 1
MAX_RECORD_BYTES = 64 * 1024
MAX_NAME_CHARS = 256


KEY_DOMAIN = b"shardnet-dht-key/1"
DIGEST_CHARS = 32


def record_key(peer_id: ID | str, name: str) -> str:
    if not name or len(name) > MAX_NAME_CHARS:
        raise RecordError(f"record name must be 1..{MAX_NAME_CHARS} characters")
    pid = peer_id if isinstance(peer_id, ID) else _parse_peer_id(peer_id)
    h = hashlib.sha256(KEY_DOMAIN + len(pid.to_bytes()).to_bytes(2, "big") + pid.to_bytes() + name.encode())
    return f"/{NAMESPACE}/{base64.b32encode(h.digest()).decode().lower()[:DIGEST_CHARS]}"


def check_record_key(key: str) -> None:
    parts = key.split("/")
    if len(parts) != 3 or parts[0] != "" or parts[1] != NAMESPACE or len(parts[2]) != DIGEST_CHARS:
        raise RecordError(f"not a shardnet record key: {key!r}")


def _parse_peer_id(text: str) -> ID:
    try:
        return ID.from_base58(text)
    except Exception:
        raise RecordError(f"not a peer ID: {text!r}") from None


@dataclass(frozen=True)
class SignedRecord:
    key: str
    name: str
    seq: int
    data: bytes
    timestamp: float
    public_key: PublicKey

    @property
    def publisher(self) -> ID:
        return ID.from_pubkey(self.public_key)


def encode(key_pair: KeyPair, name: str, data: bytes, seq: int | None = None, *,
           key: str | None = None) -> bytes:
    """Sign ``data`` as ``name`` of the key pair's owner (``key`` overrides, for tests only)."""
    key = key or record_key(ID.from_pubkey(key_pair.public_key), name)
    check_record_key(key)
    body = {"key": key, "name": name, "seq": time.time_ns() if seq is None else seq,
            "ts": time.time(), "data": data}
    return envelope.seal(key_pair, domain=SIGNING_DOMAIN, version=RECORD_VERSION, body=body,
                         max_bytes=MAX_RECORD_BYTES, error=RecordError, what="record")


def decode(key: str, blob: bytes) -> SignedRecord:
    """Parse and verify; raise RecordError naming the first thing wrong."""
    check_record_key(key)
    body, pk = envelope.open_envelope(blob, domain=SIGNING_DOMAIN, version=RECORD_VERSION,
                                      max_bytes=MAX_RECORD_BYTES, error=RecordError, what="record")
    name, seq, ts, data = (body.get(k) for k in ("name", "seq", "ts", "data"))
    if not (isinstance(name, str) and isinstance(seq, int) and isinstance(ts, (int, float))
            and isinstance(data, bytes)):
        raise RecordError("record fields have the wrong types")
    if not name or len(name) > MAX_NAME_CHARS:
        raise RecordError("record name out of range")
    # The signature covers the key, so a record cannot be moved; and the key is derived from the
    # signer's peer ID, so nobody but that peer can write it.
    if body.get("key") != key or record_key(ID.from_pubkey(pk), name) != key:
        raise RecordError("record is signed by a key other than the one its key names")
    return SignedRecord(key=key, name=name, seq=seq, data=data, timestamp=float(ts), public_key=pk)


class ShardnetRecordValidator(Validator):
    """Registered with the DHT for the ``/shardnet/`` namespace."""

    def validate(self, key: str, value: bytes) -> None:
        decode(key, value)

    def select(self, key: str, values: list[bytes]) -> int:
        best, best_seq = 0, -1
        for i, v in enumerate(values):
            try:
                seq = decode(key, v).seq
            except RecordError:
                continue
            if seq > best_seq:
                best, best_seq = i, seq
        return best
