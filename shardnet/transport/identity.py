"""Persistent Ed25519 identity: one key file, one peer ID, never silently replaced.

The file holds the libp2p protobuf encoding of the private key (the same bytes go-libp2p and
js-libp2p write), so an operator can move an identity between implementations.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.keys import KeyPair, KeyType, PrivateKey
from libp2p.crypto.serialization import deserialize_private_key
from libp2p.peer.id import ID

from .errors import IdentityError

log = logging.getLogger(__name__)

ENV_IDENTITY = "SHARDNET_IDENTITY"
DEFAULT_IDENTITY = Path("~/.shardnet/identity.key")


def default_identity_path() -> Path:
    return Path(os.environ.get(ENV_IDENTITY) or DEFAULT_IDENTITY).expanduser()


def peer_id_of(key_pair: KeyPair) -> ID:
    return ID.from_pubkey(key_pair.public_key)


def short(peer_id: object) -> str:
    """A peer ID cut to its first 8 and last 6 characters, for log lines."""
    text = str(peer_id)
    return f"{text[:8]}…{text[-6:]}" if len(text) > 16 else text


def generate() -> KeyPair:
    return create_new_key_pair()


def encode(key_pair: KeyPair) -> bytes:
    return key_pair.private_key.serialize()


def decode(data: bytes, *, source: str = "key data") -> KeyPair:
    """Parse a serialized private key; anything but a well-formed Ed25519 key is an error."""
    try:
        envelope = PrivateKey.deserialize_from_protobuf(data)
    except Exception as e:
        raise IdentityError(f"{source} is not a libp2p private key (corrupt file?): {e}") from None
    if envelope.key_type != KeyType.Ed25519.value:
        name = {k.value: k.name for k in KeyType}.get(envelope.key_type, str(envelope.key_type))
        raise IdentityError(f"{source} holds a {name} key; shardnet identities are Ed25519")
    if len(envelope.data) not in (32, 64):
        raise IdentityError(
            f"{source} holds an Ed25519 key of {len(envelope.data)} bytes (expected 32 or 64)"
        )
    try:
        priv = deserialize_private_key(data)
    except Exception as e:
        raise IdentityError(f"{source} holds an unreadable Ed25519 key: {e}") from None
    return KeyPair(priv, priv.get_public_key())


def check_private_file(path: Path, what: str, error: type[Exception]) -> None:
    """Raise ``error`` unless ``path`` is a regular file only its owner can read (a secret:
    an identity, a swarm key)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise error(f"no {what} at {path}") from None
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{what} path {path} is not a regular file")
    if st.st_mode & 0o077:
        raise error(f"{what} {path} is readable by others (mode {oct(st.st_mode & 0o777)}); run: chmod 600 {path}")


def load(path: Path) -> KeyPair:
    path = Path(path).expanduser()
    check_private_file(path, "identity", IdentityError)
    return decode(path.read_bytes(), source=str(path))


def save(key_pair: KeyPair, path: Path) -> None:
    """Write atomically with mode 0600; refuse to overwrite an existing file."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(encode(key_pair))
            f.flush()
            os.fsync(f.fileno())
        os.link(tmp, path)  # fails if path appeared meanwhile: never clobber an identity
    except FileExistsError:
        raise IdentityError(f"identity {path} already exists; not overwriting it") from None
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass


def load_or_create(path: Path | None = None) -> tuple[KeyPair, bool]:
    """Load the identity at ``path``; create it only if the file does not exist at all.

    Returns ``(key_pair, created)``. A file that exists but cannot be used is an error, never a
    reason to mint a new identity.
    """
    path = Path(path).expanduser() if path is not None else default_identity_path()
    if path.exists() or path.is_symlink():
        return load(path), False
    kp = generate()
    save(kp, path)
    log.info("created identity %s at %s", peer_id_of(kp), path)
    return kp, True
