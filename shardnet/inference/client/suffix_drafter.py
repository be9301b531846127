"""Suffix drafting: a model-free drafter that continues the text the way it continued before.

After SuffixDecoding (Oliaro et al., arXiv 2411.04975). Every substring of at most ``depth``
tokens of the session's text (prompt and output so far), and optionally of earlier outputs of
the same model (a ``SuffixCache`` shared by a gateway's sessions), is counted in a suffix trie.
To draft, the drafter finds the longest suffix of the text that occurred before with something
after it, and follows the most frequent continuation, token by token, while the share of
earlier occurrences that continued that way stays at least ``min_share`` of the path's.

Against the n-gram lookup it replaces as the default model-free drafter (``NGramDrafter``: the
latest earlier occurrence of the last 1-3 tokens): the match is as long as the text allows (up
to ``depth``), so a repeated phrase is told from a token that merely occurred before, and where
the text went several ways the drafter takes the way it went most often, not the latest.

The trie grows online: each new token extends the suffixes ending before it (``depth`` dict
steps per token: ~50 us and 7-8 KB a token here, so a 4,000-token prompt costs ~0.2 s and ~30 MB
once, on the client), and each draft a match (a bisection of walks of at most ``depth`` steps)
and ``k`` steps.
"""

from __future__ import annotations

import heapq
from collections import deque

import torch

from shardnet.inference.client.sampling import Randomness, SamplingParams
from shardnet.inference.client.speculative import point_masses

#: the longest substring counted (and so the longest match): SuffixDecoding's trees go to 64;
#: a match of 24 tokens already names a repeat, and each token costs ``depth`` dict steps
DEFAULT_DEPTH = 24
#: stop drafting where the continuation taken was seen in fewer than this share of the path's
#: earlier occurrences (SuffixDecoding scores a draft by such empirical probabilities)
DEFAULT_MIN_SHARE = 0.2


class _Node:
    __slots__ = ("count", "last", "children")

    def __init__(self) -> None:
        self.count = 0
        self.last = -1  # where the substring's latest occurrence ended (tokens fed before it)
        self.children: dict[int, _Node] = {}


class SuffixTrie:
    """Counts of every substring of at most ``depth`` tokens of the sequences fed to it. With
    ``undo``, the last sequence's tokens can be taken back (``truncate``): a drafter asked about
    a text whose unverified drafts were rejected forgets them."""

    def __init__(self, depth: int = DEFAULT_DEPTH, *, undo: bool = False) -> None:
        if depth < 2:
            raise ValueError(f"suffix trie depth {depth}: at least 2 (a token and what follows it)")
        self.depth = depth
        self.root = _Node()
        self.tokens = 0  # tokens fed, all sequences together
        self._open: list[_Node] = []  # nodes of the suffixes ending at the last token fed
        #: per token of the current sequence (with undo): the (parent, token, node, node's last
        #: before) it counted in
        self._steps: list[list[tuple[_Node, int, _Node, int]]] | None = [] if undo else None

    def start(self) -> None:
        """A new sequence begins: nothing fed before continues into it."""
        self._open = []
        if self._steps is not None:
            self._steps = []

    def feed(self, tokens) -> None:
        depth, root, steps = self.depth, self.root, self._steps
        opened = self._open
        for t in tokens:
            nxt = []
            counted = []
            for node in (root, *opened[:depth - 1]):
                child = node.children.get(t)
                if child is None:
                    child = node.children[t] = _Node()
                child.count += 1
                counted.append((node, t, child, child.last))
                child.last = self.tokens
                nxt.append(child)
            opened = nxt
            self.tokens += 1
            if steps is not None:
                steps.append(counted)
        self._open = opened

    def __len__(self) -> int:
        """Tokens of the current sequence (with undo)."""
        return len(self._steps) if self._steps is not None else 0

    def truncate(self, n: int) -> None:
        """Take back the current sequence's tokens after its first ``n`` (with undo)."""
        steps = self._steps
        if steps is None:
            raise ValueError("this suffix trie keeps no undo steps")
        while len(steps) > n:
            for parent, t, child, last in reversed(steps.pop()):
                child.count -= 1
                child.last = last
                if child.count == 0:
                    del parent.children[t]
            self.tokens -= 1
        self._open = [child for _, _, child, _ in steps[-1]] if steps else []

    def match(self, ids: list[int]) -> tuple[int, _Node | None]:
        """The longest suffix of ``ids`` (at most ``depth`` - 1 tokens) that occurred with a
        continuation: its length and its node; (0, None) where even the last token never went
        on. Occurring with a continuation is suffix-closed (a shorter suffix went on wherever a
        longer one did), so the longest is found by bisection."""
        lo, hi, best = 1, min(len(ids), self.depth - 1), None
        while lo <= hi:
            mid = (lo + hi) // 2
            node = self._walk(ids[len(ids) - mid:])
            if node is not None and node.children:
                best, lo = (mid, node), mid + 1
            else:
                hi = mid - 1
        return best if best is not None else (0, None)

    def _walk(self, seq) -> _Node | None:
        node = self.root
        for t in seq:
            node = node.children.get(t)
            if node is None:
                return None
        return node


