"""Patches to py-libp2p's Noise transport and secure session (``libp2p.security``): part of the
data-path speed-up (fix 6), off with SHARDNET_UNTUNED_DATA_PATH=1. The wire format is unchanged.

6. Noise transport messages are read through a receive buffer (one ``recv`` yields many
   messages) instead of two exact reads per message, and a write of many messages is encrypted
   into one socket write. The secure session's read buffer is a bytearray with an offset, not a
   BytesIO copied on every partial read.
"""

from __future__ import annotations

from typing import Any

#: Bytes asked of the socket per receive on the Noise transport.
NOISE_RECV_CHUNK = 1 << 18


# The cipher states are driven directly: NoiseConnection.encrypt/decrypt insist on ``bytes``,
# which would cost one more copy of every message in each direction.
def buffer_noise_reads() -> None:
    from cryptography.exceptions import InvalidTag
    from libp2p.io.exceptions import IncompleteReadError
    from libp2p.security.noise import io as nio
    from noise.exceptions import NoiseInvalidMessage

    async def read_msg(self: Any, prefix_encoded: bool = False) -> bytes:
        # Receive buffer with a read offset: parsing a message moves nothing; the consumed
        # prefix is dropped only when more bytes must be appended.
        d = self.__dict__
        buf = d.get("_sn_rbuf")
        if buf is None:
            buf = d["_sn_rbuf"] = bytearray()
            d["_sn_rpos"] = 0
        raw = self.read_writer.read_write_closer
        while True:
            pos = d["_sn_rpos"]
            avail = len(buf) - pos
            if avail >= 2:
                n = (buf[pos] << 8) | buf[pos + 1]
                if avail >= 2 + n:
                    start = pos + 2 + (len(self.prefix) if prefix_encoded else 0)
                    d["_sn_rpos"] = pos + 2 + n
                    with memoryview(buf) as view:
                        try:
                            return self.noise_state.noise_protocol.cipher_state_decrypt.decrypt_with_ad(
                                None, view[start : pos + 2 + n]
                            )
                        except InvalidTag:
                            raise NoiseInvalidMessage("Failed authentication of message") from None
            if pos:
                del buf[:pos]
                d["_sn_rpos"] = 0
            chunk = await raw.read(NOISE_RECV_CHUNK)
            if not chunk:
                raise IncompleteReadError(
                    f"connection closed with {len(buf)} bytes of a Noise message buffered",
                    expected_bytes=2,
                    received_bytes=len(buf),
                )
            buf += chunk

    nio.NoiseTransportReadWriter.read_msg = read_msg


def batch_noise_writes() -> None:
    from libp2p.security.noise import io as nio

    max_plain = nio.MAX_PLAINTEXT_LENGTH

    async def write_msg(self: Any, msg: bytes, prefix_encoded: bool = False) -> None:
        seal = self.noise_state.noise_protocol.cipher_state_encrypt.encrypt_with_ad
        parts: list[bytes] = []
        with memoryview(msg) as view:
            for start in range(0, max(len(view), 1), max_plain):
                sealed = seal(None, view[start : start + max_plain])
                if prefix_encoded and start == 0:
                    sealed = self.prefix + sealed
                parts.append(len(sealed).to_bytes(2, "big"))
                parts.append(sealed)
        await self.read_writer.read_write_closer.write(b"".join(parts))

    nio.NoiseTransportReadWriter.write_msg = write_msg


def _reset_internal_buffer(self: Any) -> None:
    self.__dict__["_sn_buf"] = bytearray()


def bytearray_session_buffer() -> None:
    from libp2p.security.secure_session import SecureSession

    SecureSession._reset_internal_buffer = _reset_internal_buffer


def read_session_from_bytearray() -> None:
    from libp2p.io.exceptions import ConnectionClosedError
    from libp2p.security.secure_session import SecureSession

    async def read(self: Any, n: int | None = None) -> bytes:
        if n == 0:
            return b""
        buf = self.__dict__["_sn_buf"]
        if not buf:
            msg = await self.conn.read_msg()
            if msg == b"":
                raise ConnectionClosedError("Connection closed")
            if n is None or len(msg) <= n:
                return msg
            buf += msg
        if n is None or n >= len(buf):
            out = bytes(buf)
            buf.clear()
            return out
        out = bytes(buf[:n])
        del buf[:n]
        return out

    SecureSession.read = read

