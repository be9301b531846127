"""Fetching a model's manifest, files and tensors from the peers that hold them.

Every peer that can serve some of the model is a *source*; each gets one stream with up to
``MAX_IN_FLIGHT`` requests outstanding and takes the next chunk it holds from one shared queue,
so fast sources serve more and a slow one never holds the others up. Each chunk is checked
against the manifest on arrival (a blob's chunk hashes first, checked against its root) and only
then written (store.py). A source that sends a bad chunk is dropped at once and reported; one
that fails or goes away is dropped and its chunks go back in the queue; when every source is
gone with chunks left, the sources are looked up again, a few times, before the fetch fails.
Chunks already written and verified by an earlier, interrupted fetch are checked again on disk
and kept.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from collections import deque
from dataclasses import dataclass, field

import trio

from shardnet.errors import ShardnetError
from shardnet.inference.model.checkpoint import FETCHED_GGUF_HEADER
from shardnet.inference.weights.cards import weights_key
from shardnet.inference.weights.store import GroupWriter, WeightStore, group_of
from shardnet.protocols import weights as wp
from shardnet.transport.errors import OverlayTimeout
from shardnet.transport.node import Node

log = logging.getLogger(__name__)

STREAM_TIMEOUT = 30.0
HAVE_TIMEOUT = 10.0
#: times the sources are looked up again while chunks are left and every source is gone
ROUNDS = 4
MAX_MANIFEST_BYTES = 256 << 20


@dataclass
class FetchTotals:
    verified_bytes: int = 0  # weight bytes received and verified, over every fetch


#: what every fetch of this process received (for metrics)
FETCHED = FetchTotals()


class FetchError(ShardnetError):
    """The swarm could not provide (verified) what a fetch needs."""

    code = "fetch"


@dataclass
class Source:
    peer: str
    prefixes: tuple[str, ...]
    lacks: set[str] = field(default_factory=set)

    def holds(self, blob: str) -> bool:
        return blob not in self.lacks and any(blob.startswith(p) for p in self.prefixes)


@dataclass
class FetchProgress:
    """What a fetch has done so far (passed to the progress callback)."""

    total: int = 0  # bytes this fetch needs, including those found already here
    done: int = 0  # bytes received and verified in this fetch
    reused: int = 0  # bytes found verified from an earlier, interrupted fetch
    sources: int = 0  # sources serving right now
    bad: list[str] = field(default_factory=list)  # peers caught sending bad bytes
    failed: list[str] = field(default_factory=list)  # peers dropped for failing or going away
    per_source: dict[str, int] = field(default_factory=dict)  # peer -> bytes it sent
    started: float = field(default_factory=time.monotonic)

    @property
    def rate(self) -> float:
        return self.done / max(time.monotonic() - self.started, 1e-6)

    @property
    def eta(self) -> float | None:
        left = self.total - self.done - self.reused
        return left / self.rate if self.rate > 0 else None


ProgressFn = Callable[[FetchProgress], None]


async def find_sources(node: Node, model_id: str, *, timeout: float = 15.0,
                       exclude: set[str] = frozenset()) -> list[Source]:
    """The peers that serve the model's bytes, each with what it holds."""
    sources: list[Source] = []
    me = str(node.peer_id)
    with trio.move_on_after(timeout):
        providers = await node.dht.find_providers(weights_key(model_id), count=64)

        async def ask(info) -> None:
            pid = str(info.peer_id)
            if pid == me or pid in exclude:
                return
            if info.addrs:
                node.host.get_peerstore().add_addrs(info.peer_id, info.addrs, 600)
            try:
                reply = await _one_request(node, pid, wp.Request("have", model_id), timeout=HAVE_TIMEOUT)
            except (ShardnetError, trio.TooSlowError) as e:
                log.debug("weights source %s: %s", pid[:16], e)
                return
            if reply.ok and reply.prefixes:
                sources.append(Source(pid, reply.prefixes))

        async with trio.open_nursery() as nursery:
            for info in providers:
                nursery.start_soon(ask, info)
    return sources


async def _one_request(node: Node, peer: str, request: wp.Request, *, timeout: float) -> wp.Reply:
    with trio.fail_after(timeout):
        async with await node.new_stream(peer, wp.PROTOCOL_ID, timeout=timeout) as stream:
            conn = wp.WeightsClient()
            await stream.write(conn.send(request), timeout=timeout)
            while True:
                data = await stream.read_some(1 << 20, timeout=timeout)
                if not data:
                    conn.end_of_stream()
                    raise wp.WeightsError("the peer closed the stream without a reply")
                for _, reply in conn.receive_data(data):
                    return reply


