"""Honest-compute checks: re-run a random sample of real steps on other peers of the same span.

A client cannot recompute what it sends through the chain (it holds only the head), but it can
ask someone else. For a sampled step of the real session it picks a span of the chain and a
**witness**: another peer serving exactly that span, or one whose span covers it and runs any
layers within (``sub_spans``, as a sub-span session). It opens an audit session through the same
chain with only that span swapped, replays the session's history before the step (every hop's
KV cache then holds what the real session's did) and sends the step's own hidden states (the
same tensor, the same wire bytes). The chain's outputs for that step must match the real ones
within a tolerance set by the coarsest dtype involved (wire and peers' compute dtypes): a
difference can only come from the swapped span.

Nothing lets a peer tell which of its real steps will be checked: the audited computation *is*
real traffic, chosen after the fact, and the re-run goes to somebody else. (The witness sees a
session that starts with a long prefill, like a healed or a fresh one.)

When outputs disagree a **referee** (a third peer of the span) settles it: the side it agrees
with is honest, the other is convicted: recorded in the reputation table, excluded from this
client's routing, reported on gossip with the signed stage receipts of the sessions involved.
With no third peer the disagreement is recorded as a dispute and nobody is excluded.

Sampling: one step in every window of ``round(1 / rate)`` results, at a random place in the
window; the span checked is the one checked least so far in this run (ties at random), so a
peer that always cheats is caught within ``window x spans with a witness`` steps. The decode
loop asks ``take_convicted()`` between steps; when a peer of its chain is convicted it rebuilds
the chain without it and re-derives the text the cheater touched (see ``decode.generate_on``).
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import trio

from shardnet.errors import InferenceError, NoRouteError
from shardnet.inference.client.request import RequestContext
from shardnet.inference.client.routing import narrowed
from shardnet.inference.client.session import open_session
from shardnet.inference.receipt_service import ReceiptService, fetch_session_receipts
from shardnet.protocols import receipt_gossip as rg
from shardnet.protocols.activation import ErrorCode
from shardnet.protocols.block_claim import Claim
from shardnet.transport.errors import ShardnetError

log = logging.getLogger(__name__)

DEFAULT_AUDIT_RATE = 0.1
AUDIT_TIMEOUT = 30.0
SETTLE_TIMEOUT = 15.0  # the most a finished request waits for its last checks
MAX_QUEUED = 4  # audits waiting their turn; more samples than that are dropped (and counted)
EVIDENCE_WAIT = 15.0
#: the largest honest difference (max |a - b| / max |b|) between two computations of the same
#: step, by dtype. Measured (bench/logit_tolerance.py, docs/security.md): a step computed in a
#: batch with other sessions' steps (continuous batching) against a witness's one-pass prefill and
#: the step alone, on CPU: 9.7e-7 in float32, 1.4e-3 in float16, 7.8e-3 in bfloat16. float16 is
#: set to 5e-3 (3.7x that) so that a peer scaling its output by 1 % (divergence 1e-2) is caught;
#: bfloat16 to 3e-2 (3.9x): a 1 % error there is within honest rounding. float32 keeps 1e-3;
#: int8 wire quantisation is not measured and keeps its earlier allowance.
TOLERANCE = {"float32": 1e-3, "float16": 5e-3, "bfloat16": 3e-2, "int8q": 8e-2, "int8": 8e-2}


def divergence(a: torch.Tensor, b: torch.Tensor) -> float:
    """How far ``a`` is from ``b``: the largest absolute difference relative to ``b``'s largest value."""
    if a.shape != b.shape:
        return math.inf
    a, b = a.float(), b.float()
    if not bool(torch.isfinite(a).all()):
        return math.inf
    return float((a - b).abs().max()) / max(float(b.abs().max()), 1e-6)


def tolerance(*dtypes: str | None) -> float:
    """The widest tolerance of the dtypes involved (unknown ones count as bfloat16)."""
    return max(TOLERANCE.get(d or "", TOLERANCE["bfloat16"]) for d in dtypes)


class AuditSchedule:
    """Which results to check: one at a random place in every window of ``round(1 / rate)``."""

    def __init__(self, rate: float, rng: random.Random | None = None) -> None:
        if not 0 <= rate <= 1:
            raise ValueError("the audit rate is a fraction between 0 and 1")
        self.rng = rng or random.Random()
        self.window = max(1, round(1 / rate)) if rate > 0 else 0
        self._i = 0
        self._pick = self.rng.randrange(self.window) if self.window else -1

    def sample(self) -> bool:
        if not self.window:
            return False
        hit = self._i == self._pick
        self._i += 1
        if self._i == self.window:
            self._i, self._pick = 0, self.rng.randrange(self.window)
        return hit


