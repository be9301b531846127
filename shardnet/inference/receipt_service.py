"""Receipts on a node: sign a stage receipt when a served session ends, keep it, announce its
digest, serve it on request; hear other clients' reports of peers caught computing wrong; and,
for clients, fetch the receipts of a session from its peers."""

from __future__ import annotations

import logging
import os
import platform
import time
from collections import OrderedDict
from collections.abc import Callable

import cbor2
import trio

from shardnet._version import __version__
from shardnet.protocols import receipt_gossip as rg
from shardnet.protocols.receipts import (
    HashChain,
    ReceiptError,
    StageReceipt,
    decode_stage,
    encode_stage,
)
from shardnet.transport.behaviour import Behaviour
from shardnet.transport.errors import ShardnetError
from shardnet.transport.limits import Refusals
from shardnet.transport.node import Node
from shardnet.transport.stream import Stream

log = logging.getLogger(__name__)

REQUEST_TIMEOUT = 10.0
MAX_REPORTS_KEPT = rg.MAX_REPORTS_KEPT


def device_facts(device: str) -> dict[str, str]:
    """What the receipt says computed: the GPU's name and UUID, or the CPU model. (The CUDA
    branch has not run on a GPU in shardnet's tests: docs/security.md.)"""
    if device.startswith("cuda"):
        import torch

        props = torch.cuda.get_device_properties(torch.device(device))
        return {"kind": "cuda", "name": props.name, "uuid": str(getattr(props, "uuid", ""))}
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"kind": "cpu", "name": name, "cores": str(os.cpu_count() or 0)}


class ReceiptService(Behaviour):
    """A node behaviour, one per node (``ReceiptService.of(node)``): the store, its stream
    handler, the digests, and the verified reports heard on gossip (``reports``; ``listeners``
    are called with each)."""

    def __init__(self, node: Node, capacity: int = 1024) -> None:
        self.node = node
        self.store = rg.ReceiptStore(capacity)
        self.report_log = rg.ReportLog(MAX_REPORTS_KEPT)  # which reports are kept: the protocol's rules
        self.listeners: list[Callable[[dict], None]] = []
        node.set_stream_handler(rg.PROTOCOL_ID, self._answer)

    @property
    def reports(self) -> OrderedDict[str, dict]:
        """Report ID -> verified body, oldest first."""
        return self.report_log.reports

    @property
    def _report_blobs(self) -> OrderedDict[str, bytes]:
        return self.report_log.blobs

    @classmethod
    def of(cls, node: Node) -> ReceiptService:
        """The node's receipt service, started (in the background) on first use."""
        return node.ensure_behaviour(cls)

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await self._hear_reports()
        await trio.sleep_forever()  # the store and its handler stay, heard reports or not

    async def sign_and_keep(self, r: StageReceipt) -> str:
        blob = encode_stage(self.node.key_pair, r)
        rid = self.store.add(blob)
        try:
            with trio.move_on_after(5):
                await self.node.pubsub.publish(rg.TOPIC, cbor2.dumps(rg.digest_of(blob, r)))
        except Exception as e:  # gossip is best effort; the receipt is kept and served anyway
            log.debug("receipt digest not published: %s", e)
        return rid

    async def _hear_reports(self) -> None:
        try:
            async with self.node.pubsub.subscribe(rg.REPORT_TOPIC, validate=_is_report) as sub:
                async for msg in sub:
                    self._note_report(msg.data, str(msg.sender))
        except Exception:  # runs in the node's nursery: hearing reports must not take the node down
            log.exception("no longer hearing reports")

    def _note_report(self, data: bytes, sender: str) -> None:
        # decoded a second time: the gossip validator (_is_report) only answers yes or no, and
        # reports are rare (one per conviction)
        try:
            kept = self.report_log.add(data)
        except rg.GossipError as e:
            _ignored.note("report", sender, f"ignoring a report from {sender[:16]}: {e}")
            return
        if kept is None:  # heard before
            return
        _, report = kept
        log.warning("%s… reports peer %s… computed layers %s wrong", report["reporter"][:16],
                    report["accused"][:16], report["layers"])
        for listener in list(self.listeners):
            listener(report)

    async def _answer(self, stream: Stream) -> None:
        try:
            with trio.fail_after(REQUEST_TIMEOUT):
                n = int.from_bytes(await stream.read_exactly(4), "big")
                if n > rg.MAX_REQUEST_BYTES:
                    raise rg.GossipError(f"request of {n} bytes exceeds {rg.MAX_REQUEST_BYTES}")
                data = await stream.read_exactly(n)
            kind, arg = rg.decode_request(data)
            if kind == "get":
                out = rg.encode_response(receipts=[b for b in (self.store.get(i) for i in arg) if b])
            elif kind == "reports":
                out = rg.encode_response(reports=self.report_log.newest(arg))
            elif kind == "session":
                out = rg.encode_response(receipts=self.store.for_session(arg)[:rg.MAX_IDS_PER_REQUEST])
            else:
                out = rg.encode_response(digests=self.store.digests(arg))
        except (rg.GossipError, trio.TooSlowError, ShardnetError) as e:
            out = rg.encode_response(error=str(e) or type(e).__name__)
        with trio.move_on_after(REQUEST_TIMEOUT):
            try:
                await stream.write(out)
                await stream.close()
            except ShardnetError:
                pass


