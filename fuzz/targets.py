"""Every decoder that reads bytes from the network, as a fuzz target: ``target(data)`` either
decodes or raises the codec's own typed error; anything else escaping is a bug (a handler would
crash on it, or a peer would get no clear answer).

Used by ``fuzz/run.py`` (atheris, coverage-guided) and by ``tests/system/test_fuzz_targets.py``
(hypothesis, in every test run). No torch here: the wire codecs are torch-free by design.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import cbor2

from shardnet.protocols import activation, block_claim, framing, receipt_gossip, receipts
from shardnet.transport import records
from shardnet.transport.errors import RecordError
from shardnet.transport.nat import autonat_messages, holepunch_messages, pbwire, relay_messages


@dataclass(frozen=True)
class Target:
    run: Callable[[bytes], object]
    errors: tuple[type[BaseException], ...]  # the typed errors bad input may raise
    seeds: tuple[bytes, ...] = ()  # valid or near-valid inputs to start from


def _stream(decoder_cls, *, split: int = 7):
    """Feed the data in uneven pieces, as a socket would deliver it."""
    def run(data: bytes):
        dec = decoder_cls()
        out = []
        for i in range(0, len(data), split):
            out.extend(dec.feed(data[i:i + split]))
        return out
    return run


def _pb_stream(data: bytes):
    buf = pbwire.FrameBuffer()
    buf.feed(data)
    out = []
    while (body := buf.next_body()) is not None:
        out.append(body)
    return out


def _record(data: bytes):
    return records.decode("/shardnet/fuzz", data)


def _cbor(obj) -> bytes:
    return cbor2.dumps(obj)


_OPEN = activation.encode(activation.Open(b"s" * 16, model="m" * 64, layers=(0, 4), max_len=64, chain=[],
                                          ret=activation.PeerRef("x")))
_STEP = activation.encode(activation.Step(b"s" * 16, n=1, pos=0, dtype="float32", shape=[1, 1, 2],
                                          payload=bytes(8)))

TARGETS: dict[str, Target] = {
    "activation.frame": Target(activation.decode_frame, (activation.ActivationProtocolError,),
                               (_OPEN[4:], _STEP[4:])),
    "activation.stream": Target(_stream(activation.ActivationDecoder),
                                (activation.ActivationProtocolError, framing.FrameError), (_OPEN + _STEP,)),
    "framing.stream": Target(_stream(framing.FrameDecoder), (framing.FrameError,), (framing.encode_frame(b"abc"),)),
    "block_claim": Target(block_claim.decode, (block_claim.ClaimError,), (_cbor({"v": 1}),)),
    "receipts.stage": Target(receipts.decode_stage, (receipts.ReceiptError,), (_cbor({"v": 1}),)),
    "receipt_gossip.request": Target(receipt_gossip.decode_request, (receipt_gossip.GossipError,),
                                     (receipt_gossip.encode_request(get=["ab" * 32]),)),
    "receipt_gossip.response": Target(receipt_gossip.decode_response, (receipt_gossip.GossipError,),
                                      (receipt_gossip.encode_response(receipts=[b"x"]),)),
    "receipt_gossip.report": Target(receipt_gossip.decode_report, (receipt_gossip.GossipError,), (_cbor({"v": 1}),)),
    "dht.record": Target(_record, (RecordError,), (_cbor({"v": 1}),)),
    "nat.autonat": Target(autonat_messages.decode_autonat, (pbwire.MessageError,)),
    "nat.holepunch": Target(holepunch_messages.decode_holepunch, (pbwire.MessageError,),
                            (holepunch_messages.encode_holepunch(holepunch_messages.HolePunch(
                                holepunch_messages.HolePunchType.CONNECT, [b"\x04\x7f\x00\x00\x01"]))[1:],)),
    "nat.relay_hop": Target(relay_messages.decode_hop, (pbwire.MessageError,)),
    "nat.relay_stop": Target(relay_messages.decode_stop, (pbwire.MessageError,)),
    "nat.stream": Target(_pb_stream, (pbwire.MessageError,)),
}


def check(name: str, data: bytes) -> None:
    """Run one target; raise AssertionError naming the target if an untyped error escapes."""
    t = TARGETS[name]
    try:
        t.run(data)
    except t.errors:
        pass
    except Exception as e:
        raise AssertionError(f"{name}: {type(e).__name__}: {e} escaped for input {data[:64]!r}") from e
