"""Signed CBOR envelopes (sans-IO): a body, the signer's public key, an Ed25519 signature.

Wire form: CBOR map {v: version, body: map, pk: libp2p public key bytes, sig: bytes}, signature
over canonical CBOR of [domain, body]. The domain separates uses (a DHT record's signature can
never pass as a block claim's). ``open_envelope`` checks size before parsing, then shape,
version and signature, and raises the caller's error type naming the first problem.
"""

from __future__ import annotations

import cbor2
from libp2p.crypto.keys import KeyPair, PublicKey
from libp2p.crypto.serialization import deserialize_public_key


def seal(key_pair: KeyPair, *, domain: bytes, version: int, body: dict, max_bytes: int,
         error: type[Exception], what: str) -> bytes:
    sig = key_pair.private_key.sign(cbor2.dumps([domain, body], canonical=True))
    blob = cbor2.dumps({"v": version, "body": body, "pk": key_pair.public_key.serialize(), "sig": sig})
    if len(blob) > max_bytes:
        raise error(f"{what} of {len(blob)} bytes exceeds the limit of {max_bytes}")
    return blob


def open_envelope(blob: bytes, *, domain: bytes, version: int, max_bytes: int,
                  error: type[Exception], what: str) -> tuple[dict, PublicKey]:
    """The verified body and the public key that signed it."""
    if len(blob) > max_bytes:
        raise error(f"{what} of {len(blob)} bytes exceeds the limit of {max_bytes}")
    try:
        m = cbor2.loads(blob)
    except Exception as e:
        raise error(f"{what} is not CBOR ({e})") from None
    if not isinstance(m, dict):
        raise error(f"{what} is not a CBOR map")
    if m.get("v") != version:
        raise error(f"unknown {what} version {m.get('v')!r}")
    body, pk_b, sig = m.get("body"), m.get("pk"), m.get("sig")
    if not isinstance(body, dict) or not isinstance(pk_b, bytes) or not isinstance(sig, bytes):
        raise error(f"{what} fields have the wrong types")
    try:
        pk = deserialize_public_key(pk_b)
    except Exception as e:
        raise error(f"{what} public key unreadable ({e})") from None
    if not pk.verify(cbor2.dumps([domain, body], canonical=True), sig):
        raise error(f"{what} signature does not verify")
    return body, pk
