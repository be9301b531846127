"""The block-claim table (``block_claim.ClaimTable``) driven under hypothesis: signed claims from a
few peers, with random expiries, noted while the clock moves on.

Against a simple model (per peer, the newest claim noted for this model while unexpired, newest by
version then expiry): at most one claim per peer, never an expired one in ``current()``, the kept
claim is that newest one, and ``note()`` says True exactly when it changed the table."""

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from shardnet.protocols import block_claim as bc
from shardnet.transport import identity

MODEL = "ab" * 32
OTHER_MODEL = "cd" * 32
KEYS = [identity.generate() for _ in range(3)]
PEERS = [str(identity.peer_id_of(k)) for k in KEYS]


def signed_claim(i: int, expires: float, model: str = MODEL, seq: int = 0) -> bc.Claim:
    """A claim from peer ``i`` as a node gets it: encoded, signed and verified by the real codec."""
    c = bc.Claim(model=model, start=0, end=4, kv_tokens=1000, tput=12.5, addrs=("/ip4/127.0.0.1/tcp/1",),
                 expires=expires, peer=PEERS[i], seq=seq)
    return bc.decode(bc.encode(KEYS[i], c), now=0.0)  # the table, not the codec, is under test for expiry


class Table(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 1000.0
        self.table = bc.ClaimTable(MODEL)
        self.best: dict[str, bc.Claim] = {}  # the model: latest-expiring claim taken per peer

    # expiries on a coarse grid around the clock, so ties, already-expired and exactly-now all occur
    @rule(i=st.integers(0, len(KEYS) - 1), ahead=st.integers(-3, 12), seq=st.integers(0, 3))
    def note(self, i, ahead, seq):
        claim = signed_claim(i, self.now + ahead, seq=seq)
        old = self.best.get(claim.peer)
        if old is not None and old.expires <= self.now:
            old = None  # dropped by current() (the invariants call it after every step)
        should_take = claim.expires > self.now and (old is None or (claim.seq, claim.expires) > (old.seq, old.expires))
        assert self.table.note(claim, self.now) == should_take
        if should_take:
            self.best[claim.peer] = claim
        assert self.table.get(claim.peer) in (self.best.get(claim.peer), None)

    @rule(i=st.integers(0, len(KEYS) - 1), ahead=st.integers(1, 12))
    def note_another_models_claim(self, i, ahead):
        before = (sorted(self.table.current(self.now), key=lambda c: c.peer), len(self.table))
        assert not self.table.note(signed_claim(i, self.now + ahead, OTHER_MODEL), self.now)
        assert (sorted(self.table.current(self.now), key=lambda c: c.peer), len(self.table)) == before

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 3.0, 7.0]))
    def time_passes(self, dt):
        self.now += dt

    @invariant()
    def current_is_the_latest_unexpired_claim_per_peer(self):
        current = self.table.current(self.now)
        peers = [c.peer for c in current]
        assert len(peers) == len(set(peers))
        assert all(c.expires > self.now and c.model == MODEL for c in current)
        want = {p: c for p, c in self.best.items() if c.expires > self.now}
        assert {c.peer: c for c in current} == want
        assert len(self.table) == len(want)  # current() dropped the expired ones

    @invariant()
    def get_answers_the_kept_claim(self):
        for peer in PEERS:
            kept = self.best.get(peer)
            got = self.table.get(peer)
            if kept is not None and kept.expires > self.now:
                assert got == kept
            else:
                assert got is None or got == kept  # an expired one may linger until current()


TestTable = Table.TestCase
TestTable.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                              suppress_health_check=[HealthCheck.too_slow])


def test_an_expired_claim_is_never_taken_and_a_newer_one_replaces_the_old():
    t = bc.ClaimTable(MODEL)
    assert not t.note(signed_claim(0, 100.0), now=100.0)
    assert t.note(signed_claim(0, 150.0), now=100.0)
    assert not t.note(signed_claim(0, 150.0), now=100.0)  # the same expiry is not newer
    assert not t.note(signed_claim(0, 120.0), now=100.0)
    assert t.note(signed_claim(0, 200.0), now=100.0)
    assert [c.expires for c in t.current(now=100.0)] == [200.0]
    assert t.current(now=200.0) == [] and t.get(PEERS[0]) is None
