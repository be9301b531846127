"""Fix 3's ``trio`` proxy, which swarm.py and yamux.py install in py-libp2p's swarm_connection and
Yamux modules (its own module, so that neither of those imports the other for it)."""

from __future__ import annotations

import types
from typing import Any

import trio


class TrioWithoutCleanupNaps(types.ModuleType):
    """``trio`` as seen by two py-libp2p modules, minus their fixed 100 ms cleanup naps."""

    def __init__(self) -> None:
        super().__init__("trio")

    def __getattr__(self, name: str) -> Any:
        return getattr(trio, name)

    @staticmethod
    async def sleep(seconds: float) -> None:
        # 0.1 s is only ever used on their close paths "to force a context switch".
        await trio.sleep(0 if seconds == 0.1 else seconds)