async def fetch_manifest(node: Node, model_id: str, sources: list[Source]) -> bytes:
    """The manifest's bytes, from the first source that sends ones hashing to ``model_id``."""
    errors = []
    for src in sources:
        try:
            raw = bytearray()
            total = None
            while total is None or len(raw) < total:
                reply = await _one_request(node, src.peer, wp.Request("manifest", model_id, index=len(raw),
                                                                      length=wp.MAX_MANIFEST_RANGE),
                                           timeout=STREAM_TIMEOUT)
                if not reply.ok:
                    raise wp.WeightsError(f"{reply.code}: {reply.error}")
                if total is None:
                    total = reply.total
                    if not 0 < total <= MAX_MANIFEST_BYTES:
                        raise wp.WeightsError(f"a manifest of {total} bytes is not plausible")
                if reply.total != total or len(reply.data) != min(wp.MAX_MANIFEST_RANGE, total - len(raw)):
                    raise wp.WeightsError("its manifest ranges do not add up")
                raw += reply.data
            if hashlib.sha256(raw).hexdigest() != model_id:
                raise wp.BadChunk("its manifest does not hash to the model ID")
            return bytes(raw)
        except (ShardnetError, trio.TooSlowError) as e:
            log.warning("manifest from %s: %s", src.peer[:16], e)
            errors.append(f"{src.peer[:16]}: {e}")
    raise FetchError(f"no peer sent the manifest of model {model_id[:16]}…"
                     + (f" ({'; '.join(errors[:3])})" if errors else " (no peer serves its weights)"))


# -- the transfer -----------------------------------------------------------------------------
@dataclass
class _Blob:
    name: str
    checker: wp.ChunkChecker
    sink: GroupWriter | _FileSink
    tensor: str = ""  # the tensor's name in its group file ("" for a file)


class _FileSink:
    """A model file, kept in memory until complete (they are small), then written verified."""

    def __init__(self, name: str, size: int) -> None:
        self.name = name
        self.data = bytearray(size)
        self.bitmap = bytearray(wp.chunk_count(size))

    def has(self, _name: str, index: int) -> bool:
        return bool(self.bitmap[index])

    def write(self, _name: str, index: int, data: bytes) -> None:
        a, b = wp.chunk_span(len(self.data), index)
        self.data[a:b] = data
        self.bitmap[index] = 1

    def complete(self) -> bool:
        return all(self.bitmap)


class _Queue:
    """The jobs left: per blob, its chunk indices in order (-1 first: its chunk hashes). A take
    looks at each blob once, not at each chunk (a span of a large model is tens of thousands)."""

    def __init__(self) -> None:
        self._jobs: dict[str, deque[int]] = {}
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def blobs(self) -> list[str]:
        return [b for b, q in self._jobs.items() if q]

    def push(self, blob: str, index: int) -> None:
        self._jobs.setdefault(blob, deque()).append(index)
        self._count += 1

    def push_front(self, blob: str, index: int) -> None:
        q = self._jobs.pop(blob, deque())
        q.appendleft(index)
        self._jobs = {blob: q, **self._jobs}  # given back: first in line again
        self._count += 1

    def take(self, can: Callable[[str, int], bool]) -> tuple[str, int] | None:
        for blob, q in list(self._jobs.items()):
            if not q:
                del self._jobs[blob]
            elif can(blob, q[0]):
                self._count -= 1
                return blob, q.popleft()
        return None


