"""An app that embeds a node and configures no logging sees none of py-libp2p's routine warnings
on stderr; one that sets a level for the "libp2p" logger (after the patches are applied, as
opening a node does) gets what it asked for."""

import subprocess
import sys

SCRIPT = """
import logging, sys
from shardnet.transport import compat
compat.apply()
if sys.argv[1] == "chosen":
    logging.getLogger("libp2p").setLevel(logging.WARNING)
logging.getLogger("libp2p.network.swarm").warning("a routine dial failure")
logging.getLogger("shardnet.app").warning("the app's own warning")
"""


def _stderr(mode: str) -> str:
    r = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=60, check=True)
    return r.stderr


def test_py_libp2p_is_quiet_in_an_app_that_set_no_level():
    err = _stderr("default")
    assert "routine dial failure" not in err and "the app's own warning" in err


def test_a_level_chosen_for_it_is_kept():
    assert "routine dial failure" in _stderr("chosen")