@dataclass
class AuditJob:
    """A real step as the client sent it, what came back, and the chain that computed it."""

    pos: int
    hidden: torch.Tensor  # what the first hop was fed for this step
    logits_for: int
    prefix: torch.Tensor | None  # the first hop's inputs before ``pos``
    out: torch.Tensor  # the chain's result
    route: list[Claim]
    session: str  # hex ID of the real session
    max_len: int
    tree: list[int] | None = None  # a tree step's parents (its witness's chain must take trees)


@dataclass
class AuditStats:
    sampled: int = 0
    checked: int = 0
    agreed: int = 0
    disputes: int = 0
    convictions: int = 0
    no_witness: int = 0
    superseded: int = 0  # sampled on a chain with a peer convicted since: its output is redone anyway
    incomplete: int = 0
    dropped: int = 0
    seconds: float = 0.0

    def to_json(self) -> dict:
        return dict(self.__dict__, seconds=round(self.seconds, 3))


class RunAuditor:
    """The checks of one generation. ``observe`` takes every result (cheap unless sampled);
    audits run in ``nursery`` one at a time; ``take_convicted`` hands the decode loop the peers
    to route around; ``settle`` waits for the audits still running."""

    def __init__(self, request: RequestContext, nursery: trio.Nursery, rate: float, *,
                 rng: random.Random | None = None) -> None:
        self.request, self.nursery = request, nursery
        self.rng = rng or random.Random()
        self.schedule = AuditSchedule(rate, self.rng)
        self.stats = AuditStats()
        self._turn = trio.CapacityLimiter(1)
        self._pending = 0
        self._idle = trio.Event()
        self._idle.set()
        self._convicted: list[str] = []
        self._checked: dict[str, int] = {}  # peer -> times its span was checked this run

    def observe(self, make_job: Callable[[], AuditJob]) -> None:
        """Called with every real result (as a thunk: the job is built only when sampled)."""
        if not self.schedule.sample():
            return
        self.stats.sampled += 1
        if self._pending >= MAX_QUEUED:
            self.stats.dropped += 1
            return
        self._pending += 1
        self._idle = trio.Event()
        self.nursery.start_soon(self._run, make_job())

    def take_convicted(self) -> list[str]:
        out, self._convicted = self._convicted, []
        return out

    async def settle(self, timeout: float = SETTLE_TIMEOUT) -> None:
        with trio.move_on_after(timeout):
            await self._idle.wait()

    async def _run(self, job: AuditJob) -> None:
        try:
            async with self._turn:
                t0 = time.perf_counter()
                try:
                    with trio.fail_after(AUDIT_TIMEOUT):
                        await self._audit(job)
                except (ShardnetError, trio.TooSlowError) as e:
                    # a witness that fails is not evidence against anyone
                    self.stats.incomplete += 1
                    log.info("audit not completed: %s", e)
                except Exception:  # a check must never take the generation down with it
                    self.stats.incomplete += 1
                    log.exception("audit failed")
                self.stats.seconds += time.perf_counter() - t0
        finally:
            self._pending -= 1
            if not self._pending:
                self._idle.set()

    async def _audit(self, job: AuditJob) -> None:
        if self.request.reputation.excluded() & {c.peer for c in job.route}:
            self.stats.superseded += 1
            return
        claims = await self.request.planner.usable_claims()
        in_chain = {c.peer for c in job.route}
        witnesses = {i: covering_witnesses(claims, c, in_chain) for i, c in enumerate(job.route)}
        spans = [i for i, ws in witnesses.items() if ws]
        if not spans:
            self.stats.no_witness += 1
            log.debug("audit skipped: no other peer serves any span of the chain")
            return
        k = min(spans, key=lambda i: (self._checked.get(job.route[i].peer, 0), self.rng.random()))
        target = job.route[k]
        self._checked[target.peer] = self._checked.get(target.peer, 0) + 1
        pool = list(witnesses[k])
        self.rng.shuffle(pool)
        witness = pool.pop()
        tol = tolerance(self.request.wire or _dtype_name(self.request.model.dtype), target.dtype, witness.dtype)
        self.stats.checked += 1
        w_out, w_session = await self._rerun(job, k, witness)
        d_real = divergence(job.out, w_out)
        if d_real <= tol:
            self.stats.agreed += 1
            self.request.reputation.passed(target.peer, witness.peer)
            log.debug("audit of layers %d:%d agreed (%.2g <= %.2g)", target.start, target.end, d_real, tol)
            return
        log.warning("audit of layers %d:%d: %s… and %s… disagree (%.3g > %.2g)", target.start, target.end,
                    target.peer[:12], witness.peer[:12], d_real, tol)
        if not pool:
            self.stats.disputes += 1
            self.request.reputation.dispute(target.peer, witness.peer)
            log.warning("no third peer serves layers %d:%d: dispute recorded, nobody excluded",
                        target.start, target.end)
            return
        referee = pool.pop()
        tol = max(tol, tolerance(referee.dtype))
        r_out, r_session = await self._rerun(job, k, referee)
        with_real, with_witness = divergence(job.out, r_out) <= tol, divergence(w_out, r_out) <= tol
        if with_witness and not with_real:
            accused, session = target, job.session
            honest = [(witness, w_session, d_real), (referee, r_session, divergence(job.out, r_out))]
        elif with_real and not with_witness:
            accused, session = witness, w_session
            honest = [(target, job.session, d_real), (referee, r_session, divergence(w_out, r_out))]
        else:
            self.stats.disputes += 1
            self.request.reputation.dispute(target.peer, witness.peer, referee.peer)
            log.warning("the referee agrees with neither side: dispute recorded, nobody excluded")
            return
        self.stats.convictions += 1
        evidence = {"layers": [accused.start, accused.end], "session": session, "step_pos": job.pos,
                    "divergence": min(h[2] for h in honest), "tolerance": tol,
                    "witnesses": [{"peer": c.peer, "session": s, "divergence": d} for c, s, d in honest]}
        self.request.reputation.convict(accused.peer, evidence)
        self._convicted.append(accused.peer)
        log.warning("peer %s… computed layers %d:%d wrong (off by %.3g; tolerance %.2g): excluded",
                    accused.peer[:16], accused.start, accused.end, evidence["divergence"], tol)
        # the report outlives this run (it waits for receipts): it runs in the node's receipt service
        ReceiptService.of(self.request.node).spawn(publish_report, self.request, accused.peer, evidence)

    async def _rerun(self, job: AuditJob, k: int, peer: Claim) -> tuple[torch.Tensor, str]:
        """The step's output through the real chain with span ``k`` served by ``peer``."""
        route = job.route[:k] + [peer] + job.route[k + 1:]
        try:
            async with open_session(self.request, job.max_len, route) as s:
                if job.prefix is not None:
                    await s.forward(job.prefix, pos=0)
                if job.tree is not None and not s.trees:
                    raise InferenceError(ErrorCode.UNEXPECTED, "the witness's chain does not take tree steps")
                out = await s.forward(job.hidden, pos=job.pos, logits_for=job.logits_for, tree=job.tree)
                return out, s.session.hex()
        except NoRouteError as e:
            raise InferenceError(ErrorCode.NO_ROUTE, str(e)) from None


