"""The activation protocol's two session machines (``activation_session``) driven like their
drivers drive them, under hypothesis: random runs of steps with rollbacks, skipped numbers and
speculation epochs through a block server's queue, and of results answered, skipped, replayed
and reordered at a client.

Block side: the cache the actions describe never holds more than ``max_len`` positions and
matches the machine's, steps are computed in increasing order, a rollback only drops what is
cached, and a chunk with a newer epoch queued behind it is never computed. Client side: a result
is accepted at most once, only for a step in flight, in order."""

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from shardnet.protocols import activation as ap
from shardnet.testing.factories import activation_step as step
from shardnet.protocols.activation_session import (
    BlockSession,
    ClientSession,
    Compute,
    End,
    Failure,
    ForwardClose,
    Relay,
    ReplyError,
    Skip,
    answer_to_open,
)

HIDDEN, VOCAB, MAX_LEN = 8, 50, 40
SESSION = b"s" * ap.SESSION_ID_BYTES
OTHER = b"o" * ap.SESSION_ID_BYTES
ME = ap.PeerRef("12D3KooWclient", ["/ip4/127.0.0.1/tcp/1"])


def open_(chain=(), logits=False, wire=None):
    return ap.Open(SESSION, model="ab" * 32, layers=(0, 2), max_len=MAX_LEN, chain=chain, ret=ME, logits=logits,
                   wire=wire)


class BlockServer(RuleBasedStateMachine):
    """A block server's step loop: the client's steps wait in the driver's queue; each delivery
    hands the machine the head and what is queued behind it, and carries out the action on a
    model of the KV cache (a list: the step number that wrote each position)."""

    def __init__(self) -> None:
        super().__init__()
        self.fresh()

    def fresh(self) -> None:
        self.machine = BlockSession(open_(), HIDDEN)
        self.machine.ready()
        self.cache: list[int] = []
        self.queue: list[ap.Step] = []
        self.client_length = 0  # where the client's next step starts by default
        self.client_next = 0
        self.epoch = 0
        self.computed: list[int] = []
        self.handled: list[int] = []  # step numbers computed or skipped, in order

    @rule(gap=st.integers(0, 2), back=st.integers(0, 5), tokens=st.integers(1, 6), new_epoch=st.booleans())
    def client_sends(self, gap, back, tokens, new_epoch):
        """What an honest client sends: later numbers; a new epoch starts where the results it
        has verified end (within what the server has computed: the chunks queued before it are
        fenced off)."""
        pos = max(0, self.client_length - back)
        if new_epoch:
            self.epoch += 1
            pos = min(pos, len(self.cache))
        if pos + tokens > MAX_LEN:
            return
        n = self.client_next + gap
        self.queue.append(step(n=n, pos=pos, tokens=tokens, epoch=self.epoch))
        self.client_next, self.client_length = n + 1, pos + tokens

    @precondition(lambda self: self.queue)
    @rule()
    def deliver(self):
        msg, behind = self.queue[0], self.queue[1:]
        fenced = any(m.epoch > msg.epoch for m in behind)
        before = len(self.cache)
        action = self.machine.receive(msg, behind)
        self.queue.pop(0)
        if fenced:
            assert action == Skip(msg)  # a fenced chunk is never computed
            assert len(self.cache) == before
        else:
            assert isinstance(action, Compute) and action.step == msg
            assert action.drop == before - msg.pos and action.drop >= 0  # a rollback only drops what is cached
            del self.cache[len(self.cache) - action.drop:]
            self.cache += [msg.n] * msg.tokens
            self.computed.append(msg.n)
        self.handled.append(msg.n)
        assert not self.machine.ended

    @precondition(lambda self: self.handled)
    @rule(i=st.integers(0, 1000))
    def replayed(self, i):
        """A step number already used up (computed or skipped) ends the session."""
        n = self.handled[i % len(self.handled)]
        action = self.machine.receive(step(n=n, pos=0, tokens=1))
        assert isinstance(action, ReplyError) and action.code == "step_order" and action.n == n
        assert self.machine.ended
        self.fresh()

    @rule(ahead=st.integers(1, 5))
    def past_the_cache(self, ahead):
        """A step may roll back, never start past what the cache holds."""
        self.queue.clear()
        action = self.machine.receive(step(n=self.far(), pos=len(self.cache) + ahead, tokens=1))
        assert isinstance(action, ReplyError) and action.code == "position"
        self.fresh()

    @rule(tokens=st.integers(1, 60))
    def too_long(self, tokens):
        self.queue.clear()
        n = self.far()
        action = self.machine.receive(step(n=n, pos=len(self.cache), tokens=tokens))
        if len(self.cache) + tokens > MAX_LEN:
            assert isinstance(action, ReplyError) and action.code == "too_long"
            self.fresh()
        else:
            assert isinstance(action, Compute)
            self.cache += [n] * tokens
            self.computed.append(n)
            self.handled.append(n)
            self.client_next, self.client_length = n + 1, len(self.cache)

    def far(self) -> int:
        """A step number past any the client has sent."""
        return max(self.client_next, self.machine.cursor.next_step) + 100

    @rule(what=st.sampled_from(["other_session", "ready", "open", "result", "wrong_hidden", "close", "eof"]))
    def ending(self, what):
        """Whatever is not a step of this session ends it; only close (and end of stream) quietly."""
        far = self.far()
        msg = {"other_session": step(n=far, pos=0, tokens=1, session=OTHER), "ready": ap.Ready(SESSION),
               "open": open_(),
               "result": ap.Result(SESSION, n=far, pos=0, dtype="float32", shape=[1, 1, HIDDEN],
                                   payload=bytes(4 * HIDDEN)),
               "wrong_hidden": step(n=far, pos=0, tokens=1, hidden=HIDDEN + 1), "close": ap.Close(SESSION),
               "eof": None}[what]
        action = self.machine.end_of_input() if msg is None else self.machine.receive(msg)
        expected = {"other_session": "unknown_session", "ready": "unexpected", "open": "unexpected",
                    "result": "unexpected", "wrong_hidden": "hidden_size"}
        if what in expected:
            assert isinstance(action, ReplyError) and action.code == expected[what]
            assert action.session == msg.session  # the reply names the frame's session
        else:
            assert isinstance(action, End)  # the last hop: nothing to pass on
        assert self.machine.ended
        with pytest.raises(RuntimeError):
            self.machine.receive(step(n=far + 1, pos=0, tokens=1))
        self.fresh()

    @invariant()
    def cache_matches_the_machine_and_max_len(self):
        assert len(self.cache) == self.machine.cursor.length <= MAX_LEN

    @invariant()
    def steps_are_handled_in_increasing_order(self):
        assert self.handled == sorted(set(self.handled))


