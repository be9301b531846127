"""The registry sweep (tools/family_sweep.py) as docs/models.md records it: every causal LM of the
installed transformers made as a random checkpoint, run through a client's and two peers' checks
and blocks against transformers; each family ends as recorded, and none runs and differs. Two
processes, half the registry each (48 s on an idle 2-core machine; 6 min under a load of 7)."""

import json
import subprocess
import sys

import pytest

from shardnet.testing.helpers import REPO_ROOT
from tools.family_sweep import recorded


@pytest.mark.slow
def test_every_family_ends_as_recorded_and_none_differs(tmp_path):
    want = recorded()
    families = sorted(want)
    halves = [families[0::2], families[1::2]]
    procs = [subprocess.Popen([sys.executable, str(REPO_ROOT / "tools" / "family_sweep.py"),
                               "--families", ",".join(half), "--json", str(tmp_path / f"{n}.json")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for n, half in enumerate(halves)]
    try:
        outs = [p.communicate(timeout=900) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    got = {}
    for n, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert "DIFFERS" not in out, out
        assert p.returncode == 0, err[-2000:]
        got.update(json.loads((tmp_path / f"{n}.json").read_text()))
    changed = {f: (want[f][0], got[f][0], got[f][1]) for f in families if got[f][0] != want[f][0]}
    assert not changed, f"rerun tools/family_sweep.py --markdown into docs/models.md: {changed}"
