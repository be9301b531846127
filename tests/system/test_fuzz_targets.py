"""Every network decoder (fuzz/targets.py) under hypothesis: random bytes, CBOR of any shape, and
mutations of valid encodings either decode or raise the codec's typed error. The atheris harness
(fuzz/run.py) runs the same targets coverage-guided; a short run of it is checked here too."""

import subprocess
import sys
from pathlib import Path

import cbor2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardnet.testing.helpers import REPO_ROOT

ROOT = REPO_ROOT

from fuzz.targets import TARGETS, check  # noqa: E402

NAMES = sorted(TARGETS)
CBOR_TARGETS = [n for n in NAMES if not n.startswith(("nat.", "framing", "activation.stream"))]
cbor_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8) | st.integers(), inner, max_size=5),
    max_leaves=20)
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("name", NAMES)
@FUZZ
@given(data=st.binary(max_size=2048))
def test_random_bytes(name, data):
    check(name, data)


@pytest.mark.parametrize("name", CBOR_TARGETS)
@FUZZ
@given(value=cbor_values)
def test_cbor_of_any_shape(name, value):
    check(name, cbor2.dumps(value))


@st.composite
def mutated(draw, seeds):
    data = bytearray(draw(st.sampled_from(seeds)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "cut", "insert", "huge"]))
        i = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "cut":
            del data[i:]
        elif op == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif op == "huge" and len(data) >= 4:  # a declared length far beyond the data
            data[i:i + 4] = b"\xff\xff\xff\x7f"
    return bytes(data)


@pytest.mark.parametrize("name", [n for n in NAMES if TARGETS[n].seeds])
@FUZZ
@given(st.data())
def test_mutated_valid_encodings(name, data):
    check(name, data.draw(mutated(TARGETS[name].seeds)))


def test_atheris_harness_runs_every_target():
    pytest.importorskip("atheris", reason="atheris wheels exist for Linux x86_64 only")
    r = subprocess.run([sys.executable, str(ROOT / "fuzz" / "run.py"), "all", "--runs", "50000"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT / "fuzz")
    assert r.returncode == 0 and "Done 50000 runs" in r.stderr, r.stderr[-3000:]