class Client(RuleBasedStateMachine):
    """A client's session: steps sent (with rollbacks), results answered in order (possibly
    skipping steps the peers fenced off), replayed, reordered or never asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.fresh()

    def fresh(self) -> None:
        self.machine = ClientSession(SESSION, first_peer="first", last_peer="last", kind="hidden",
                                     hidden_size=HIDDEN, vocab=VOCAB)
        assert self.machine.opened(ap.Ready(SESSION)) is None
        self.sent: dict[int, ap.Step] = {}
        self.accepted: list[int] = []
        self.passed = -1  # the highest step answered or passed over

    def result_for(self, s: ap.Step, **changes) -> ap.Result:
        f = {"n": s.n, "pos": s.pos, "dtype": "float32", "shape": [1, s.tokens, HIDDEN],
             "payload": bytes(4 * s.tokens * HIDDEN), **changes}
        return ap.Result(SESSION, **f)

    def waiting(self) -> list[int]:
        return [n for n in self.sent if n > self.passed]

    @rule(back=st.integers(0, 4), tokens=st.integers(1, 6), default_pos=st.booleans())
    def send(self, back, tokens, default_pos):
        pos = None if default_pos else max(0, self.machine.length - back)
        s = self.machine.step(dtype="float32", shape=[1, tokens, HIDDEN], payload=bytes(4 * tokens * HIDDEN),
                              pos=pos)
        assert s.n == (max(self.sent) + 1 if self.sent else 0)
        assert s.pos == (self.machine.length if pos is None else pos)
        self.machine.sent(s)
        self.sent[s.n] = s
        assert self.machine.length == s.pos + tokens

    @rule(ahead=st.integers(1, 5))
    def position_past_the_end(self, ahead):
        with pytest.raises(ValueError):
            self.machine.step(dtype="float32", shape=[1, 1, HIDDEN], payload=bytes(4 * HIDDEN),
                              pos=self.machine.length + ahead)

    @precondition(lambda self: self.waiting())
    @rule(skip=st.integers(0, 2))
    def answered(self, skip):
        waiting = self.waiting()
        n = waiting[min(skip, len(waiting) - 1)]
        got = self.machine.result(self.result_for(self.sent[n]))
        assert isinstance(got, ap.Result) and got.n == n
        self.accepted.append(n)
        self.passed = n

    @precondition(lambda self: self.passed >= 0)
    @rule(i=st.integers(0, 1000))
    def replayed_or_reordered(self, i):
        n = i % (self.passed + 1)
        before = len(self.machine.pending)
        got = self.machine.result(self.result_for(self.sent[n])) if n in self.sent else self.machine.result(
            ap.Result(SESSION, n=n, pos=0, dtype="float32", shape=[1, 1, HIDDEN], payload=bytes(4 * HIDDEN)))
        assert isinstance(got, Failure) and got.code == "unexpected" and got.peer == "last"
        assert "answers no step in flight" in got.message
        assert len(self.machine.pending) == before

    @precondition(lambda self: self.waiting())
    @rule(what=st.sampled_from(["pos", "kind", "rows", "width"]))
    def wrong_answer(self, what):
        s = self.sent[self.waiting()[0]]
        bad = {"pos": self.result_for(s, pos=s.pos + 1), "kind": self.result_for(s, kind="logits"),
               "rows": self.result_for(s, shape=[1, s.tokens + 1, HIDDEN], payload=bytes(4 * (s.tokens + 1) * HIDDEN)),
               "width": self.result_for(s, shape=[1, s.tokens, HIDDEN + 1],
                                        payload=bytes(4 * s.tokens * (HIDDEN + 1)))}[what]
        got = self.machine.result(bad)
        assert isinstance(got, Failure) and got.code == "unexpected" and got.peer == "last"
        self.fresh()  # the client gives the session up

    @rule(what=st.sampled_from(["eof", "error", "step", "ready"]))
    def upstream(self, what):
        """Once ready only errors travel upstream, and anything there ends the session."""
        msg = {"eof": None, "error": ap.Error(SESSION, "kv_budget", "full", peer="mid"),
               "step": step(n=0, pos=0, tokens=1), "ready": ap.Ready(SESSION)}[what]
        got = self.machine.upstream(msg)
        want = {"eof": Failure("next_hop", "the first hop closed the stream", "first"),
                "error": Failure("kv_budget", "full", "mid"),
                "step": Failure("unexpected", "the first hop sent step upstream", "first"),
                "ready": Failure("unexpected", "the first hop sent ready upstream", "first")}[what]
        assert got == want and self.machine.failure == want
        with pytest.raises(RuntimeError):
            self.machine.step(dtype="float32", shape=[1, 1, HIDDEN], payload=bytes(4 * HIDDEN))
        self.fresh()

    @invariant()
    def each_result_accepted_once_in_order(self):
        assert self.accepted == sorted(set(self.accepted))
        assert all(n in self.sent for n in self.accepted)


STATEFUL = settings(max_examples=150, stateful_step_count=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
TestBlockServer = BlockServer.TestCase
TestBlockServer.settings = STATEFUL
TestClient = Client.TestCase
TestClient.settings = STATEFUL


# -- the edges the machines above do not walk -----------------------------------------------------
def test_a_middle_hop_opens_the_rest_of_the_chain_and_passes_steps_and_close_on():
    hops = [ap.Hop("b", ["/b"], (2, 4)), ap.Hop("c", ["/c"], (4, 6))]
    m = BlockSession(open_(chain=hops, logits=True, wire="float16"), HIDDEN)
    assert not m.last and not m.returns_logits
    target, first = m.downstream()
    assert target == hops[0]
    assert first == ap.Open(SESSION, model="ab" * 32, layers=(2, 4), max_len=MAX_LEN, chain=hops[1:], ret=ME,
                            logits=True, wire="float16")
    with pytest.raises(RuntimeError):  # no step before ready
        m.receive(step(n=0, pos=0, tokens=1))
    assert m.ready() == ap.Ready(SESSION)
    s = ap.Step(SESSION, n=4, pos=0, dtype="float32", shape=[1, 1, HIDDEN], payload=bytes(4 * HIDDEN),
                logits_for=3, epoch=2)
    assert m.receive(s) == Compute(s, 0)
    out = m.output(s, dtype="float16", shape=[1, 1, HIDDEN], payload=bytes(2 * HIDDEN), kind="hidden")
    assert out == ap.Step(SESSION, n=4, pos=0, dtype="float16", shape=[1, 1, HIDDEN], payload=bytes(2 * HIDDEN),
                          logits_for=3, epoch=2)
    assert m.receive(ap.Close(SESSION)) == ForwardClose(ap.Close(SESSION))


def test_the_last_hop_attaches_to_the_client_and_returns_results():
    m = BlockSession(open_(logits=True), HIDDEN)
    assert m.last and m.returns_logits
    assert m.downstream() == (ME, ap.Attach(SESSION))
    m.ready()
    s = step(n=0, pos=0, tokens=3)
    out = m.output(s, dtype="float32", shape=[1, 1, VOCAB], payload=bytes(4 * VOCAB), kind="logits")
    assert out == ap.Result(SESSION, n=0, pos=0, dtype="float32", shape=[1, 1, VOCAB], payload=bytes(4 * VOCAB),
                            kind="logits")


@pytest.mark.parametrize("msg,action", [
    (None, ReplyError(SESSION, "next_hop", "next hop closed the stream", peer="c")),
    (ap.Error(SESSION, "kv_budget", "full", peer="d"), Relay(ap.Error(SESSION, "kv_budget", "full", peer="d"))),
    (step(n=0, pos=0, tokens=1), ReplyError(SESSION, "unexpected", "the next hop sent step upstream", peer="c")),
])
def test_only_errors_travel_upstream_from_the_next_hop(msg, action):
    m = BlockSession(open_(chain=[ap.Hop("c", [], (2, 4))]), HIDDEN)
    m.ready()
    assert m.from_downstream(msg, "c") == action
    assert not m.ended  # the driver cancels the step loop, which may be mid-step


def test_idle_bad_frames_and_failed_sends_end_the_session_with_an_error():
    m = BlockSession(open_(), HIDDEN)
    m.ready()
    assert m.idle(300.0) == ReplyError(SESSION, "idle", "no step for 300 s; session expired")
    m = BlockSession(open_(), HIDDEN)
    m.ready()
    assert m.bad_frame(ap.ActivationProtocolError("shape", "bad")) == ReplyError(SESSION, "shape", "bad")
    m = BlockSession(open_(chain=[ap.Hop("c", [], (2, 4))]), HIDDEN)
    m.ready()
    assert m.send_failed(step(n=7, pos=0, tokens=1), "reset", "c") == ReplyError(
        SESSION, "next_hop", "sending to the next hop failed: reset", n=7, peer="c")


@pytest.mark.parametrize("reply,failure", [
    (ap.Ready(SESSION), None),
    (None, Failure("next_hop", "first… closed the stream", "first")),
    (ap.Error(SESSION, "layers", "no", peer="x"), Failure("layers", "no", "x")),
    (ap.Attach(SESSION), Failure("unexpected", "first hop answered attach")),
])
def test_the_client_open_handshake_expects_ready_or_an_error(reply, failure):
    m = ClientSession(SESSION, first_peer="first", last_peer="last", kind="hidden", hidden_size=HIDDEN,
                      vocab=VOCAB)
    assert m.opened(reply) == failure
    assert m.state == ("ready" if failure is None else "ended")
    assert answer_to_open(reply, who="first hop", closed=Failure("next_hop", "first… closed the stream", "first")) \
        == failure


def test_error_codes_are_shardnet_errors_and_value_errors():
    from shardnet.errors import ShardnetError

    e = ap.ActivationProtocolError("shape", "bad")
    assert isinstance(e, ShardnetError) and isinstance(e, ValueError)
    assert (e.code, e.message, str(e)) == ("shape", "bad", "shape: bad")


def test_two_discarded_chunks_in_a_row_are_both_skipped():
    """A pipelined client had chunks 1 and 2 in flight when it rejected chunk 0's drafts: both
    wait behind step 3 of the new epoch. Chunk 2 starts past the cache (chunk 1 was skipped),
    and is skipped too rather than refused."""
    m = BlockSession(open_(), HIDDEN)
    m.ready()
    s0, s1, s2, s3 = (step(n=0, pos=0, tokens=4), step(n=1, pos=4, tokens=2), step(n=2, pos=6, tokens=2),
                      step(n=3, pos=3, tokens=1, epoch=1))
    assert m.receive(s0, [s1, s2]) == Compute(s0, 0)  # step 3 was sent after its result
    assert m.receive(s1, [s2, s3]) == Skip(s1)
    assert m.receive(s2, [s3]) == Skip(s2)
    assert m.receive(s3) == Compute(s3, 1)
    assert m.cursor.length == 4
    # a fenced step is still refused for what no step may be
    m2 = BlockSession(open_(), HIDDEN)
    m2.ready()
    assert m2.receive(step(n=0, pos=0, tokens=1, hidden=HIDDEN + 1), [s3]).code == "hidden_size"
