"""README's "As a library" snippet, as a newcomer would paste it: against a real bootstrap node it
connects, and prints its peer ID, its addresses and the peers it sees (the bootstrap among them)."""

import re
import subprocess
import sys

import pytest

from shardnet.testing.helpers import REPO_ROOT
from shardnet.testing.localswarm import LocalSwarm

pytestmark = pytest.mark.slow


def test_the_library_snippet_runs_and_sees_the_swarm(tmp_path):
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme.split("## As a library", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    with LocalSwarm(tmp_path) as swarm:
        boot = swarm.start_bootstrap()
        code = code.replace("/ip4/127.0.0.1/tcp/4001/p2p/12D3KooW...", boot)
        assert boot in code  # the snippet's placeholder address is the one replaced
        script = tmp_path / "snippet.py"
        script.write_text(code)
        r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    boot_id = boot.rsplit("/p2p/", 1)[1]
    assert boot_id in r.stdout, r.stdout  # node.peers() names the bootstrap
