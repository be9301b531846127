"""The one task that writes to a connection, so no caller's cancellation can cut a frame.

A Noise transport message consumes a nonce when it is encrypted; if the bytes then do not all
reach the socket, the peer's next decryption fails and the connection, with every stream on it,
is lost. py-libp2p encrypted and wrote in whichever task called ``write``, so a step timeout, a
heal or a client hanging up in the middle of a write broke the connection for everyone sharing
it. Here, as in go-yamux and rust-yamux, callers only queue frames; one writer task per
connection takes them in order, encrypts and writes them. A caller's cancellation abandons what
it has not queued yet; whatever is queued is written whole, or the connection fails as a whole
(the writer closes it), never half a frame.

Queued bytes are bounded (``max_queued``) for data. Control frames (window updates, resets,
pings) get ``control_slack`` bytes beyond that bound, so a queue full of data never keeps a stream
from being reset, while a peer that floods us with pings and never reads still meets a bound (its
pongs then wait, which stops our reading from it, as a blocked socket write did before). Frames
pushed as urgent (window updates and pings, which no earlier frame must precede) are written
before queued data, so a long data queue on a slow uplink does not starve flow control or delay
keepalive answers past their deadline.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable

import trio

log = logging.getLogger(__name__)

#: Most bytes the writer hands to the secure session in one write (several queued frames are
#: joined: one Noise write, one socket write).
COALESCE_BYTES = 1 << 20


class WriterClosed(Exception):
    """The connection's writer has stopped: nothing more can be written to it."""


class QueuedFrame:
    """Bytes the writer has accepted: they will be written whole, or the connection fails."""

    __slots__ = ("data", "_done", "error")

    def __init__(self, data: bytes | bytearray) -> None:
        self.data = data
        self._done: trio.Event | None = None
        self.error: BaseException | None = None

    def _finish(self, error: BaseException | None = None) -> None:
        self.error = error
        self.data = b""
        if self._done is not None:
            self._done.set()
        else:
            self._done = _SET

    async def written(self) -> None:
        """Wait until the writer has written this frame (raises WriterClosed if it never will).
        Cancelling this wait does not withdraw the frame."""
        if self._done is None:
            self._done = trio.Event()
        await self._done.wait()
        if self.error is not None:
            raise WriterClosed(str(self.error)) from self.error


class _AlreadySet:
    async def wait(self) -> None:
        await trio.lowlevel.checkpoint()

    def set(self) -> None:
        pass


_SET = _AlreadySet()


class ConnectionWriter:
    """Serializes every write to one connection through :meth:`run`.

    ``write`` is the connection's own write (for Yamux: the secure session's, which encrypts);
    ``on_failure`` is awaited once, shielded, when a write fails, to close the connection so its
    reader and every stream waiting on it learn at once.
    """

    def __init__(self, write: Callable[[bytes], Awaitable[None]], *, max_queued: int,
                 control_slack: int = 1 << 20,
                 on_failure: Callable[[], Awaitable[None]] | None = None, name: str = "") -> None:
        self._write = write
        self._on_failure = on_failure
        self.max_queued = max_queued
        self.control_slack = control_slack
        self.name = name
        self.started = False
        self._urgent: deque[QueuedFrame] = deque()
        self._queue: deque[QueuedFrame] = deque()
        self._in_flight: list[QueuedFrame] = []  # taken from the queue, being written
        self._queued_bytes = 0  # queued or being written, not yet on the wire
        self._work = trio.lowlevel.ParkingLot()
        self._room = trio.lowlevel.ParkingLot()
        self._error: BaseException | None = None

    @property
    def closed(self) -> bool:
        return self._error is not None

    def _check(self) -> None:
        if self._error is not None:
            raise WriterClosed(f"connection writer stopped: {self._error}")

    async def wait_for_room(self, n: int, *, control: bool = False) -> None:
        """Wait until ``n`` more bytes fit in the queue (``control``: within the control slack
        beyond the data bound). Nothing is committed by waiting, so a caller cancelled here has
        written nothing."""
        await trio.lowlevel.checkpoint_if_cancelled()
        bound = self.max_queued + (self.control_slack if control else 0)
        while True:
            self._check()
            if self._queued_bytes == 0 or self._queued_bytes + n <= bound:
                return
            await self._room.park()

    def push(self, data: bytes | bytearray, *, urgent: bool = False) -> QueuedFrame:
        """Queue ``data`` to be written whole; never blocks. Frames go out in the order pushed,
        except that urgent ones go before every data frame still queued (only for frames that
        no earlier frame must precede). Callers bound what they push with :meth:`wait_for_room`."""
        self._check()
        frame = QueuedFrame(data)
        (self._urgent if urgent else self._queue).append(frame)
        self._queued_bytes += len(data)
        self._work.unpark()
        return frame

    async def send(self, data: bytes | bytearray) -> None:
        """Queue ``data`` when there is room and wait until it is written."""
        await self.wait_for_room(len(data))
        await self.push(data).written()

    async def flush(self) -> None:
        """Wait until everything queued so far is written (or the writer has stopped)."""
        last = (self._queue[-1] if self._queue else self._urgent[-1] if self._urgent
                else self._in_flight[-1] if self._in_flight else None)
        if last is not None:
            try:
                await last.written()
            except WriterClosed:
                pass
        else:
            await trio.lowlevel.checkpoint()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The writer task: runs until cancelled (the connection's owner closes it) or a write
        fails. The only caller of ``write`` while it runs."""
        self.started = True
        task_status.started()
        try:
            while True:
                while not self._queue and not self._urgent:
                    await self._work.park()
                batch = self._in_flight
                size = 0
                while self._urgent:
                    frame = self._urgent.popleft()
                    batch.append(frame)
                    size += len(frame.data)
                while self._queue and (not batch or size + len(self._queue[0].data) <= COALESCE_BYTES):
                    frame = self._queue.popleft()
                    batch.append(frame)
                    size += len(frame.data)
                data = batch[0].data if len(batch) == 1 else b"".join(f.data for f in batch)
                await self._write(data)
                self._queued_bytes -= size
                for frame in batch:
                    frame._finish()
                batch.clear()
                self._room.unpark_all()
                await trio.lowlevel.checkpoint()  # a long queue must not starve everyone else
        except trio.Cancelled:
            self._stop(WriterClosed("connection closed"))
            raise
        except BaseException as e:
            # A failed write (the socket died, or a relayed stream under us was reset): the
            # connection is unusable. Close it so the reader sees it too; the error is the
            # connection's end, not this task's, so it does not propagate into the muxer.
            self._stop(e)
            log.debug("writer %s: %s: %s", self.name, type(e).__name__, e)
            if self._on_failure is not None:
                with trio.CancelScope(shield=True), trio.move_on_after(5):
                    try:
                        await self._on_failure()
                    except Exception:
                        pass
            if not isinstance(e, Exception):
                raise

    def _stop(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        for frame in self._in_flight:
            frame._finish(self._error)
        self._in_flight.clear()
        for queue in (self._urgent, self._queue):
            while queue:
                queue.popleft()._finish(self._error)
        self._queued_bytes = 0
        self._room.unpark_all()
        self._work.unpark_all()
