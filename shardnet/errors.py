"""Every error shardnet raises on purpose derives from ``ShardnetError``. Each carries a one-line
message fit for a CLI user and a ``code``: a short stable name a caller can branch on (never
parse the message)."""


class ShardnetError(Exception):
    """Base class: anything shardnet raises on purpose. Each subclass names its own ``code``;
    InferenceError carries one per instance (the chain's failure code)."""

    code: str = "error"


class IdentityError(ShardnetError):
    """The identity key file is missing its key, corrupt, foreign or unsafe."""

    code = "identity"


class AddressError(ShardnetError):
    """A multiaddr could not be parsed or is unusable for its purpose."""

    code = "address"


class DialError(ShardnetError):
    """A peer could not be reached in time."""

    code = "dial"


class ProtocolNotSupported(ShardnetError):
    """The remote peer does not speak the requested protocol."""

    code = "protocol_not_supported"


class StreamLimitError(ShardnetError):
    """A new stream was refused at once because a limit on open streams is reached: this node's
    (py-libp2p Yamux's 256 per connection, ``streams_total``) or the peer's (``streams_per_peer``,
    ``stream_rate_per_peer``). The message names the limit and its value."""

    code = "stream_limit"


class PortInUseError(ShardnetError):
    """A fixed listen port is already bound by another process."""

    code = "port_in_use"


class OverlayTimeout(ShardnetError):
    """A network wait ran past its deadline."""

    code = "timeout"


class RecordError(ShardnetError):
    """A DHT record is malformed or its signature does not verify."""

    code = "record"


class NotStoredError(ShardnetError):
    """No DHT peer took a record this node published (it knows none, or all refused)."""

    code = "not_stored"


class InferenceError(ShardnetError):
    """A chain failed or refused: ``code`` says how (an activation ``ErrorCode``), ``peer`` (when
    known) which peer failed. A busy refusal may give its figures: ``need_bytes`` and
    ``limit_bytes`` (a KV budget), ``retry_after_s`` (a session rate)."""

    def __init__(self, code: str, message: str, peer: str | None = None, *, need_bytes: int | None = None,
                 limit_bytes: int | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.peer = peer
        self.need_bytes, self.limit_bytes, self.retry_after_s = need_bytes, limit_bytes, retry_after_s

    @property
    def figures(self) -> dict[str, int | float]:
        """The figures given, by their wire names (for an ``error`` message)."""
        return {k: v for k, v in (("need_bytes", self.need_bytes), ("limit_bytes", self.limit_bytes),
                                  ("retry_after_s", self.retry_after_s)) if v is not None}


class CheckpointError(ShardnetError):
    """The directory is not a usable checkpoint, its family is not supported, or a layer range
    does not fit it: a user error."""

    code = "checkpoint"


class NoRouteError(ShardnetError):
    """No set of live claims covers every layer."""

    code = "no_route"


class HeldError:
    """An exception raised inside nurseries, held until they have closed and then re-raised as
    itself (trio would hand it on wrapped in their exception groups). The body runs in ``with
    held:`` inside the nurseries (which then close normally), ``held.reraise()`` comes after them.

    Not an error itself: it lives here, beside the errors, as the one way shardnet's context
    managers and generators hand their body's exception back to the caller unwrapped."""

    def __init__(self) -> None:
        #: the exception the body raised (cancellation and GeneratorExit included), or None
        self.error: BaseException | None = None

    def __enter__(self) -> "HeldError":
        return self

    def __exit__(self, kind, error, traceback) -> bool:
        if error is not None:
            self.error = error
        return True  # held: the nurseries around close normally

    def reraise(self) -> None:
        if self.error is not None:
            raise self.error
