"""One logging setup for the CLI: shardnet's own records plus py-libp2p's, on stderr."""

from __future__ import annotations

import logging
import sys


def setup(verbosity: int = 0) -> None:
    """verbosity: -1 quiet (warnings), 0 info, 1 debug for shardnet, 2 debug for libp2p too."""
    level = logging.WARNING if verbosity < 0 else logging.INFO if verbosity == 0 else logging.DEBUG
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname).1s %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    from shardnet.transport import compat

    compat.apply()  # routes the libp2p logger back into ours
    # py-libp2p logs routine peer churn at WARNING; show it only when asked for (its errors are
    # re-logged under shardnet's name: compat/logger.py)
    if verbosity >= 2:
        logging.getLogger("libp2p").setLevel(logging.DEBUG)
