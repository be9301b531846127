"""One error root: every exception class shardnet defines derives from ShardnetError and has a
``code`` a caller can branch on (never the message)."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import shardnet
from shardnet import errors
from shardnet.errors import InferenceError, ShardnetError

#: Exception classes that never leave the package, with where they are caught. They stay
#: outside the root on purpose: each is a signal between two pieces of code (or to py-libp2p,
#: whose own handlers expect them), not an error a caller of shardnet could see.
INTERNAL = {
    "ApiError": "gateway: Gateway.__call__ answers each one as an HTTP error in OpenAI's shape",
    "WriterClosed": "transport/conn_writer: compat's yamux patch turns it into py-libp2p's connection errors",
    "NotMultistream": "transport/compat: raised and handled inside the patched inbound-connection path",
    "RequestRateExceeded": "transport/compat: raised inside the patched DHT handler, which resets the stream",
    "TransformedCache": "model/kv_cache: raised inside Block.forward_batch, which rewinds and reruns that layer row by row",
}

#: Modules whose import has effects beyond defining things.
SKIP = {"shardnet.__main__"}


def _modules():
    for info in pkgutil.walk_packages(shardnet.__path__, "shardnet."):
        if info.name not in SKIP:
            yield importlib.import_module(info.name)


def _exception_classes():
    seen = {}
    for module in _modules():
        for obj in vars(module).values():
            if (isinstance(obj, type) and issubclass(obj, BaseException)
                    and obj.__module__.startswith("shardnet.")):
                seen[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return seen


def test_every_exception_class_derives_from_shardnet_error():
    classes = _exception_classes()
    assert len(classes) > 20  # the walk found the package's modules
    outside = sorted(name for name, cls in classes.items()
                     if not issubclass(cls, ShardnetError) and cls.__name__ not in INTERNAL)
    assert not outside, f"not derived from ShardnetError (or listed in INTERNAL with a reason): {outside}"
    stale = set(INTERNAL) - {cls.__name__ for cls in classes.values()}
    assert not stale, f"INTERNAL names classes that no longer exist: {stale}"


def test_every_error_has_a_code():
    for name, cls in _exception_classes().items():
        if issubclass(cls, ShardnetError):
            assert isinstance(cls.code, str) and cls.code, name


def test_the_roots_own_classes_have_distinct_codes():
    own = [cls for cls in vars(errors).values()
           if isinstance(cls, type) and issubclass(cls, ShardnetError) and cls.__module__ == errors.__name__]
    codes = [cls.code for cls in own if cls is not InferenceError]
    assert len(codes) == len(set(codes)), codes
    assert ShardnetError.code == "error"
    assert errors.NoRouteError("x").code == "no_route" and errors.DialError("x").code == "dial"


def test_inference_errors_carry_their_code_per_instance():
    e = InferenceError("busy", "too many sessions", "peer1")
    assert (e.code, e.peer, str(e)) == ("busy", "peer1", "busy: too many sessions")
    assert InferenceError.code == "error"  # the class default, for code that reads it off the class


@pytest.mark.parametrize("module, name, second_base, code", [
    ("shardnet.protocols.framing", "FrameError", ValueError, "frame"),
    ("shardnet.protocols.block_claim", "ClaimError", ValueError, "claim"),
    ("shardnet.protocols.receipts", "ReceiptError", ValueError, "receipt"),
    ("shardnet.protocols.receipt_gossip", "GossipError", ValueError, "gossip"),
    ("shardnet.transport.nat.pbwire", "MessageError", ValueError, "message"),
    ("shardnet.testing.natlab", "LabError", RuntimeError, "lab"),
    ("shardnet.inference.model.static_decoder", "UnsupportedModel", ValueError, "unsupported_model"),
])
def test_errors_keep_their_second_base(module, name, second_base, code):
    """``except ValueError`` (or RuntimeError) written before the root existed still catches them."""
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, ShardnetError) and issubclass(cls, second_base)
    assert cls("x").code == code
    with pytest.raises(second_base):
        raise cls("x")
