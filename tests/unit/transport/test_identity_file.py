"""The identity key file: created once, loaded after, refused when corrupt, foreign or unsafe.
What the CLI says about it: tests/system/test_identity.py."""

import stat

import pytest
from libp2p.crypto.secp256k1 import create_new_key_pair as secp_pair

from shardnet.transport import identity
from shardnet.transport.errors import IdentityError


def test_create_then_load_same_peer_id(tmp_path):
    path = tmp_path / "sub" / "id.key"
    kp, created = identity.load_or_create(path)
    assert created
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    kp2, created2 = identity.load_or_create(path)
    assert not created2
    assert identity.peer_id_of(kp) == identity.peer_id_of(kp2)
    assert str(identity.peer_id_of(kp)).startswith("12D3KooW")  # Ed25519 identity multihash


def test_corrupt_file_is_an_error_not_a_new_identity(tmp_path):
    path = tmp_path / "id.key"
    path.write_bytes(b"\x00garbage\xff" * 3)
    path.chmod(0o600)
    with pytest.raises(IdentityError, match="not a libp2p private key"):
        identity.load_or_create(path)
    assert path.read_bytes() == b"\x00garbage\xff" * 3  # untouched


def test_truncated_key_is_an_error(tmp_path):
    path = tmp_path / "id.key"
    good = identity.encode(identity.generate())
    path.write_bytes(good[:-10])
    path.chmod(0o600)
    with pytest.raises(IdentityError):
        identity.load(path)


def test_foreign_key_type_is_named(tmp_path):
    path = tmp_path / "id.key"
    path.write_bytes(secp_pair().private_key.serialize())
    path.chmod(0o600)
    with pytest.raises(IdentityError, match="Secp256k1 key; shardnet identities are Ed25519"):
        identity.load_or_create(path)


def test_world_readable_key_is_refused(tmp_path):
    path = tmp_path / "id.key"
    identity.save(identity.generate(), path)
    path.chmod(0o644)
    with pytest.raises(IdentityError, match="chmod 600"):
        identity.load(path)


def test_save_never_overwrites(tmp_path):
    path = tmp_path / "id.key"
    identity.save(identity.generate(), path)
    before = path.read_bytes()
    with pytest.raises(IdentityError, match="already exists"):
        identity.save(identity.generate(), path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["id.key"]  # no temp files left


def test_env_var_selects_the_default_path(tmp_path, monkeypatch):
    monkeypatch.setenv(identity.ENV_IDENTITY, str(tmp_path / "x.key"))
    assert identity.default_identity_path() == tmp_path / "x.key"