async def request(node: Node, peer: str, payload: bytes, *, timeout: float = REQUEST_TIMEOUT) -> dict:
    async with await node.new_stream(peer, rg.PROTOCOL_ID, timeout=timeout) as s:
        await s.write(len(payload).to_bytes(4, "big") + payload)
        data = b""
        with trio.fail_after(timeout):
            while chunk := await s.read_some(65536, timeout=timeout):
                data += chunk
                if len(data) > rg.MAX_RESPONSE_BYTES:
                    raise ShardnetError("receipt response too large")
    return rg.decode_response(data)


async def fetch_session_receipts(node: Node, peer: str, session: str, *, wait: float = 10.0) -> bytes | None:
    """``peer``'s receipt for ``session``, waiting (polling) up to ``wait`` s for the session to end there."""
    deadline = trio.current_time() + wait
    while True:
        try:
            got = await request(node, peer, rg.encode_request(session=session),
                                timeout=max(1.0, deadline - trio.current_time()))
            for blob in got.get("receipts", []):
                try:
                    r = decode_stage(blob)
                except ReceiptError:
                    continue
                if r.peer == peer and r.session == session:
                    return blob
        except (ShardnetError, trio.TooSlowError, rg.GossipError) as e:
            log.debug("receipt request to %s: %s", peer[:16], e)
        if trio.current_time() + 0.2 >= deadline:
            return None
        await trio.sleep(0.2)


class StageRecorder:
    """Hash chains and facts of one served session, turned into a receipt when it ends."""

    def __init__(self, model: str, session: bytes, layers: tuple[int, int], peer: str, device: str, *,
                 dtype: str | None = None, quant: str | None = None, batching: bool = False,
                 region: str | None = None) -> None:
        self.model, self.session, self.layers, self.peer, self.device = model, session, layers, peer, device
        self.dtype, self.quant, self.region = dtype, quant, region
        #: steps computed in one forward pass with other sessions' (None: this peer does not batch)
        self.batched_steps: int | None = 0 if batching else None
        self.received = HashChain()
        self.sent = HashChain()
        self.t_start = time.time()
        self.observed: dict[str, str] = {}
        self.tokens: list[int] | None = None

    def receipt(self) -> StageReceipt:
        device = device_facts(self.device)
        return StageReceipt(model=self.model, session=self.session.hex(), layers=list(self.layers),
                            in_chain=self.received.hex(), out_chain=self.sent.hex(), steps_in=self.received.count,
                            steps_out=self.sent.count, t_start=self.t_start, t_end=time.time(), peer=self.peer,
                            observed=self.observed, device=device, version=__version__,
                            tokens=self.tokens, dtype=self.dtype, quant=self.quant,
                            batched_steps=self.batched_steps, region=self.region,
                            gpu_uuid=device.get("uuid") or None)

    def step_was_batched(self) -> None:
        self.batched_steps = (self.batched_steps or 0) + 1


_ignored = Refusals(log, logging.INFO)


def _is_report(data: bytes) -> bool:
    try:
        rg.decode_report(data)
        return True
    except rg.GossipError:
        return False