class SuffixCache:
    """Earlier outputs of one model, shared by the sessions that opt in (a gateway's, say): the
    last ``max_tokens`` tokens of them (of an output longer than that, its end), one suffix trie
    per output, so that taking one in or letting the oldest go costs what that output does (one
    trie over them all would have to be rebuilt, or pruned node by node, stalling the event loop
    for a second at 20,000 tokens). A drafter matches each output's trie."""

    def __init__(self, max_tokens: int = 20_000, depth: int = DEFAULT_DEPTH) -> None:
        self.max_tokens, self.depth = max_tokens, depth
        self._tries: deque[SuffixTrie] = deque()
        self._kept = 0

    @property
    def tries(self) -> tuple[SuffixTrie, ...]:
        """One per output kept, oldest first."""
        return tuple(self._tries)

    @property
    def tokens(self) -> int:
        return self._kept

    def add(self, tokens: list[int]) -> None:
        """One finished output (its prompt left out: prompts are the session's own)."""
        tokens = list(tokens[-self.max_tokens:])
        if not tokens:
            return
        trie = SuffixTrie(self.depth)
        trie.start()
        trie.feed(tokens)
        self._tries.append(trie)
        self._kept += len(tokens)
        while self._kept > self.max_tokens and len(self._tries) > 1:
            self._kept -= self._tries.popleft().tokens


class SuffixDrafter:
    """Drafts by suffix match over the session's text (and a shared ``SuffixCache``, if given).
    One drafter per generation: it follows the text it is asked about (the accepted text and the
    drafts still in flight), feeding what is new since its last call and taking back what is no
    longer there (drafts rejected since)."""

    name = "suffix"

    def __init__(self, *, depth: int = DEFAULT_DEPTH, min_share: float = DEFAULT_MIN_SHARE,
                 cache: SuffixCache | None = None) -> None:
        self.depth, self.min_share, self.cache = depth, min_share, cache
        self.trie = SuffixTrie(depth, undo=True)
        self._seen: list[int] = []  # the text the trie holds, in order

    def propose(self, ids: list[int], k: int) -> list[int]:
        if k <= 0 or not ids:
            return []
        self._follow(ids)
        best: list[int] = []
        for trie in (self.trie, *(self.cache.tries if self.cache is not None else ())):
            drafts = self._draft(trie, ids, k)
            if len(drafts) > len(best):
                best = drafts
        return best

    def _draft(self, trie: SuffixTrie, ids: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens: the continuation of the longest match, matched again from the
        drafted end wherever the trie's depth ends a continuation (a match of m tokens can go
        on for at most ``depth`` - m)."""
        out: list[int] = []
        share = 1.0
        while len(out) < k:
            _, node = trie.match(ids[-trie.depth:] + out if out else ids)  # (a match reads < depth tokens)
            if node is None:
                break
            got, share = self._continue(node, k - len(out), share, first=not out)
            if not got:
                break
            out += got
        return out

    def sample(self, ids: list[int], k: int, params: SamplingParams, rng: Randomness,
               vocab_size: int) -> tuple[list[int], torch.Tensor]:
        return point_masses(self.propose(ids, k), vocab_size)  # deterministic given the text

    def propose_tree(self, ids: list[int], nodes: int, floor: float | None = None) -> tuple[list[int], list[int]]:
        """Up to ``nodes`` drafted tokens as a tree (tokens, parent indices: -1 for the text;
        parents before children): from the longest match, the continuations with the highest
        empirical probability (the product of the shares of the earlier occurrences that went
        each way), best first, as SuffixDecoding grows its speculation trees. Where a path
        reaches the trie's depth it is not matched again (``propose`` does, for a chain). Paths
        less likely than ``floor`` (default: a quarter of ``min_share``) are left out; the root's
        continuations never are."""
        if nodes <= 0 or not ids:
            return [], []
        floor = self.min_share / 4 if floor is None else floor
        self._follow(ids)
        _, start = self.trie.match(ids)
        if start is None:
            return [], []
        tokens: list[int] = []
        parents: list[int] = []
        heap: list[tuple[float, int, int, int, _Node]] = []  # (-probability, order, parent, token, its node)
        order = 0

        def offer(node: _Node, parent: int, p: float) -> None:
            nonlocal order
            total = sum(c.count for c in node.children.values())
            for token, child in node.children.items():
                q = p * child.count / total
                if q >= floor or parent == -1:
                    heapq.heappush(heap, (-q, order, parent, token, child))
                    order += 1

        offer(start, -1, 1.0)
        while heap and len(tokens) < nodes:
            neg_p, _, parent, token, child = heapq.heappop(heap)
            tokens.append(token)
            parents.append(parent)
            offer(child, len(tokens) - 1, -neg_p)
        return tokens, parents

    def _continue(self, node: _Node, k: int, share: float, *, first: bool) -> tuple[list[int], float]:
        out: list[int] = []
        while len(out) < k and node.children:
            # the most frequent continuation; of equally frequent ones the latest (text repeats
            # what it said last more often than what it said first: measured, docs/benchmarks.md)
            token, child = max(node.children.items(), key=lambda kv: (kv[1].count, kv[1].last))
            share *= child.count / max(1, sum(c.count for c in node.children.values()))
            if share < self.min_share and (out or not first):
                break
            out.append(token)
            node = child
        return out, share

    def _follow(self, ids: list[int]) -> None:
        """Make the trie hold ``ids``: keep the prefix it shares with what it holds, take back
        the rest (rejected drafts), feed what is new."""
        seen = self._seen
        n = len(seen)
        if len(ids) < n or ids[:n] != seen:
            lo, hi = 0, min(n, len(ids))  # the longest common prefix, by bisection on C-speed compares
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if ids[:mid] == seen[:mid]:
                    lo = mid
                else:
                    hi = mid - 1
            self.trie.truncate(lo)
            del seen[lo:]
            n = lo
        self.trie.feed(ids[n:])
        seen.extend(ids[n:])
