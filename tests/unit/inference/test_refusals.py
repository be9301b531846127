"""Which refusals of a compute peer a client waits out (and which it never will)."""

from shardnet.errors import InferenceError
from shardnet.protocols.activation import ErrorCode


def test_which_refusals_are_waited_out():
    from shardnet.inference.client.session import _busy

    assert _busy(InferenceError(ErrorCode.TOO_MANY_SESSIONS, "you hold 16 sessions here"))
    assert _busy(InferenceError(ErrorCode.RATE_LIMITED, "more than 20 new sessions per second", retry_after_s=0.05))
    assert _busy(InferenceError(ErrorCode.KV_BUDGET, "session needs 4096 bytes of KV cache; 100 of 8192 are free",
                                need_bytes=4096, limit_bytes=8192))
    # a session larger than the whole budget never fits: no use waiting
    assert not _busy(InferenceError(ErrorCode.KV_BUDGET, "session needs 9000 bytes of KV cache",
                                    need_bytes=9000, limit_bytes=8192))
    assert not _busy(InferenceError(ErrorCode.LAYERS, "layers 0:4 requested"))
    # the codes as plain strings (a peer's error as decoded) are the same codes
    assert _busy(InferenceError("too_many_sessions", "you hold 16 sessions here"))


def test_a_refusal_without_its_figures_is_waited_out():
    """An older peer's kv_budget refusal gives no figures: the client cannot tell whether the
    session would ever fit, and waits (up to its queue timeout) rather than give up at once."""
    from shardnet.inference.client.session import _busy

    assert _busy(InferenceError("kv_budget", "session needs 9000 bytes of KV cache; 8192 of 8192 are free"))
    assert _busy(InferenceError("kv_budget", "full", need_bytes=9000))  # half the figures: as none
