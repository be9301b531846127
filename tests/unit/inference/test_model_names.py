"""Which model a name means (weights/names.py): the first binding seen is kept, whatever number of
peers later claim the name for another model; a name several models claim is refused until one is
chosen; ``NAME@ID-PREFIX`` chooses."""

import json

import pytest

from shardnet.inference.weights.names import (
    BadModelSpec,
    Binding,
    NameBindings,
    NameConflict,
    choose,
    model_name,
    parse_model_spec,
)

GOOD = "3f2a" + "1" * 60
FAKE = "9c8d" + "2" * 60
FAKE2 = "9c8e" + "3" * 60
ORIGIN = "12D3KooWGoodPublisherAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
FAKES = {f"12D3KooWFake{i:03d}BBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBB" for i in range(50)}


def test_a_name_one_model_claims_resolves_and_is_kept(tmp_path):
    bindings = NameBindings(tmp_path / "names.json")
    assert choose("llama", None, {GOOD: {ORIGIN, "12D3KooWJoiner"}}, None) == GOOD
    bindings.keep("llama", GOOD, [ORIGIN, "12D3KooWJoiner"])
    kept = NameBindings(tmp_path / "names.json").get("llama")  # another process reads the same file
    assert kept.model_id == GOOD and set(kept.publishers) == {ORIGIN, "12D3KooWJoiner"}
    assert NameBindings(tmp_path / "names.json").get("other") is None


def test_many_fake_publishers_do_not_take_a_bound_name(tmp_path):
    bindings = NameBindings(tmp_path / "names.json")
    bindings.keep("llama", GOOD, [ORIGIN])
    kept = bindings.get("llama")
    # 50 peers publish a card calling another model "llama": the binding holds
    assert choose("llama", None, {GOOD: {ORIGIN}, FAKE: FAKES}, kept) == GOOD
    # and with the real model gone, the name is refused, not handed to the fakes
    with pytest.raises(NameConflict) as e:
        choose("llama", None, {FAKE: FAKES}, kept, where=bindings.path)
    msg = str(e.value)
    assert "\n" not in msg and "bound on this node to 3f2a11111111" in msg and "9c8d22222222 (50 publishers" in msg
    assert "llama@ID-PREFIX" in msg and str(bindings.path) in msg
    # nobody claims the name at all: not found (the caller lists what the swarm serves)
    assert choose("llama", None, {}, kept) is None


def test_a_name_several_models_claim_is_refused_in_one_line_listing_them():
    with pytest.raises(NameConflict) as e:
        choose("llama", None, {GOOD: {ORIGIN}, FAKE: FAKES}, None)
    msg = str(e.value)
    assert "\n" not in msg and e.value.code == "model_name_conflict"
    assert "claimed by 2 models" in msg and "none is bound on this node" in msg
    # each candidate by its ID prefix and publisher(s), most published first
    assert msg.index("9c8d22222222 (50 publishers") < msg.index("3f2a11111111 (publisher 12D3KooW…AAAAAA)")
    assert "give llama@ID-PREFIX or the model ID" in msg


def test_a_pin_chooses_among_the_models_claiming_a_name():
    claims = {GOOD: {ORIGIN}, FAKE: FAKES, FAKE2: {ORIGIN}}
    assert choose("llama", "3f2a", claims, None) == GOOD
    # a pin overrides the binding kept here (the caller then keeps the pinned one)
    assert choose("llama", "9c8e", claims, Binding(GOOD, (ORIGIN,), 0.0)) == FAKE2
    with pytest.raises(NameConflict, match=r"^2 models called 'llama' have IDs starting with 9c8: 9c8d.*9c8e.*"
                                            r"give more of the ID$"):
        choose("llama", "9c8", claims, None)
    with pytest.raises(NameConflict, match=r"^no model called 'llama' has an ID starting with abcd "
                                            r"\(models called so: "):
        choose("llama", "abcd", claims, None)
    assert choose("llama", "abcd", {}, None) is None  # nothing called so: not found


def test_specs_parse():
    assert parse_model_spec("llama") == ("llama", None)
    assert parse_model_spec("meta-llama/Llama-3.1-8B@3F2A1b") == ("meta-llama/Llama-3.1-8B", "3f2a1b")
    assert parse_model_spec("me@example") == ("me@example", None)  # not hex: part of the name
    assert model_name("llama@3f2a") == "llama" and model_name("llama") == "llama"
    with pytest.raises(BadModelSpec, match="at least 4 hex digits"):
        parse_model_spec("llama@3f2")


def test_a_corrupt_bindings_file_is_an_error_not_an_empty_one(tmp_path):
    path = tmp_path / "names.json"
    path.write_text("{not json")
    with pytest.raises(Exception, match=r"are corrupt: fix or remove the file"):
        NameBindings(path).get("llama")
    path.write_text(json.dumps({"version": 1, "names": {"llama": {"model_id": GOOD, "publishers": [ORIGIN]}}}))
    assert NameBindings(path).get("llama").model_id == GOOD


def test_the_default_file_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDNET_MODEL_NAMES", str(tmp_path / "x.json"))
    NameBindings().keep("llama", GOOD, [ORIGIN])
    assert (tmp_path / "x.json").is_file() and NameBindings(tmp_path / "x.json").all()["llama"].model_id == GOOD
