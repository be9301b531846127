"""py-libp2p's logger.

5. ``import libp2p`` turns off propagation of its logger: we route it back into ``logging``, and
   keep its routine warnings quiet unless a level was chosen for it; its errors are re-logged
   under shardnet's name, one line per kind at most every 10 s.
"""

from __future__ import annotations

import logging
import os

from ..limits import ThrottledLog

#: the level py-libp2p's logger has unless someone chose one: its errors, not its routine churn
QUIET_LEVEL = logging.ERROR
#: where its errors are re-logged (at WARNING: they are py-libp2p's, and shardnet goes on)
relog = logging.getLogger("shardnet.transport.libp2p")


class _Forward(logging.Handler):
    """At the quiet level, an error is re-logged under shardnet's name (the first of a kind at
    once, then one line per 10 s with the count since); at a level someone chose, every record
    goes on to the app's handlers as it is."""

    def __init__(self) -> None:
        super().__init__()
        self._relog = ThrottledLog(relog, logging.WARNING, most_keys=1024)

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger("libp2p").level < QUIET_LEVEL:
            logging.getLogger().handle(record)
            return
        try:
            text = record.getMessage()
        except Exception:  # a record whose arguments do not fit its message: say what it was
            text = str(record.msg)
        first = text.splitlines()[0] if text else ""
        if first.startswith("Failed to open stream") and "not supported" in text:
            # a peer that does not speak a protocol (asked anyway: a lookup asks every server
            # of a small network for claims): the caller gets ProtocolNotSupported; routine
            relog.debug("py-libp2p %s: %s", record.name.removeprefix("libp2p."), " ".join(text.split()))
            return
        self._relog.log((record.name, record.msg), f"py-libp2p {record.name.removeprefix('libp2p.')}: {first}")


def route_libp2p_logging() -> None:
    import libp2p  # noqa: F401  (its import is what turns propagation off)

    lg = logging.getLogger("libp2p")
    for h in list(lg.handlers):
        lg.removeHandler(h)
    # py-libp2p logs routine peer churn (a dial that failed, a stream reset) at WARNING, which an
    # app that embeds a node and configures no logging would see on stderr by the dozen. Its
    # import sets WARNING unless LIBP2P_DEBUG asks for more: keep that request, else stay at
    # QUIET_LEVEL (shardnet's CLI sets DEBUG with -vv; an app sets any level after opening its
    # first node). Its records reach the app's handlers through _Forward, not by propagation.
    lg.propagate = False
    lg.addHandler(_Forward())
    if not os.environ.get("LIBP2P_DEBUG"):
        lg.setLevel(QUIET_LEVEL)
