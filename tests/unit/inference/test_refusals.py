"""Which refusals of a compute peer a client waits out (and which it never will)."""

from shardnet.errors import InferenceError


def test_which_refusals_are_waited_out():
    from shardnet.inference.client.session import _busy

    assert _busy(InferenceError("too_many_sessions", "you hold 16 sessions here"))
    assert _busy(InferenceError("rate_limited", "more than 20 new sessions per second"))
    assert _busy(InferenceError("kv_budget", "session needs 4096 bytes of KV cache; 100 of 8192 are free"))
    # a session larger than the whole budget never fits: no use waiting
    assert not _busy(InferenceError("kv_budget", "session needs 9000 bytes of KV cache; 8192 of 8192 are free"))
    assert not _busy(InferenceError("layers", "layers 0:4 requested"))
