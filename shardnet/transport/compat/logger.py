"""py-libp2p's logger.

5. ``import libp2p`` turns off propagation of its logger: we route it back into ``logging``.
"""

from __future__ import annotations

import logging


def route_libp2p_logging() -> None:
    import libp2p  # noqa: F401  (its import is what turns propagation off)

    lg = logging.getLogger("libp2p")
    lg.propagate = True
    # Its own default level hides nothing we want and shows a lot we don't; leave the level to
    # shardnet's logging setup (see shardnet.logs).
    for h in list(lg.handlers):
        lg.removeHandler(h)
