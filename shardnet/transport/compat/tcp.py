"""Patches to what py-libp2p reads from a stranger before any handshake: TCP reads and
multistream-select messages.

13. Unbounded reads from strangers, before any handshake. Multistream-select reads a varint
   length and then that many bytes (no limit), and a TCP read of n bytes asks the socket for n
   at once, which allocates n: four random bytes from anyone who can reach the port made the
   node allocate up to gigabytes (measured: a quarter of a victim's CPU in ``recv`` under a
   raw-garbage flood). Multistream messages are now limited to 64 KiB (go-multistream refuses
   longer ones too), a TCP read takes at most 256 KiB per call, new inbound connections from one
   IP address are rate-limited (``connection_rate_per_ip``), an inbound TCP connection must
   open with the multistream header (20 bytes, checked before anything else runs), and the
   whole inbound upgrade (header, Noise, Yamux) must finish within the node's
   ``handshake_s`` limit. The last three are checked in swarm.py's inbound connection handler
   with the helpers here.
"""

from __future__ import annotations

from typing import Any

MULTISTREAM_HEADER = b"\x13/multistream/1.0.0\n"
MAX_MULTISTREAM_MESSAGE = 64 << 10
MAX_TCP_READ = 256 << 10


def _drop(stream: Any) -> None:
    """Close a TCP connection at once (a refused flood of them should cost next to nothing)."""
    try:
        stream.stream.socket.close()
    except Exception:
        pass


def _remote_ip(stream: Any) -> str:
    try:
        return str(stream.get_remote_address()[0])
    except Exception:
        return "unknown"


class NotMultistream(Exception):
    """An inbound connection that did not open with the multistream-select header."""


async def _opening_bytes(stream: Any) -> bytes:
    got = b""
    while len(got) < len(MULTISTREAM_HEADER):
        chunk = await stream.read(len(MULTISTREAM_HEADER) - len(got))
        if not chunk:
            raise NotMultistream(f"closed after {len(got)} bytes")
        got += chunk
        if not MULTISTREAM_HEADER.startswith(got):
            raise NotMultistream(f"opened with {got[:20]!r}")
    return got


async def _read_delim(reader: Any) -> bytes:
    from libp2p.exceptions import ParseError
    from libp2p.utils import varint

    msg = await varint.read_varint_prefixed_bytes_limited(reader, MAX_MULTISTREAM_MESSAGE)
    if not msg or msg[-1:] != b"\n":
        raise ParseError("multistream message is not newline-delimited")
    return msg[:-1]


# ``read_delim`` is imported by name into two more modules: each binding is its own patch.
def bound_multistream_messages_in_varint() -> None:
    from libp2p.utils import varint

    varint.read_delim = _read_delim


def bound_multistream_messages_in_utils() -> None:
    from libp2p import utils

    utils.read_delim = _read_delim


def bound_multistream_messages_in_communicator() -> None:
    import libp2p.protocol_muxer.multiselect_communicator as communicator

    communicator.read_delim = _read_delim


def bound_tcp_reads() -> None:
    from libp2p.io.trio import TrioTCPStream

    read = TrioTCPStream.read

    async def bounded_read(self: Any, n: int | None = None) -> bytes:
        return await read(self, MAX_TCP_READ if n is None or n > MAX_TCP_READ else n)

    TrioTCPStream.read = bounded_read
