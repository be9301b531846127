"""An app that embeds a node and configures no logging sees none of py-libp2p's routine warnings
on stderr, and its errors once each under shardnet's name (but for a stream a peer refused for
not speaking its protocol, routine); one that sets a level for the
"libp2p" logger (after the patches are applied, as opening a node does) gets what it asked for."""

import subprocess
import sys

SCRIPT = """
import logging, sys
from shardnet.transport import compat
compat.apply()
if sys.argv[1] == "chosen":
    logging.getLogger("libp2p").setLevel(logging.WARNING)
logging.getLogger("libp2p.network.swarm").warning("a routine dial failure")
for i in range(3):
    logging.getLogger("libp2p.kad_dht.kad_dht").error("lookup %d failed", i)
logging.getLogger("libp2p.host.basic_host").error(
    "Failed to open stream to peer 12D3KooW:\\n  Error: protocols not supported\\n  Protocols: ['/x/1.0.0']")
logging.getLogger("shardnet.app").warning("the app's own warning")
"""


def _stderr(mode: str) -> str:
    r = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=60, check=True)
    return r.stderr


def test_py_libp2p_is_quiet_in_an_app_that_set_no_level():
    err = _stderr("default")
    assert "routine dial failure" not in err and "the app's own warning" in err


def test_its_errors_are_relogged_under_shardnets_name_once_per_kind():
    err = _stderr("default")
    lines = [ln for ln in err.splitlines() if "lookup" in ln]
    assert lines == ["py-libp2p kad_dht.kad_dht: lookup 0 failed"], lines  # (lastResort: message only)
    # a stream to a peer that does not speak the protocol is routine (its caller gets the error)
    assert "Failed to open stream" not in err


def test_a_level_chosen_for_it_is_kept():
    err = _stderr("chosen")
    assert "routine dial failure" in err
    assert "lookup 2 failed" in err  # every record, as it is
