"""docs/models.md records the registry sweep (tools/family_sweep.py) for the installed
transformers: every causal LM model_type has a row, and none runs and differs."""

import re

from shardnet.testing.helpers import REPO_ROOT
from tools.family_sweep import recorded, registry

OUTCOMES = {"identical", "refused", "not constructible"}


def test_every_causal_lm_of_the_installed_transformers_has_a_row():
    rows = recorded()
    assert sorted(rows) == registry(), "rerun: python tools/family_sweep.py --markdown (docs/models.md)"
    assert {outcome for outcome, _ in rows.values()} <= OUTCOMES, "a family runs and differs"
    assert all(reason for outcome, reason in rows.values() if outcome != "identical")
    summary = re.search(r"\*\*(\d+) identical, (\d+) refused, (\d+) not\s+constructible, 0 differs",
                        (REPO_ROOT / "docs" / "models.md").read_text())
    counts = [sum(1 for o, _ in rows.values() if o == want) for want in ("identical", "refused", "not constructible")]
    assert summary and [int(g) for g in summary.groups()] == counts
