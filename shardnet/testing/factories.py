"""Small builders the tests and benches share: a block claim with every field by keyword, and a
stream handler that echoes. One definition each, so no test carries its own variant.

Imported explicitly (``from shardnet.testing.factories import ...``), never through conftest."""

from __future__ import annotations

from shardnet.protocols.block_claim import Claim


def claim(*, peer: str = "peer", start: int = 0, end: int = 4, model: str = "m", kv_tokens: int = 1024,
          tput: float = 10.0, addrs: tuple[str, ...] = (), expires: float = 2e9, **fields) -> Claim:
    """A ``Claim`` for tests, every argument by keyword (so no call can swap start and end or
    peer and layers); ``fields`` sets the optional ones (``load``, ``rtts``, ``reach`` ...).
    The default expiry (2e9: 2033) is far enough ahead never to lapse during a test."""
    return Claim(model=model, start=start, end=end, kv_tokens=kv_tokens, tput=tput, addrs=addrs,
                 expires=expires, peer=peer, **fields)


async def echo_handler(stream, *, timeout: float | None = None, until_closed: bool = False) -> None:
    """A stream handler that writes back what it reads until the other side closes.

    ``timeout``: at most this long for each read (None: the stream's own). ``until_closed``: a
    failing stream (reset, timed out) ends the echo quietly, and the stream is closed after it,
    as a long-running bench wants; otherwise the error propagates, as a test wants."""
    try:
        while data := await stream.read_some(timeout=timeout):
            await stream.write(data)
    except Exception:
        if not until_closed:
            raise
    if until_closed:
        await stream.close()


def random_prompts(n: int, *, seed: int, vocab: int, lengths: tuple[int, int]) -> list[list[int]]:
    """``n`` prompts of random token IDs in 3..vocab-1 (past the special tokens), each of a random
    length in ``lengths`` (inclusive); the same for the same seed."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(*lengths))] for _ in range(n)]


def frame_body(frame: bytes) -> bytes:
    """The one body in a length-prefixed protobuf frame (libp2p's relay and NAT messages),
    asserting nothing follows it."""
    from shardnet.transport.nat.pbwire import FrameBuffer

    fb = FrameBuffer()
    fb.feed(frame)
    out = fb.next_body()
    assert out is not None and fb.take_rest() == b""
    return out


def activation_step(*, n: int, pos: int, tokens: int, hidden: int = 8, epoch: int = 0,
                    session: bytes | None = None):
    """An activation ``Step`` of ``tokens`` zero float32 vectors of width ``hidden`` at position
    ``pos``; ``session`` defaults to ``b"s"`` repeated to a session ID's length."""
    from shardnet.protocols import activation as ap

    session = b"s" * ap.SESSION_ID_BYTES if session is None else session
    return ap.Step(session, n=n, pos=pos, dtype="float32", shape=[1, tokens, hidden],
                   payload=bytes(4 * tokens * hidden), epoch=epoch)


def activation_frame(header: dict, payload: bytes = b"", *, prefixed: bool = True) -> bytes:
    """An activation-protocol frame as any peer may send it: a CBOR header (length-prefixed) and
    raw payload bytes, the whole with its own length prefix unless ``prefixed=False``."""
    import cbor2

    h = cbor2.dumps(header)
    body = len(h).to_bytes(4, "big") + h + payload
    return len(body).to_bytes(4, "big") + body if prefixed else body
