"""A chain session that survives its peers: when one fails mid-request, route around it and
replay the session's history so generation continues exactly where it was.

The client is the only party that sees the whole request, so it keeps what a replacement chain
needs: the hidden states it fed the first hop for every position (overwritten when speculation
rolls back), and the steps whose results have not come back yet. On a failure (a peer
unreachable, a stream cut, a step timing out) it

1. names the failed peer: hops report the peer after them that failed (the ``peer`` field of an
   activation ``error``); failing that, it probes the chain's peers and blames those that cannot
   be reached (or, when every peer can, those that did not answer in time: they are avoided
   only briefly, since a busy peer is not a dead one);
2. finds a replacement for exactly that peer's span, keeping the rest of the chain (or, when no
   claims line up with the span's boundaries, a whole new chain), avoiding the failed peers;
3. opens a session on the healed chain, replays the history up to the oldest unanswered step in
   one step (every hop rebuilds its KV cache for those positions; the result is dropped), then
   re-sends the unanswered steps in order, so results come back under their original numbers.

Healing is invisible to the caller (``generate_on`` and speculation included) except through
``heals``: greedy output equals that of an uninterrupted run. Refusals that another chain would
not fix (a bad request, the KV budget) are raised, not healed.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field, replace

import torch
import trio

from shardnet.errors import InferenceError, NoRouteError
from shardnet.inference.client.audit import AuditJob
from shardnet.inference.client.heal_plan import HealPlan, plan_heal
from shardnet.inference.client.request import RequestContext
from shardnet.inference.client.session import open_session
from shardnet.inference.client.timing import NAMED_ERROR_WAIT, PROBE_TIMEOUT
from shardnet.protocols.activation import ErrorCode, step_start
from shardnet.protocols.block_claim import Claim
from shardnet.transport.errors import ShardnetError

log = logging.getLogger(__name__)

#: error codes that mean "this chain broke", which another chain can fix
HEALABLE = frozenset({ErrorCode.NEXT_HOP, ErrorCode.TIMEOUT, ErrorCode.IDLE, ErrorCode.UNKNOWN_SESSION})
#: how long a peer blamed only for answering a probe late is routed around (seconds)
SLOW_AVOID_S = 10.0
#: how long a heal waits for a chain round such a peer before it goes through it again (seconds)
SLOW_ROUTE_AROUND_S = 5.0


@dataclass
class Heal:
    """One recovery: who failed, where the request was, how long until it went on."""

    failed: list[str]
    layers: list[tuple[int, int]]
    phase: str  # "open", "prefill", "decode", or "audit" (left a peer caught computing wrong)
    in_flight: int  # steps unanswered when it failed (> 1: speculative chunks in flight)
    replayed_tokens: int
    seconds: float
    route: list[str]  # the healed chain's peers
    error: str

    def to_json(self) -> dict:
        return {"failed": self.failed, "layers": [list(x) for x in self.layers], "phase": self.phase,
                "in_flight": self.in_flight, "replayed_tokens": self.replayed_tokens,
                "seconds": round(self.seconds, 3), "route": self.route, "error": self.error}


@dataclass
class _Sent:
    n: int
    pos: int
    hidden: torch.Tensor
    logits_for: int
    epoch: int
    tree: list[int] | None = None
    keep: list[int] | None = None


@dataclass
class HealingSession:
    """``send``/``receive`` like ``InferenceSession``, over a chain that is replaced as peers fail.

    ``request`` gives the node and the chain's settings (sessions are opened with
    ``open_session``); its planner finds the replacement chains and avoids the failed peers.
    """

    request: RequestContext
    max_len: int
    max_heals: int = 5
    progress: object = None  # callable(event: str, info: dict) or None
    heals: list[Heal] = field(default_factory=list)
    auditor: object = None  # audit.RunAuditor: sees every result (and checks a sample)

    def __post_init__(self) -> None:
        self.route: list[Claim] = []
        self.inner = None
        self._cm = None
        self._history: torch.Tensor | None = None  # [1, max_len, hidden]: what the first hop was fed
        self.length = 0
        self._unanswered: deque[_Sent] = deque()
        self._outer_of: dict[int, int | None] = {}  # inner step -> our step (None: a replay)
        self._next = 0
        self._answered_any = False
        self._epoch = 0  # the newest speculation epoch sent
        #: the last tree step while the caches still hold its whole tree (no step kept its path
        #: or rolled back past it yet): a replay sends it again, since what follows counts on it
        self._open_tree: _Sent | None = None
        self.entered: list[tuple[object, list[Claim]]] = []  # every session opened, with its chain
        self._only_slow: set[str] = set()  # blamed for not answering a probe in time, not for being gone

    # -- lifecycle -------------------------------------------------------------------------------
    async def open(self, route: list[Claim]) -> None:
        try:
            await self._enter(route)
        except InferenceError as e:
            if e.code not in HEALABLE:
                raise
            await self._heal(e, phase="open")

    async def close(self) -> None:
        await self._exit_inner()

    async def _enter(self, route: list[Claim]) -> None:
        self.route = route
        cm = open_session(self.request, self.max_len, route)
        self.inner = await cm.__aenter__()  # on failure it has cleaned up after itself
        self._cm = cm
        self.entered.append((self.inner, route))

    async def _exit_inner(self) -> None:
        cm, self._cm, self.inner = self._cm, None, None
        if cm is not None:
            # no cancel scope of our own around this: the session's nursery must close in the
            # scope it was opened in (its close is shielded and bounded inside)
            try:
                await cm.__aexit__(None, None, None)
            except (ShardnetError, trio.TooSlowError) as e:
                log.debug("closing the broken session: %s", e)

    # -- the InferenceSession interface ----------------------------------------------------------
    @property
    def trees(self) -> bool:
        """Whether the current chain takes tree steps (it may change as the session heals)."""
        return self.inner is not None and self.inner.trees

    async def send(self, hidden: torch.Tensor, *, pos: int | None = None, logits_for: int = 1,
                   epoch: int = 0, tree: list[int] | None = None, keep: list[int] | None = None) -> int:
        pos = step_start(self.length, pos, keep)
        if pos + hidden.shape[1] > self.max_len:
            raise ValueError(f"{pos + hidden.shape[1]} positions exceed the session's max_len {self.max_len}")
        if self._history is None:
            self._history = hidden.new_zeros(1, self.max_len, hidden.shape[2])
        if keep:  # what the first hop's cache now holds at keep[0]..: the path, in order
            self._history[:, keep[0]:keep[0] + len(keep)] = self._history[:, list(keep)]
        self._history[:, pos:pos + hidden.shape[1]] = hidden
        self.length = pos + hidden.shape[1]
        sent = _Sent(self._next, pos, hidden, logits_for, epoch, tree, keep or None)
        self._epoch = max(self._epoch, epoch)
        if self._open_tree is not None and (keep or pos <= self._open_tree.pos + 1):
            self._open_tree = None
        if tree is not None:
            self._open_tree = sent
        self._next += 1
        self._unanswered.append(sent)
        self._notify("sent", {"step": sent.n, "pos": pos, "tokens": hidden.shape[1]})
        try:
            self._outer_of[await self.inner.send(hidden, pos=pos, logits_for=logits_for, epoch=epoch, tree=tree,
                                                 keep=keep or None)] = sent.n
        except InferenceError as e:
            if e.code not in HEALABLE:
                raise
            await self._heal(e)  # re-sends every unanswered step, this one included
        return sent.n

    async def receive(self) -> tuple[int, torch.Tensor]:
        while True:
            try:
                n_inner, out = await self.inner.receive()
            except InferenceError as e:
                if e.code not in HEALABLE:
                    raise
                await self._heal(e)
                continue
            n = self._outer_of.pop(n_inner, n_inner)
            if n is None:
                continue  # the result of a replay
            while self._unanswered and self._unanswered[0].n < n:
                self._unanswered.popleft()  # skipped by the peers (a stale speculative chunk)
            if self._unanswered and self._unanswered[0].n == n:
                sent = self._unanswered.popleft()
                # (a chunk of an older epoch was discarded: the history below it may since have
                # been overwritten by the newer epoch's steps, so a re-run of it from the history
                # would disagree with an honest chain)
                if self.auditor is not None and sent.epoch == self._epoch:
                    self.auditor.observe(self._audit_job(sent, out))
            self._answered_any = True
            return n, out

    def _audit_job(self, sent: _Sent, out: torch.Tensor):
        """What an honest-compute check of this result needs; built only when it is sampled (the
        history below ``sent.pos`` is still what the chain computed: later steps start above it)."""
        return lambda: AuditJob(sent.pos, sent.hidden, sent.logits_for,
                                self._history[:, :sent.pos].clone() if sent.pos else None, out, list(self.route),
                                self.inner.session.hex(), self.max_len, sent.tree)

    def served_by(self) -> set[str]:
        """Every peer that computed for this session, in any of its chains."""
        return {c.peer for _, route in self.entered for c in route}

    async def exclude(self, peers: list[str]) -> None:
        """Move to a chain without ``peers`` (caught computing wrong), starting it empty: their
        work is not trusted, so the caller re-sends from position 0 what it still needs."""
        t0 = time.perf_counter()
        old_route = list(self.route)
        await self._exit_inner()
        self._unanswered.clear()
        self._outer_of.clear()
        self.length = 0
        self._open_tree = None
        plan = plan_heal(old_route, peers)
        await self.open(await self.request.planner.find_route(avoid=plan.avoid, keep=plan.keep))
        heal = Heal(list(peers), plan.replace, "audit", 0, 0,
                    time.perf_counter() - t0, [c.peer for c in self.route], "computed wrong (honest-compute check)")
        self.heals.append(heal)
        log.warning("left %s (computed wrong): chain now %s", ", ".join(p[:16] + "…" for p in peers),
                    " -> ".join(f"{c.peer[:12]}…[{c.start}:{c.end}]" for c in self.route))
        self._notify("heal", heal.to_json())

    async def forward(self, hidden: torch.Tensor, *, pos: int | None = None, logits_for: int = 1) -> torch.Tensor:
        n = await self.send(hidden, pos=pos, logits_for=logits_for)
        got, out = await self.receive()
        if got != n:
            raise InferenceError(ErrorCode.UNEXPECTED, f"expected result {n}, got {got}")
        return out

    # -- healing ---------------------------------------------------------------------------------
    async def _heal(self, error: InferenceError, *, phase: str | None = None) -> None:
        t0 = time.perf_counter()
        phase = phase or ("decode" if self._answered_any else "prefill")
        in_flight = len(self._unanswered)
        failed = await self._name_failed(error)
        blamed = list(failed)  # everyone found failing during this recovery
        old_route = list(self.route)
        await self._exit_inner()
        log.warning("chain failed (%s); failed peer(s): %s", error,
                    ", ".join(p[:16] + "…" for p in failed) or "unknown")
        while True:
            if len(self.heals) >= self.max_heals:
                raise InferenceError(error.code, f"{error} (gave up after {self.max_heals} heals)", error.peer)
            for p in failed:
                if p in self._only_slow:
                    self.request.planner.forget_peer(p, SLOW_AVOID_S)
                else:
                    self.request.planner.forget_peer(p)
            # the old chain with each failed span replaced (a whole new chain if that cannot be done)
            plan = plan_heal(old_route, failed)
            route = await self._route_round(plan, failed)
            try:
                await self._enter(route)
                replayed = await self._replay()
                break
            except InferenceError as e:
                if e.code not in HEALABLE:
                    raise
                error = e
                failed = await self._name_failed(e)
                blamed += [p for p in failed if p not in blamed]
                await self._exit_inner()
                self.heals.append(Heal(failed, [], phase, in_flight, 0, time.perf_counter() - t0,
                                       [c.peer for c in route], f"{e} (while healing)"))
        lost = plan_heal(old_route, blamed).replace
        heal = Heal(blamed, lost, phase, in_flight, replayed, time.perf_counter() - t0,
                    [c.peer for c in route], str(error))
        self.heals.append(heal)
        log.warning("healed in %.2f s (%s, %d step(s) in flight): chain now %s; replayed %d token(s)",
                    heal.seconds, phase, in_flight, " -> ".join(f"{c.peer[:12]}…[{c.start}:{c.end}]" for c in route),
                    replayed)
        self._notify("heal", heal.to_json())

    async def _route_round(self, plan: HealPlan, failed: list[str]) -> list[Claim]:
        """A chain round the failed peers. Where those blamed now all failed only to answer a
        probe in time (busy, not gone) and no chain round them appears within
        ``SLOW_ROUTE_AROUND_S``, the chain through them again: a busy peer that is its span's
        only one makes a slower chain, not a missing one (as when every request on a killed
        replica heals onto the span's last one at once)."""
        planner = self.request.planner
        slow = {p for p in failed if p in self._only_slow and planner.probes.verdict(p) != "gone"}
        if not failed or slow != set(failed):
            return await planner.find_route(avoid=plan.avoid, keep=plan.keep)
        try:
            return await planner.find_route(avoid=plan.avoid, keep=plan.keep, timeout=SLOW_ROUTE_AROUND_S)
        except NoRouteError as e:
            log.warning("no chain round the slow peer(s) %s (%s): through them again",
                        ", ".join(p[:16] + "…" for p in slow), e)
            for p in slow:
                planner.pardon(p)
            return await planner.find_route(avoid=plan.avoid - slow, keep=plan.keep)

    async def _name_failed(self, error: InferenceError) -> list[str]:
        """The peer the chain named, or the ones that cannot be reached now, or (when all can)
        the ones that did not answer a probe in time."""
        if error.peer is None and self.inner is not None:
            # a hop's named error races the return stream closing: give it a moment
            with trio.move_on_after(NAMED_ERROR_WAIT):
                while not (self.inner.error and self.inner.error.peer):
                    await trio.sleep(0.02)
            if self.inner.error and self.inner.error.peer:
                error = self.inner.error
        me = str(self.request.node.peer_id)
        if error.peer is not None and error.peer != me:
            self._only_slow.discard(error.peer)  # (failed now, whatever a probe said of it before)
            return [error.peer]
        # (a last hop that could not open its return stream to us names us: we are not the problem)
        probes = await self.request.probes.probe([c.peer for c in self.route], max_age=0, timeout=PROBE_TIMEOUT)
        gone = [peer for peer, p in probes.items() if p.verdict == "gone"]
        if gone:
            self._only_slow.difference_update(gone)
            return gone
        slow = [peer for peer, p in probes.items() if p.verdict == "slow"]
        self._only_slow.update(slow)
        return slow

    async def _replay(self) -> int:
        """Rebuild every hop's KV cache up to the oldest unanswered step, then re-send those."""
        self._outer_of.clear()
        # Steps of an older speculation epoch were discarded by the caller: drop them. They all
        # start past the newest epoch's first position (a rejection rolls back below every chunk
        # drafted beyond it), so the history below that position is exactly what the peers held.
        epoch = max((s.epoch for s in self._unanswered), default=0)
        self._unanswered = deque(s for s in self._unanswered if s.epoch == epoch)
        upto = min((s.pos for s in self._unanswered), default=self.length)
        again = list(self._unanswered)
        tree = self._open_tree
        if tree is not None and all(s is not tree for s in again) and tree.pos < upto:
            # the caches hold a tree the next step will keep a path of: it goes again (its result
            # is dropped), not as the sequence the history holds there
            upto = tree.pos
            again.insert(0, replace(tree, n=None))
        # a path kept from a tree below ``upto`` is in the history already; one above it is not
        keeps = [s.keep if s.keep is not None and s.keep[0] >= upto else None for s in again]
        if any(s.tree is not None or keep is not None for s, keep in zip(again, keeps)) and not self.trees:
            raise InferenceError(ErrorCode.UNEXPECTED, "the healed chain does not take tree steps")
        if upto > 0:
            self._outer_of[await self.inner.send(self._history[:, :upto], pos=0, epoch=epoch)] = None
        for s, keep in zip(again, keeps):
            self._outer_of[await self.inner.send(s.hidden, pos=s.pos, logits_for=s.logits_for,
                                                 epoch=s.epoch, tree=s.tree, keep=keep)] = s.n
        return upto

    def _notify(self, event: str, info: dict) -> None:
        if self.progress is not None:
            self.progress(event, info)