def covering_witnesses(claims: list[Claim], hop: Claim, in_chain: set[str]) -> list[Claim]:
    """The claims that can re-run ``hop``'s layers, narrowed to them: another serving peer's (not
    one of the chain's) computing as the hop's claims to (same dtype, same quantization: an int4
    peer differs from a plain one by more than any honest tolerance), whose span is the hop's
    or, where it says ``sub_spans``, covers it."""
    return [narrowed(w, hop.start, hop.end) for w in claims
            if w.serving and w.peer not in in_chain and (w.quant, w.dtype) == (hop.quant, hop.dtype)
            and ((w.start, w.end) == (hop.start, hop.end) or (w.sub_spans and w.start <= hop.start < hop.end <= w.end))]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


async def publish_report(request: RequestContext, accused: str, evidence: dict) -> None:
    """Gather the signed receipts of the sessions involved and gossip the report (best effort:
    runs in the node's nursery, so nothing may escape)."""
    try:
        await _publish_report(request, accused, evidence)
    except Exception:
        log.exception("report on %s… failed", accused[:16])


async def _publish_report(request: RequestContext, accused: str, evidence: dict) -> None:
    node = request.node
    sessions = [(accused, evidence["session"])] + [(w["peer"], w["session"]) for w in evidence["witnesses"]]
    blobs: list[bytes | None] = [None] * len(sessions)

    async def one(i: int, peer: str, session: str) -> None:
        blobs[i] = await fetch_session_receipts(node, peer, session, wait=EVIDENCE_WAIT)

    async with trio.open_nursery() as nursery:
        for i, (peer, session) in enumerate(sessions):
            nursery.start_soon(one, i, peer, session)
    if blobs[0] is None:
        log.info("peer %s… withheld its receipt for session %s…", accused[:16], evidence["session"][:8])
    body = dict(evidence, schema=1, model=request.model.model_id, accused=accused, reporter=str(node.peer_id),
                evidence=[b for b in blobs if b is not None], t=time.time())
    body["divergence"], body["tolerance"] = float(body["divergence"]), float(body["tolerance"])
    try:
        blob = rg.encode_report(node.key_pair, body)
        evidence["report_id"] = rg.receipt_id(blob)
        evidence["evidence_receipts"] = [rg.receipt_id(b) for b in body["evidence"]]
        await node.pubsub.publish(rg.REPORT_TOPIC, blob)
        log.info("reported %s… on gossip with %d signed receipt(s)", accused[:16], len(body["evidence"]))
    except (rg.GossipError, ShardnetError) as e:
        log.warning("report on %s… not published: %s", accused[:16], e)
