"""The receipt-gossip protocol's two kept states driven under hypothesis, against simple models:
``ReceiptStore`` (a peer's own signed stage receipts: the newest ``capacity``, re-adding one makes
it the newest, looked up by ID and by session) and ``ReportLog`` (reports heard on gossip: only
verified ones, each once, the newest ``capacity``, the oldest heard dropped first)."""

import cbor2
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from shardnet.protocols import receipt_gossip as rg
from shardnet.protocols import receipts as rc
from shardnet.transport import identity

MODEL = "ab" * 32
SESSIONS = ["01" * 16, "02" * 16, "03" * 16]
KEYS = [identity.generate() for _ in range(3)]
PEERS = [str(identity.peer_id_of(k)) for k in KEYS]


def stage_blob(k: int, session: str, t: float) -> bytes:
    """A stage receipt signed by peer ``k`` with the real codec."""
    chain = rc.chain_of([f"{session}-{t}".encode()])
    r = rc.StageReceipt(model=MODEL, session=session, layers=[0, 4], in_chain=chain, out_chain=chain, steps_in=1,
                        steps_out=1, t_start=t, t_end=t + 1.0, peer=PEERS[k], observed={}, device={"kind": "cpu"},
                        version="0.0.0", tokens=None)
    return rc.encode_stage(KEYS[k], r)


# signed once here: the machines draw from these (signing in every step would be most of the run)
RECEIPTS = [stage_blob(i % 3, SESSIONS[i % 3], float(i)) for i in range(9)]
RECEIPT_SESSION = {rc_id: SESSIONS[i % 3] for i, rc_id in enumerate(rg.receipt_id(b) for b in RECEIPTS)}


def report_blob(n: int) -> bytes:
    """A report by peer 0 accusing peer 1, peer 2 witnessing, with their signed receipts as evidence."""
    body = {"schema": 1, "model": MODEL, "accused": PEERS[1], "layers": [0, 4], "reporter": PEERS[0],
            "session": SESSIONS[1], "step_pos": n, "divergence": 0.5, "tolerance": 0.01,
            "witnesses": [{"peer": PEERS[2], "session": SESSIONS[2], "divergence": 0.0}],
            "evidence": [stage_blob(1, SESSIONS[1], 100.0 + n), stage_blob(2, SESSIONS[2], 100.0 + n)], "t": 1.0}
    return rg.encode_report(KEYS[0], body)


def tampered(blob: bytes) -> bytes:
    m = cbor2.loads(blob)
    m["body"]["accused"] = PEERS[2]  # no longer what the reporter signed
    return cbor2.dumps(m)


REPORTS = [report_blob(n) for n in range(6)]
FORGED = [tampered(b) for b in REPORTS[:2]]


class Store(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.store = rg.ReceiptStore(capacity=4)
        self.kept: list[str] = []  # the model: receipt IDs, oldest first

    @rule(i=st.integers(0, len(RECEIPTS) - 1))
    def add(self, i):
        rid = self.store.add(RECEIPTS[i])
        assert rid == rg.receipt_id(RECEIPTS[i])
        if rid in self.kept:
            self.kept.remove(rid)
        self.kept = (self.kept + [rid])[-self.store.capacity:]

    @rule(i=st.integers(0, len(RECEIPTS) - 1))
    def add_garbage(self, i):
        with pytest.raises(rg.GossipError):
            self.store.add(RECEIPTS[i][:-3])

    @rule(limit=st.integers(0, 6))
    def digests_are_the_newest_first(self, limit):
        want = list(reversed(self.kept))[:limit] if limit else []
        assert [d["id"] for d in self.store.digests(limit)] == want

    @invariant()
    def bounded_and_as_modelled(self):
        assert len(self.store) == len(self.kept) <= self.store.capacity
        blobs = {rg.receipt_id(b): b for b in RECEIPTS}
        for rid, blob in blobs.items():
            assert self.store.get(rid) == (blob if rid in self.kept else None)
        for s in SESSIONS:
            assert self.store.for_session(s) == [blobs[r] for r in self.kept if RECEIPT_SESSION[r] == s]


class Log(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.log = rg.ReportLog(capacity=3)
        self.kept: list[str] = []  # the model: report IDs, oldest heard first

    @rule(i=st.integers(0, len(REPORTS) - 1))
    def hear(self, i):
        rid = rg.receipt_id(REPORTS[i])
        got = self.log.add(REPORTS[i])
        if rid in self.kept:  # heard before: kept where it was, not heard again
            assert got is None
        else:
            assert got is not None and got[0] == rid and got[1]["step_pos"] == i
            self.kept = (self.kept + [rid])[-self.log.capacity:]

    @rule(i=st.integers(0, len(FORGED) - 1))
    def hear_a_forgery(self, i):
        with pytest.raises(rg.GossipError):
            self.log.add(FORGED[i])

    @rule(limit=st.integers(0, 5))
    def newest_first(self, limit):
        by_id = {rg.receipt_id(b): b for b in REPORTS}
        assert self.log.newest(limit) == [by_id[r] for r in reversed(self.kept)][:limit]

    @invariant()
    def bounded_and_as_modelled(self):
        assert len(self.log) == len(self.kept) <= self.log.capacity
        assert list(self.log.reports) == self.kept == list(self.log.blobs)
        for b in REPORTS + FORGED:
            assert (rg.receipt_id(b) in self.log) == (rg.receipt_id(b) in self.kept)


STATEFUL = settings(max_examples=100, stateful_step_count=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
TestStore = Store.TestCase
TestStore.settings = STATEFUL
TestLog = Log.TestCase
TestLog.settings = STATEFUL
