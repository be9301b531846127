"""The activation protocol's ``error`` message: its codes (``ErrorCode``) and the figures a busy
refusal carries on the wire, read back by peers that know them and ignored by those that do not."""

import cbor2
import pytest

from shardnet.protocols import activation as ap
from shardnet.protocols.activation import ErrorCode
from shardnet.testing.factories import activation_frame

SESSION = bytes(range(16))


def roundtrip(msg: ap.Message) -> ap.Message:
    data = ap.encode(msg)
    (got,) = ap.ActivationDecoder().feed(data)
    assert got.raw == data[4:]
    return got


def test_codes_are_their_wire_strings():
    assert ErrorCode.KV_BUDGET == "kv_budget" and f"{ErrorCode.NEXT_HOP}" == "next_hop"
    assert len(set(ErrorCode)) == len({c.value for c in ErrorCode})
    err = ap.Error(SESSION, ErrorCode.KV_BUDGET, "full")
    # the same bytes as the string code: the enum does not show on the wire
    assert ap.encode(err) == ap.encode(ap.Error(SESSION, "kv_budget", "full"))
    assert cbor2.loads(ap.encode(err)[8:])["code"] == "kv_budget"


@pytest.mark.parametrize("figures", [
    {"need_bytes": 9000, "limit_bytes": 8192},
    {"retry_after_s": 0.25},
    {"retry_after_s": 2},
    {},
])
def test_figures_round_trip(figures):
    err = ap.Error(SESSION, ErrorCode.KV_BUDGET, "session needs more", n=3, peer="mid", **figures)
    got = roundtrip(err)
    assert got == err
    assert {k: v for k, v in cbor2.loads(ap.encode(err)[8:]).items() if k in ap.ERROR_FIGURES} == figures


def test_an_error_without_figures_encodes_as_before():
    """Figures left out are not on the wire: an error without them is byte for byte what an
    older peer sends (receipts hash frames)."""
    assert cbor2.loads(ap.encode(ap.Error(SESSION, "idle", "no step", peer="p"))[8:]) == {
        "v": 1, "t": "error", "s": SESSION, "code": "idle", "msg": "no step", "peer": "p"}


def test_an_older_peers_error_decodes_without_figures():
    old = {"v": 1, "t": "error", "s": SESSION, "code": "kv_budget",
           "msg": "session needs 9000 bytes of KV cache; 8192 of 8192 are free"}
    got = ap.decode_frame(activation_frame(old, prefixed=False))
    assert isinstance(got, ap.Error) and got.code == ErrorCode.KV_BUDGET
    assert (got.need_bytes, got.limit_bytes, got.retry_after_s) == (None, None, None)


def test_unknown_fields_and_codes_are_ignored():
    """A newer peer's extra fields, and a code this peer does not know, still decode."""
    newer = {"v": 1, "t": "error", "s": SESSION, "code": "brand_new", "msg": "m",
             "need_bytes": 10, "limit_bytes": 20, "queue_position": 4}
    got = ap.decode_frame(activation_frame(newer, prefixed=False))
    assert (got.code, got.need_bytes, got.limit_bytes) == ("brand_new", 10, 20)
    assert "queue_position" not in ap.encode(got).decode("latin-1")


@pytest.mark.parametrize("bad", [{"need_bytes": "lots"}, {"need_bytes": True}, {"limit_bytes": -1},
                                 {"retry_after_s": [1]}, {"retry_after_s": None}])
def test_a_figure_of_the_wrong_type_is_left_out(bad):
    got = ap.decode_frame(activation_frame({"v": 1, "t": "error", "s": SESSION, "code": "kv_budget", "msg": "m", **bad},
                                           prefixed=False))
    assert (got.need_bytes, got.limit_bytes, got.retry_after_s) == (None, None, None)


def test_the_session_machines_pass_the_figures_on():
    from shardnet.protocols.activation_session import ClientSession, Failure, answer_to_open

    err = ap.Error(SESSION, ErrorCode.KV_BUDGET, "full", peer="mid", need_bytes=9000, limit_bytes=8192)
    assert answer_to_open(err, who="next hop", closed=Failure("next_hop", "closed")) == Failure(
        "kv_budget", "full", "mid", need_bytes=9000, limit_bytes=8192)
    client = ClientSession(SESSION, first_peer="a", last_peer="b", kind="hidden", hidden_size=4, vocab=8)
    assert client.opened(err).need_bytes == 9000
