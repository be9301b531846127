"""Signed DHT values in shardnet's own namespace (sans-IO: encode, verify, choose).

Key: ``/shardnet/<peer-id>/<name>``. Only the holder of ``<peer-id>``'s key can write a valid
record under it: the record carries the public key and an Ed25519 signature over
(domain, key, seq, data); the DHT validator rejects anything else, and among valid records for a
key the highest ``seq`` wins, so an old value cannot displace a new one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import cbor2
from libp2p.crypto.keys import KeyPair, PublicKey
from libp2p.crypto.serialization import deserialize_public_key
from libp2p.peer.id import ID
from libp2p.records.validator import Validator

from .errors import RecordError

NAMESPACE = "shardnet"
SIGNING_DOMAIN = b"shardnet-dht-record/1"
RECORD_VERSION = 1
MAX_RECORD_BYTES = 64 * 1024
MAX_NAME_CHARS = 256


def record_key(peer_id: ID | str, name: str) -> str:
    if not name or len(name) > MAX_NAME_CHARS:
        raise RecordError(f"record name must be 1..{MAX_NAME_CHARS} characters")
    return f"/{NAMESPACE}/{peer_id}/{name}"


def split_record_key(key: str) -> tuple[str, str]:
    parts = key.split("/", 3)
    if len(parts) != 4 or parts[0] != "" or parts[1] != NAMESPACE or not parts[2] or not parts[3]:
        raise RecordError(f"not a shardnet record key: {key!r}")
    return parts[2], parts[3]


@dataclass(frozen=True)
class SignedRecord:
    key: str
    seq: int
    data: bytes
    timestamp: float
    public_key: PublicKey

    @property
    def publisher(self) -> ID:
        return ID.from_pubkey(self.public_key)


def _signed_bytes(key: str, seq: int, timestamp: float, data: bytes) -> bytes:
    return cbor2.dumps([SIGNING_DOMAIN, key, seq, timestamp, data])


def encode(key_pair: KeyPair, key: str, data: bytes, seq: int | None = None) -> bytes:
    split_record_key(key)
    seq = time.time_ns() if seq is None else seq
    ts = time.time()
    sig = key_pair.private_key.sign(_signed_bytes(key, seq, ts, data))
    blob = cbor2.dumps(
        {"v": RECORD_VERSION, "pk": key_pair.public_key.serialize(), "seq": seq, "ts": ts,
         "data": data, "sig": sig}
    )
    if len(blob) > MAX_RECORD_BYTES:
        raise RecordError(f"record is {len(blob)} bytes; the limit is {MAX_RECORD_BYTES}")
    return blob


def decode(key: str, blob: bytes) -> SignedRecord:
    """Parse and verify; raise RecordError naming the first thing wrong."""
    peer_str, _ = split_record_key(key)
    if len(blob) > MAX_RECORD_BYTES:
        raise RecordError(f"record is {len(blob)} bytes; the limit is {MAX_RECORD_BYTES}")
    try:
        m = cbor2.loads(blob)
    except Exception as e:
        raise RecordError(f"record is not CBOR: {e}") from None
    if not isinstance(m, dict):
        raise RecordError("record is not a CBOR map")
    if m.get("v") != RECORD_VERSION:
        raise RecordError(f"unknown record version {m.get('v')!r}")
    pk_b, seq, ts, data, sig = (m.get(k) for k in ("pk", "seq", "ts", "data", "sig"))
    if not (isinstance(pk_b, bytes) and isinstance(seq, int) and isinstance(ts, (int, float))
            and isinstance(data, bytes) and isinstance(sig, bytes)):
        raise RecordError("record fields have the wrong types")
    try:
        pk = deserialize_public_key(pk_b)
    except Exception as e:
        raise RecordError(f"record public key unreadable: {e}") from None
    if str(ID.from_pubkey(pk)) != peer_str:
        raise RecordError("record is signed by a key other than the one its key names")
    if not pk.verify(_signed_bytes(key, seq, ts, data), sig):
        raise RecordError("record signature does not verify")
    return SignedRecord(key=key, seq=seq, data=data, timestamp=float(ts), public_key=pk)


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
