"""Prefix reuse on a block: keys and values already computed for the same inputs are copied into
a new session's cache instead of being computed again.

Sessions that share a prefix (a system prompt, few-shot examples, the earlier turns of a chat an
OpenAI-style client resends every turn) feed every block of the chain the same activations for
those positions. A block keeps what it computed for them in pages of ``PAGE`` positions: per
layer the page's keys and values, and the block's output rows for the page (what it sent on, so
that the next block, reusing its own page, is fed the very same bytes and finds it too).

**Keys.** A peer sees activations, not tokens, so a page is keyed by what the block itself
received: ``key[i] = sha256(key[i-1] | sha256 of each input row of page i)``, with ``key[-1]``
the session's *seed*: the model ID, this block's layers and dtype, and the scope (below). A
page is therefore found only by a session whose every input row up to the page's end is
bit-identical to the one that stored it, at the same positions, on the same layers: a reused
page is never served to a session whose prefix differs, whatever it claims. Nothing is taken on
the client's word: the client only opts in (``open.prefix``) and names a scope.

**Scope.** A hit's timing tells whether someone sent that prefix, so reuse is scoped: an open's
``prefix`` other than ``"shared"`` is private to the peer results return to (``open.ret``), so
one client never times another's prefixes; ``"shared"`` is one scope for all (a public system
prompt). docs/security.md says what that leaves open.

**Memory.** Pages live in the block's KV budget beside the sessions' caches (``KvBudget``):
least recently used pages are evicted when a session needs the room or a new page does; a
running session never loses memory to them. A hit copies the pages into the session's own cache
once (a copy on reuse, not copy-on-write: the session's cache stays one contiguous slab that
attention reads in place); computing them again would cost a prefill of those positions through
every layer of the block.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

#: positions per prefix page
PAGE = 64
SHARED = "shared"


@dataclass
class PrefixPage:
    kv: list[tuple[torch.Tensor, torch.Tensor] | None]  # per layer: keys, values [1, heads, PAGE, dim]
    outputs: torch.Tensor  # [PAGE, hidden]: this block's output rows for the page
    nbytes: int = 0

    def __post_init__(self) -> None:
        self.nbytes = self.outputs.nbytes + sum(k.nbytes + v.nbytes for k, v in filter(None, self.kv))


@dataclass
class PrefixStats:
    hit_pages: int = 0  # pages copied into a session instead of computed
    stored_pages: int = 0
    evicted_pages: int = 0


class PrefixStore:
    """A block's prefix pages, least recently used first. Sessions look pages up and store them
    from worker threads (and the event loop evicts for new sessions): every method holds a lock."""

    def __init__(self) -> None:
        self._pages: OrderedDict[bytes, PrefixPage] = OrderedDict()
        self._lock = threading.Lock()
        self.nbytes = 0
        self.stats = PrefixStats()

    def __len__(self) -> int:
        return len(self._pages)

    def __contains__(self, key: bytes) -> bool:
        return key in self._pages

    def get(self, key: bytes) -> PrefixPage | None:
        with self._lock:
            page = self._pages.get(key)
            if page is not None:
                self._pages.move_to_end(key)
            return page

    def put(self, key: bytes, page: PrefixPage) -> None:
        with self._lock:
            if key in self._pages:
                self._pages.move_to_end(key)
                return
            self._pages[key] = page
            self.nbytes += page.nbytes
            self.stats.stored_pages += 1

    def evict(self, nbytes: int) -> int:
        """Drop least recently used pages until ``nbytes`` are freed (or none is left)."""
        with self._lock:
            freed = 0
            while freed < nbytes and self._pages:
                _, page = self._pages.popitem(last=False)
                freed += page.nbytes
                self.stats.evicted_pages += 1
            self.nbytes -= freed
            return freed


def session_seed(model_id: str, layers: tuple[int, int], dtype: str, scope: str, ret_peer: str) -> bytes:
    """The first link of a session's page keys on a block (see the module docstring)."""
    owner = "" if scope == SHARED else ret_peer
    return hashlib.sha256("\x00".join(["shardnet-prefix/1", model_id, f"{layers[0]}:{layers[1]}", dtype,
                                       scope, owner]).encode()).digest()


def row_digests(hidden: torch.Tensor) -> list[bytes]:
    """sha256 of each position's input row, as the block computes in it. hidden: [1, T, H]."""
    rows = hidden[0].contiguous().view(torch.uint8).numpy()
    return [hashlib.sha256(row.data).digest() for row in rows]


@dataclass
class PrefixTracker:
    """One session's page keys on a block, extended as its steps are computed."""

    seed: bytes
    digests: list[bytes] = field(default_factory=list)  # per position computed so far
    keys: list[bytes] = field(default_factory=list)  # per complete page
    _rows: list[torch.Tensor] = field(default_factory=list)  # output rows of the page being filled
    storing: bool = True  # False after a rollback reopened a page whose output rows are gone

    def rollback(self, pos: int, store: PrefixStore) -> None:
        """The session's cache was cut back to ``pos`` positions."""
        if pos >= len(self.digests):
            return
        page_start = len(self.keys) * PAGE
        if pos >= page_start:  # within the page being filled
            del self._rows[pos - page_start:]
        else:  # back into a complete page: its output rows come from the store, if it still has them
            reopened = pos // PAGE
            page = store.get(self.keys[reopened])
            self._rows = list(page.outputs[:pos - reopened * PAGE]) if page is not None else []
            self.storing = self.storing and page is not None
            del self.keys[reopened:]
        del self.digests[pos:]

    def lookup(self, store: PrefixStore, pos: int, digests: list[bytes]) -> list[PrefixPage]:
        """The stored pages that continue this session at ``pos`` for the rows ``digests`` (full
        pages only, leaving at least one row to compute)."""
        if pos != len(self.digests) or pos % PAGE:
            return []
        found, key = [], self.keys[-1] if self.keys else self.seed
        for i in range((len(digests) - 1) // PAGE):
            key = _page_key(key, digests[i * PAGE:(i + 1) * PAGE])
            page = store.get(key)
            if page is None:
                break
            found.append(page)
        return found

    def record(self, digests: list[bytes], outputs: torch.Tensor, cache, store: PrefixStore,
               room) -> None:
        """The step's rows were computed (or reused): extend the keys; every page completed is
        stored (its keys and values copied out of ``cache``) when ``room(nbytes)`` grants it."""
        for digest, row in zip(digests, outputs[0]):
            self.digests.append(digest)
            self._rows.append(row)
            if len(self.digests) % PAGE == 0:
                key = _page_key(self.keys[-1] if self.keys else self.seed, self.digests[-PAGE:])
                self.keys.append(key)
                if self.storing and key not in store:
                    end = len(self.digests)
                    page = PrefixPage(cache.copy_positions(end - PAGE, end), torch.stack(self._rows).clone())
                    if room(page.nbytes):
                        store.put(key, page)
                elif key in store:
                    store.get(key)  # (recently used)
                self._rows = []


def _page_key(previous: bytes, digests: list[bytes]) -> bytes:
    h = hashlib.sha256(previous)
    for d in digests:
        h.update(d)
    return h.digest()
