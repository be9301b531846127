"""Tree steps on the activation protocol (issue 38): a step whose tokens are a tree of drafts
(``tree``), the next step keeping the accepted path (``keep``), and ``ready``'s ``tree`` saying
that every hop from there on takes them. The wire form, the refusals, and the block server's
and the client's rules."""

import dataclasses

import pytest

from shardnet.protocols import activation as ap
from shardnet.protocols.activation_session import BlockSession, ClientSession, Compute
from shardnet.testing.factories import activation_frame
from shardnet.testing.factories import activation_step as step

HIDDEN, VOCAB, MAX_LEN = 8, 50, 40
SESSION = b"s" * ap.SESSION_ID_BYTES


def tree_step(*, n: int, pos: int, tree=None, keep=None, tokens: int | None = None, epoch: int = 0) -> ap.Step:
    tokens = len(tree) if tokens is None else tokens
    return dataclasses.replace(step(n=n, pos=pos, tokens=tokens, hidden=HIDDEN, epoch=epoch), tree=tree, keep=keep)


def decoded(msg):
    return ap.decode_frame(ap.encode(msg)[4:])


def test_tree_and_keep_travel_and_a_plain_step_encodes_as_before():
    s = tree_step(n=3, pos=10, tree=[-1, 0, 0, 1], keep=[7, 8, 9])
    got = decoded(s)
    assert (got.tree, got.keep, got.after_keep) == ((-1, 0, 0, 1), (7, 8, 9), 10)
    plain = step(n=3, pos=10, tokens=4)
    assert "tree" not in plain.fields and "keep" not in plain.fields
    assert decoded(plain).tree is None and decoded(plain).keep is None


def test_ready_says_tree_only_when_it_takes_them():
    assert decoded(ap.Ready(SESSION, tree=True)).tree is True
    assert ap.encode(ap.Ready(SESSION)) == ap.encode(ap.Ready(SESSION, tree=False))  # an older peer's ready
    assert decoded(ap.Ready(SESSION)).tree is False


@pytest.mark.parametrize("fields,why", [
    ({"tree": [-1, 0]}, "parent indices, one per token"),  # 3 tokens
    ({"tree": [-1, 0, 2]}, "token 2's parent 2"),
    ({"tree": [-1, -2, 0]}, "token 1's parent -2"),
    ({"tree": "abc"}, "parent indices"),
    ({"keep": []}, "increasing"),
    ({"keep": [3, 3]}, "increasing"),
    ({"keep": [-1, 2]}, "increasing"),
    ({"keep": [1, True]}, "increasing"),
])
def test_malformed_trees_and_keeps_are_refused_in_one_line(fields, why):
    header = {"v": 1, "t": "step", "s": SESSION, "n": 0, "pos": 0, "dtype": "float32", "shape": [1, 3, 2],
              **fields}
    with pytest.raises(ap.ActivationProtocolError) as e:
        ap.decode_frame(activation_frame(header, bytes(24), prefixed=False))
    assert e.value.code == "malformed" and why in str(e.value) and "\n" not in str(e.value)


def test_after_a_tree_only_a_kept_path_or_its_root_is_text():
    c = ap.StepCursor(MAX_LEN, HIDDEN)
    c.advance(step(n=0, pos=0, tokens=10))
    c.advance(tree_step(n=1, pos=9, tree=[-1, 0, 0, 1, 2]))  # the root at 9, drafts at 10..13
    assert c.length == 14
    code, msg = c.check(step(n=2, pos=12, tokens=1))
    assert code == "position" and "past the 10" in msg  # the tree's slots are not text
    assert c.check(step(n=2, pos=10, tokens=1)) is None  # right after the root: no draft kept
    # the path root -> 2 -> 4 (slots 9, 11, 13) kept at 9, 10, 11; the next token at 12
    nxt = tree_step(n=2, pos=12, tree=None, keep=[9, 11, 13], tokens=1)
    assert c.check(nxt) is None
    assert c.advance(nxt) == 0 and c.length == 13 and c.tree_at is None
    assert c.check(tree_step(n=3, pos=12, keep=[9, 14], tokens=1))[0] == "position"  # 14 is not cached


def test_a_step_that_keeps_a_path_is_never_fenced_off():
    m = BlockSession(ap.Open(SESSION, model="ab" * 32, layers=(0, 2), max_len=MAX_LEN, chain=(),
                             ret=ap.PeerRef("me")), HIDDEN)
    m.ready(tree=True)
    m.receive(step(n=0, pos=0, tokens=5))
    m.receive(tree_step(n=1, pos=4, tree=[-1, 0, 0]))
    keeping = tree_step(n=2, pos=6, keep=[4, 5], tokens=1)
    newer = step(n=3, pos=7, tokens=1, epoch=1)
    assert m.receive(keeping, [newer]) == Compute(keeping, 0)
    assert m.cursor.length == 7


def test_the_client_sends_trees_only_to_a_chain_that_takes_them():
    def client(tree: bool) -> ClientSession:
        c = ClientSession(SESSION, first_peer="a", last_peer="b", kind="logits", hidden_size=HIDDEN, vocab=VOCAB)
        c.opened(ap.Ready(SESSION, tree=tree))
        return c

    with pytest.raises(ValueError, match="does not take tree steps"):
        client(False).step(dtype="float32", shape=[1, 2, HIDDEN], payload=bytes(64), tree=[-1, 0])
    c = client(True)
    s = c.step(dtype="float32", shape=[1, 3, HIDDEN], payload=bytes(96), tree=[-1, 0, 0], logits_for=3)
    c.sent(s)
    assert s.tree == (-1, 0, 0) and c.length == 3
    with pytest.raises(ValueError, match="past the 3 sent"):
        c.step(dtype="float32", shape=[1, 1, HIDDEN], payload=bytes(32), keep=[0, 3])
    kept = c.step(dtype="float32", shape=[1, 1, HIDDEN], payload=bytes(32), keep=[0, 2])
    assert (kept.pos, kept.keep) == (2, (0, 2))


def test_a_tree_larger_than_the_bound_is_refused():
    n = ap.MAX_TREE_TOKENS + 1
    header = {"v": 1, "t": "step", "s": SESSION, "n": 0, "pos": 0, "dtype": "float32", "shape": [1, n, 1],
              "tree": [-1] * n}
    with pytest.raises(ap.ActivationProtocolError) as e:
        ap.decode_frame(activation_frame(header, bytes(4 * n), prefixed=False))
    assert e.value.code == "too_large" and f"at most {ap.MAX_TREE_TOKENS}" in str(e.value)
