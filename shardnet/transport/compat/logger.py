"""py-libp2p's logger.

5. ``import libp2p`` turns off propagation of its logger: we route it back into ``logging``, and
   keep its routine warnings quiet unless a level was chosen for it.
"""

from __future__ import annotations

import logging
import os


def route_libp2p_logging() -> None:
    import libp2p  # noqa: F401  (its import is what turns propagation off)

    lg = logging.getLogger("libp2p")
    lg.propagate = True
    for h in list(lg.handlers):
        lg.removeHandler(h)
    # py-libp2p logs routine peer churn (a dial that failed, a stream reset) at WARNING, which an
    # app that embeds a node and configures no logging would see on stderr by the dozen. Its
    # import sets WARNING unless LIBP2P_DEBUG asks for more: keep that request, else stay quiet
    # (shardnet's CLI sets DEBUG with -vv; an app sets any level after opening its first node).
    if not os.environ.get("LIBP2P_DEBUG"):
        lg.setLevel(logging.CRITICAL)
