"""Model names at the CLI: `shardnet models` ends with one line per name that several models
claim; ``--model NAME@ID-PREFIX`` is a name for the swarm, checked before any network."""

import pytest

from shardnet.cli.common import local_model
from shardnet.cli.model import conflict_lines
from shardnet.inference.weights.names import BadModelSpec

GOOD, FAKE = "3f2a" + "1" * 60, "9c8d" + "2" * 60


def _model(model_id, publishers, conflicts, bound_here=()):
    return {"model_id": model_id, "names": ["llama"], "publishers": publishers, "conflicts": conflicts,
            "bound_here": list(bound_here)}


def test_a_conflict_is_one_line_naming_each_model_and_the_one_bound_here():
    pubs = [f"12D3KooWFake{i}xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx" for i in range(3)]
    found = [_model(GOOD, ["12D3KooWGoodxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx123456"], {"llama": [FAKE]}),
             _model(FAKE, pubs, {"llama": [GOOD]})]
    (line,) = conflict_lines(found)
    assert line.startswith("conflict: 'llama' is claimed by 2 models: 3f2a11111111 (publisher 12D3KooW…123456), "
                           "9c8d22222222 (3 publishers: 12D3KooW…xxxxxx, …);")
    assert line.endswith("--model llama is refused here: give llama@ID-PREFIX or the model ID")
    found[0]["bound_here"] = ["llama"]
    (line,) = conflict_lines(found)
    assert "(publisher 12D3KooW…123456, bound here)" in line and line.endswith("the one bound here")
    assert conflict_lines([_model(GOOD, [], {})]) == []


def test_a_pinned_name_goes_to_the_swarm_and_a_short_pin_is_refused_at_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert local_model("llama@3f2a") is None
    with pytest.raises(BadModelSpec, match=r"^model 'llama@3f2': give at least 4 hex digits"):
        local_model("llama@3f2")
