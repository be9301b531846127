"""The activation protocol's session state machines (sans-IO) under hypothesis: long random runs
of valid, replayed, reordered, out-of-place and malformed steps and results.

A block server's ``StepCursor`` must never let the KV cache grow past ``max_len`` or run a
step number twice, and a refused step must change nothing. A client's ``PendingSteps`` must
accept exactly the answers to its steps in flight, in order, and refuse everything else."""

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from shardnet.protocols import activation as ap
from shardnet.testing.factories import activation_step as step

HIDDEN, VOCAB, MAX_LEN = 8, 50, 40
SESSION = b"s" * ap.SESSION_ID_BYTES


class BlockServerSession(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cursor = ap.StepCursor(MAX_LEN, HIDDEN)
        self.taken: list[ap.Message] = []  # steps taken (computed or skipped), in order

    def offer(self, msg, *, fenced=False):
        before = (self.cursor.next_step, self.cursor.length)
        problem = self.cursor.check(msg)
        n, pos, shape = msg.n, msg.pos, msg.shape
        # the same rules, stated independently, in the order the cursor applies them
        if shape[2] != HIDDEN:
            assert problem and problem[0] == "hidden_size"
        elif n < before[0]:
            assert problem and problem[0] == "step_order"
        elif pos > before[1]:
            assert problem and problem[0] == "position"
        elif pos + shape[1] > MAX_LEN:
            assert problem and problem[0] == "too_long"
        else:
            assert problem is None
        if problem:
            assert (self.cursor.next_step, self.cursor.length) == before  # refused: nothing changed
            return
        if fenced:
            self.cursor.skip(msg)
            assert self.cursor.length == before[1]
        else:
            drop = self.cursor.advance(msg)
            assert drop == before[1] - pos and drop >= 0  # a rollback only ever drops what is cached
            assert self.cursor.length == pos + shape[1]
        self.taken.append(msg)

    @rule(gap=st.integers(0, 3), back=st.integers(0, 6), tokens=st.integers(1, 8), fenced=st.booleans())
    def next_step(self, gap, back, tokens, fenced):
        """A plausible step: a later number, starting at or below the cached length."""
        pos = max(0, self.cursor.length - back)
        self.offer(step(n=self.cursor.next_step + gap, pos=pos, tokens=tokens), fenced=fenced)

    @rule(n=st.integers(0, 60), pos=st.integers(0, 60), tokens=st.integers(1, 50),
          hidden=st.sampled_from([HIDDEN, HIDDEN, 4]))
    def any_step(self, n, pos, tokens, hidden):
        self.offer(step(n=n, pos=pos, tokens=tokens, hidden=hidden))

    @precondition(lambda self: self.taken)
    @rule(i=st.integers(0, 1000))
    def replayed(self, i):
        old = self.taken[i % len(self.taken)]
        problem = self.cursor.check(old)
        assert problem and problem[0] == "step_order"

    @invariant()
    def cache_within_max_len(self):
        assert 0 <= self.cursor.length <= MAX_LEN

    @invariant()
    def step_numbers_only_increase(self):
        numbers = [m.n for m in self.taken]
        assert numbers == sorted(set(numbers))


class ClientSession(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pending = ap.PendingSteps()
        self.sent: dict[int, tuple[int, int, int]] = {}
        self.next_n = 0
        self.length = 0
        self.answered = -1  # the highest step answered so far
        self.kind = "hidden"

    def result(self, n, pos, rows, width, kind=None):
        return ap.Result(SESSION, n=n, pos=pos, dtype="float32", shape=[1, rows, width],
                         payload=bytes(4 * rows * width), kind=kind or self.kind)

    def right_answer(self, n):
        pos, tokens, _ = self.sent[n]
        return self.result(n, pos, tokens, HIDDEN)

    @rule(back=st.integers(0, 4), tokens=st.integers(1, 6))
    def send(self, back, tokens):
        pos = max(0, self.length - back)
        self.pending.sent(self.next_n, pos, tokens)
        self.sent[self.next_n] = (pos, tokens, 1)
        self.next_n += 1
        self.length = pos + tokens

    def waiting(self):
        return [n for n in self.sent if n > self.answered]

    @precondition(lambda self: self.waiting())
    @rule(skip=st.integers(0, 2))
    def answered_in_order(self, skip):
        """The next result, or a later one (the peers dropped fenced-off steps before it)."""
        waiting = self.waiting()
        n = waiting[min(skip, len(waiting) - 1)]
        assert self.pending.answer(self.right_answer(n), kind=self.kind, hidden_size=HIDDEN, vocab=VOCAB) is None
        self.answered = n

    @precondition(lambda self: self.answered >= 0)
    @rule(i=st.integers(0, 1000))
    def replayed_or_reordered(self, i):
        """An answer to a step already answered or passed over: refused, and nothing changes."""
        n = i % (self.answered + 1)
        before = len(self.pending)
        problem = self.pending.answer(self.right_answer(n), kind=self.kind, hidden_size=HIDDEN, vocab=VOCAB)
        assert problem and "answers no step in flight" in problem
        assert len(self.pending) == before

    @rule(n=st.integers(0, 100))
    def never_sent(self, n):
        if n < self.next_n:
            return
        problem = self.pending.answer(self.result(n, 0, 1, HIDDEN), kind=self.kind, hidden_size=HIDDEN, vocab=VOCAB)
        assert problem and "answers no step in flight" in problem

    @precondition(lambda self: self.waiting())
    @rule(what=st.sampled_from(["pos", "kind", "rows", "width"]))
    def wrong_answer(self, what):
        """A result for the right step that is wrong in one way: refused (the session then ends,
        so this machine starts a fresh one)."""
        n = self.waiting()[0]
        pos, tokens, _ = self.sent[n]
        bad = {"pos": self.result(n, pos + 1, tokens, HIDDEN),
               "kind": self.result(n, pos, tokens, HIDDEN, kind="logits"),
               "rows": self.result(n, pos, tokens + 1, HIDDEN),
               "width": self.result(n, pos, tokens, HIDDEN + 1)}[what]
        assert self.pending.answer(bad, kind=self.kind, hidden_size=HIDDEN, vocab=VOCAB)
        self.__init__()


STATEFUL = settings(max_examples=150, stateful_step_count=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
TestBlockServerSession = BlockServerSession.TestCase
TestBlockServerSession.settings = STATEFUL
TestClientSession = ClientSession.TestCase
TestClientSession.settings = STATEFUL


def test_logits_results_have_one_row_per_requested_position():
    pending = ap.PendingSteps()
    pending.sent(0, 0, 5, logits_for=3)
    ok = ap.Result(SESSION, n=0, pos=0, dtype="float32", shape=[1, 3, VOCAB],
                   payload=bytes(4 * 3 * VOCAB), kind="logits")
    assert pending.answer(ok, kind="logits", hidden_size=HIDDEN, vocab=VOCAB) is None
    pending.sent(1, 5, 1, logits_for=3)  # never more rows than tokens
    wide = ap.Result(SESSION, n=1, pos=5, dtype="float32", shape=[1, 3, VOCAB],
                     payload=bytes(4 * 3 * VOCAB), kind="logits")
    assert "expected [1, 1, 50]" in pending.answer(wide, kind="logits", hidden_size=HIDDEN, vocab=VOCAB)


@pytest.mark.parametrize("pos,tokens,ok", [(38, 2, True), (38, 3, False), (10, 30, True)])
def test_a_rollback_near_max_len_counts_from_its_own_position(pos, tokens, ok):
    """The cache is cut back to ``pos`` first, so only pos + tokens must fit (the check once
    added the tokens to the length before the rollback and refused steps that fit)."""
    cursor = ap.StepCursor(MAX_LEN, HIDDEN)
    cursor.advance(step(n=0, pos=0, tokens=39))
    assert (cursor.check(step(n=1, pos=pos, tokens=tokens)) is None) == ok
