import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardnet.transport import identity, records
from shardnet.transport.errors import RecordError

KP = identity.generate()
OTHER = identity.generate()
ME = identity.peer_id_of(KP)


def test_roundtrip():
    key = records.record_key(ME, "claims/model-x")
    blob = records.encode(KP, "claims/model-x", b"payload", seq=7)
    rec = records.decode(key, blob)
    assert (rec.data, rec.seq, rec.publisher, rec.name) == (b"payload", 7, ME, "claims/model-x")
    # short enough for py-libp2p DHT servers to route (they refuse longer non-multihash keys)
    assert len(key.encode()) <= 50


def test_someone_else_cannot_write_under_my_peer_id():
    key = records.record_key(ME, "name")
    forged = records.encode(OTHER, "name", b"evil", key=key)  # validly signed, by the wrong key
    with pytest.raises(RecordError, match="other than the one its key names"):
        records.decode(key, forged)


def test_tampered_data_fails_signature():
    key = records.record_key(ME, "name")
    m = cbor2.loads(records.encode(KP, "name", b"good"))
    m["body"]["data"] = b"bad!"
    with pytest.raises(RecordError, match="signature"):
        records.decode(key, cbor2.dumps(m))


def test_record_moved_to_another_key_fails():
    blob = records.encode(KP, "a", b"x")
    with pytest.raises(RecordError, match="other than the one its key names"):
        records.decode(records.record_key(ME, "b"), blob)
    m = cbor2.loads(blob)
    m["body"]["name"] = "b"  # renaming it does not help: the signature covers the key
    with pytest.raises(RecordError, match="signature"):
        records.decode(records.record_key(ME, "b"), cbor2.dumps(m))


def test_validator_selects_highest_seq_and_skips_invalid():
    key = records.record_key(ME, "n")
    vals = [records.encode(KP, "n", b"old", seq=1), b"junk",
            records.encode(KP, "n", b"new", seq=5), records.encode(KP, "n", b"mid", seq=3)]
    assert records.ShardnetRecordValidator().select(key, vals) == 2


def test_unknown_version_and_bad_keys():
    key = records.record_key(ME, "n")
    m = cbor2.loads(records.encode(KP, "n", b"x"))
    m["v"] = 99
    with pytest.raises(RecordError, match="unknown record version 99"):
        records.decode(key, cbor2.dumps(m))
    for bad in ("/other/x/y", "/shardnet//y", "shardnet/a/b", "/shardnet/abc", key + "/x"):
        with pytest.raises(RecordError):
            records.check_record_key(bad)


def test_oversize_record_refused_before_parsing():
    key = records.record_key(ME, "n")
    with pytest.raises(RecordError, match="limit"):
        records.decode(key, b"\x00" * (records.MAX_RECORD_BYTES + 1))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2048))
def test_decode_arbitrary_bytes_only_raises_record_error(blob):
    with pytest.raises(RecordError):
        records.decode(records.record_key(ME, "n"), blob)