class Transfer:
    """One fetch of a set of blobs into a store, from several sources at once."""

    def __init__(self, node: Node, store: WeightStore, manifest: dict, *, progress: ProgressFn | None = None,
                 timeout: float | None = None) -> None:
        self.node, self.store, self.manifest = node, store, manifest
        self.model_id = store.model_id
        #: seconds a source may take to answer a request (whole: a reply trickling in counts from its request)
        self.timeout = STREAM_TIMEOUT if timeout is None else timeout
        self.progress_fn = progress
        self.progress = FetchProgress()
        self.blobs: dict[str, _Blob] = {}
        self.groups: dict[str, GroupWriter] = {}
        self.pending = _Queue()  # (blob, chunk index), or (blob, -1) for its hashes
        self._marked: list[tuple[str, int]] = []  # chunks an earlier fetch wrote, to check before trusting
        self._finishing: list[GroupWriter] = []  # complete groups, to move into place
        self._finish_lock = trio.Lock()
        self.in_flight = 0
        self._changed = trio.Event()
        self._last_report = 0.0

    # -- what to fetch ---------------------------------------------------------------------------
    def add_files(self, names: list[str]) -> None:
        """Model files by name (``FETCHED_GGUF_HEADER``: the header of a GGUF checkpoint's file)."""
        for name in names:
            if name == FETCHED_GGUF_HEADER:
                gguf_name, size, root = self.manifest["gguf"]
                blob = f"gguf:{gguf_name}"
            else:
                size, root = self.manifest["files"][name]
                blob = f"file:{name}"
            self._add(_Blob(blob, wp.ChunkChecker(blob, size, root), _FileSink(name, size)), size)

    def add_tensors(self, names: list[str]) -> None:
        # a group is written whole: a group some of whose tensors are missing gets all of them
        wanted = {group_of(n) for n in names}
        by_group: dict[str, dict[str, list]] = {}
        for n, entry in self.manifest["tensors"].items():
            if (group := group_of(n)) in wanted:
                by_group.setdefault(group, {})[n] = entry
        for group, tensors in by_group.items():
            writer = self.groups[group] = self.store.group_writer(group, tensors)
            for n in sorted(tensors):
                _dtype, _shape, size, root = tensors[n]
                blob = f"tensor:{n}"
                checker = wp.ChunkChecker(blob, size, root)
                known = self.store.hashes(blob)
                if known is not None:
                    try:
                        checker.set_hashes(known)
                    except wp.BadChunk:
                        pass
                self._add(_Blob(blob, checker, writer, n), size)

    def _add(self, blob: _Blob, size: int) -> None:
        self.blobs[blob.name] = blob
        self.progress.total += size
        c = blob.checker
        if c.needs_hashes:
            self.pending.push(blob.name, -1)
        for i in range(c.count):
            if blob.sink.has(blob.tensor, i):
                self._marked.append((blob.name, i))
            else:
                self.pending.push(blob.name, i)

    def _check_marked(self) -> None:
        """The chunks an interrupted fetch wrote are read back and checked (a crash can tear a
        write): kept if intact, else fetched again. In a worker thread: it reads them all."""
        for name, i in self._marked:
            blob = self.blobs[name]
            if self._intact(blob, i):
                a, b = wp.chunk_span(blob.checker.size, i)
                self.progress.reused += b - a
            else:
                blob.sink.forget(blob.tensor, i)
                self.pending.push(name, i)
        self._marked = []

    def _intact(self, blob: _Blob, index: int) -> bool:
        """A chunk an earlier fetch wrote: still what the manifest says (a crash can tear a write)?"""
        if blob.checker.needs_hashes:
            return False
        try:
            blob.checker.check(index, blob.sink.read(blob.tensor, index))
            return True
        except wp.BadChunk:
            return False

    # -- running -------------------------------------------------------------------------------
    async def run(self, sources: list[Source]) -> FetchProgress:
        """Fetch everything added; look the sources up again while chunks are left."""
        await trio.to_thread.run_sync(self._check_marked)
        self._finishing += [w for w in self.groups.values() if w.complete()]
        await self._finish_groups()
        bad_or_gone: set[str] = set()
        for attempt in range(ROUNDS + 1):
            if not self.pending:
                break
            live = [s for s in sources if s.peer not in bad_or_gone]
            if not live:
                await trio.sleep(min(2.0 * attempt, 8.0))
                live = await find_sources(self.node, self.model_id, exclude=set(self.progress.bad))
            if not live:
                continue
            log.info("fetching %d chunks of model %s… from %d peers", len(self.pending), self.model_id[:16],
                     len(live))
            async with trio.open_nursery() as nursery:
                for src in live:
                    nursery.start_soon(self._worker, src)
            await self._finish_groups()
            bad_or_gone |= {s.peer for s in live}
            sources = []
        self._report(force=True)
        if self.pending:
            missing = sorted(self.pending.blobs())
            raise FetchError(f"{len(self.pending)} chunks of {len(missing)} blobs (first: {missing[0]}) could "
                             "not be fetched: no peer that holds them sent them"
                             + (f"; bad bytes from {', '.join(p[:16] for p in self.progress.bad)}"
                                if self.progress.bad else ""))
        return self.progress

    async def _finish_groups(self) -> None:
        """Move complete groups into place (fsync and rename: in a thread, one at a time, as each
        updates the index)."""
        async with self._finish_lock:
            while self._finishing:
                writer = self._finishing.pop()
                self.groups.pop(writer.group, None)
                await trio.to_thread.run_sync(self.store.finish_group, writer)

    def close(self) -> None:
        for writer in self.groups.values():
            writer.close()

    def _take(self, src: Source) -> tuple[str, int] | None:
        job = self.pending.take(lambda name, index: src.holds(name) and (
            index < 0 or not self.blobs[name].checker.needs_hashes))
        if job is not None:
            self.in_flight += 1
        return job

    def _give_back(self, jobs: list[tuple[str, int]]) -> None:
        """Jobs taken but not done: to the front of the queue, for any source."""
        for blob, index in reversed(jobs):
            self.pending.push_front(blob, index)
            self.in_flight -= 1
        if jobs:
            self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def _worker(self, src: Source) -> None:
        sent: list[tuple[str, int]] = []
        conn = wp.WeightsClient()
        stream = None
        reply_due: float | None = None
        self.progress.sources += 1
        try:
            stream = await self.node.new_stream(src.peer, wp.PROTOCOL_ID, timeout=self.timeout)
            while True:
                while conn.in_flight < wp.MAX_IN_FLIGHT and (job := self._take(src)) is not None:
                    sent.append(job)
                    name, index = job
                    op = "hashes" if index < 0 else "chunk"
                    await stream.write(conn.send(wp.Request(op, self.model_id, name, max(index, 0))),
                                       timeout=self.timeout)
                if not sent:
                    if not self.pending and not self.in_flight:
                        return
                    if not any(src.holds(name) for name in self.pending.blobs()) and not self.in_flight:
                        return  # what is left is not ours to serve
                    with trio.move_on_after(1.0):
                        await self._changed.wait()
                    continue
                # the oldest request must be answered in time: a reply trickling in resets no clock
                if reply_due is None:
                    reply_due = trio.current_time() + self.timeout
                left = reply_due - trio.current_time()
                if left <= 0:
                    raise OverlayTimeout(f"no complete reply within {self.timeout:g} s")
                data = await stream.read_some(1 << 20, timeout=left)
                if not data:
                    conn.end_of_stream()
                for _request, reply in conn.receive_data(data):
                    reply_due = None
                    job = sent[0]
                    if self._settle(src, job, reply):
                        sent.pop(0)
                        self.in_flight -= 1
                        if not self.pending and not self.in_flight:
                            self._wake()  # the others, idle, may stop now
                    else:
                        self._give_back([sent.pop(0)])
                        if reply.code != "not_held":  # busy, gone, or failing: this source is done
                            raise FetchError(f"{reply.code}: {reply.error}")
                if self._finishing:
                    await self._finish_groups()
        except wp.BadChunk as e:
            log.warning("dropping weights source %s: it sent bad bytes (%s)", src.peer[:16], e)
            self.progress.bad.append(src.peer)
        except (ShardnetError, trio.TooSlowError) as e:
            log.info("weights source %s dropped: %s", src.peer[:16], e)
            self.progress.failed.append(src.peer)
        finally:
            self.progress.sources -= 1
            self._give_back(sent)
            if stream is not None:
                with trio.CancelScope(shield=True):
                    await (stream.close() if not sent else stream.reset())

    def _settle(self, src: Source, job: tuple[str, int], reply: wp.Reply) -> bool:
        """Check and keep what a reply brought; False when it brought nothing (raise BadChunk
        when it brought bad bytes)."""
        if not reply.ok:
            if reply.code == "not_held":
                src.lacks.add(job[0])
            log.debug("%s could not send %s: %s", src.peer[:16], job, reply.error)
            return False
        name, index = job
        blob = self.blobs[name]
        if index < 0:
            blob.checker.set_hashes(reply.data)
            self.store.put_hashes(name, reply.data)
            self._wake()
            return True
        blob.checker.check(index, reply.data)
        if blob.checker.count == 1 and isinstance(blob.sink, GroupWriter):
            self.store.put_hashes(name, blob.checker.hashes)  # to serve it on (the root is its hash's hash)
        blob.sink.write(blob.tensor, index, reply.data)
        self.progress.done += len(reply.data)
        FETCHED.verified_bytes += len(reply.data)
        self.progress.per_source[src.peer] = self.progress.per_source.get(src.peer, 0) + len(reply.data)
        if isinstance(blob.sink, _FileSink):
            if blob.sink.complete():
                self.store.put_file(blob.sink.name, bytes(blob.sink.data), blob.checker.hashes, blob=blob.name)
        elif blob.sink.complete() and blob.sink.group in self.groups and blob.sink not in self._finishing:
            self._finishing.append(blob.sink)
        self._report()
        return True

    def _report(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.progress_fn is not None and (force or now - self._last_report >= 0.2):
            self._last_report = now
            self.progress_fn(self.progress)
