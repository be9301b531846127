"""Private swarms: a pre-shared swarm key, and the admission proof that shows a peer holds it.

The key file uses libp2p's private-network format (three lines: ``/key/swarm/psk/1.0.0/``, the
encoding ``/base16/`` or ``/base64/``, 32 key bytes in that encoding), so a key made by go-libp2p
or ipfs tools reads here too. What shardnet does with it differs from libp2p's pnet, on purpose:
pnet encrypts the raw TCP bytes with the key, so a wrong key turns everything after into noise
and neither side can say why the connection failed. shardnet instead runs the normal Noise
handshake (each peer authenticated by its own key pair) under a security protocol of its own,
then each side sends an admission proof over the encrypted channel,

    proof = HMAC-SHA256(swarm key, "shardnet swarm admission v1" || sender ID || receiver ID)

(IDs as length-prefixed multihash bytes), and checks the other's. A proof is bound to both
authenticated identities, so it cannot be replayed by or to anyone else, and it is never seen
outside the Noise channel. A mismatch is a clear refusal on both sides ("holds another swarm
key"); a peer without a key never gets past protocol negotiation (see security.py).

This module does no I/O: the key file codec and the admission message codec.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from .errors import ShardnetError
from .identity import check_private_file

KEY_FILE_HEADER = "/key/swarm/psk/1.0.0/"
KEY_BYTES = 32
#: The security protocol private-swarm peers negotiate instead of plain ``/noise``.
SECURITY_PROTOCOL = "/shardnet/swarm-noise/1.0.0"
ADMISSION_VERSION = 1
PROOF_BYTES = 32
#: an admission message: one version byte, then the proof
ADMISSION_BYTES = 1 + PROOF_BYTES
_LABEL = b"shardnet swarm admission v1"


class SwarmKeyError(ShardnetError):
    """A swarm key file is missing, malformed or unsafe."""

    code = "swarm_key"


class AdmissionError(ShardnetError):
    """A peer was refused (or refused us) at the private-swarm admission step."""

    code = "admission"


@dataclass(frozen=True)
class SwarmKey:
    secret: bytes

    def __post_init__(self) -> None:
        if len(self.secret) != KEY_BYTES:
            raise SwarmKeyError(f"a swarm key is {KEY_BYTES} bytes, not {len(self.secret)}")

    def __repr__(self) -> str:  # never print the secret
        return f"SwarmKey(fingerprint={self.fingerprint})"

    @classmethod
    def generate(cls) -> SwarmKey:
        return cls(os.urandom(KEY_BYTES))

    @property
    def fingerprint(self) -> str:
        """A short, one-way name for the key: operators compare it to tell keys apart."""
        return hashlib.sha256(b"shardnet swarm key fingerprint\0" + self.secret).hexdigest()[:16]

    def proof(self, sender: bytes, receiver: bytes) -> bytes:
        msg = _LABEL + struct.pack(">H", len(sender)) + sender + struct.pack(">H", len(receiver)) + receiver
        return hmac.new(self.secret, msg, hashlib.sha256).digest()

    def admission_message(self, sender: bytes, receiver: bytes) -> bytes:
        return bytes([ADMISSION_VERSION]) + self.proof(sender, receiver)

    def check_admission(self, data: bytes, sender: bytes, receiver: bytes) -> None:
        """Raise AdmissionError unless ``data`` is ``sender``'s valid proof to ``receiver``."""
        proof = parse_admission(data)
        if not hmac.compare_digest(proof, self.proof(sender, receiver)):
            raise AdmissionError("it holds another swarm key")

    # -- the key file ---------------------------------------------------------------------------
    def dump(self) -> str:
        return f"{KEY_FILE_HEADER}\n/base16/\n{self.secret.hex()}\n"

    @classmethod
    def parse(cls, text: str, *, source: str = "swarm key") -> SwarmKey:
        lines = [ln.strip() for ln in text.strip().splitlines()]
        if len(lines) != 3 or lines[0] != KEY_FILE_HEADER:
            raise SwarmKeyError(f"{source} is not a swarm key file: expected three lines, the first "
                                f"{KEY_FILE_HEADER!r}")
        encoding, body = lines[1], lines[2]
        try:
            if encoding == "/base16/":
                secret = bytes.fromhex(body)
            elif encoding == "/base64/":
                secret = base64.b64decode(body, validate=True)
            else:
                raise SwarmKeyError(f"{source}: unknown key encoding {encoding!r} (use /base16/ or /base64/)")
        except (ValueError, binascii.Error):
            raise SwarmKeyError(f"{source}: the key line is not valid {encoding.strip('/')}") from None
        if len(secret) != KEY_BYTES:
            raise SwarmKeyError(f"{source}: the key is {len(secret)} bytes; a swarm key is {KEY_BYTES}")
        return cls(secret)

    @classmethod
    def load(cls, path: Path) -> SwarmKey:
        path = Path(path).expanduser()
        check_private_file(path, "swarm key", SwarmKeyError)
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            raise SwarmKeyError(f"{path} is not a swarm key file (not text)") from None
        return cls.parse(text, source=str(path))

    def save(self, path: Path) -> None:
        """Write with mode 0600; refuse to overwrite an existing file."""
        path = Path(path).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise SwarmKeyError(f"{path} already exists; not overwriting it") from None
        with os.fdopen(fd, "w") as f:
            f.write(self.dump())


def parse_admission(data: bytes) -> bytes:
    """The proof in an admission message; AdmissionError when it is not one."""
    if len(data) != ADMISSION_BYTES:
        raise AdmissionError(f"its admission message is {len(data)} bytes, not {ADMISSION_BYTES}")
    if data[0] != ADMISSION_VERSION:
        raise AdmissionError(f"it speaks admission version {data[0]}, this node {ADMISSION_VERSION}")
    return bytes(data[1:])
