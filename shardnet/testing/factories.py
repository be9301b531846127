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
