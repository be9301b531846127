"""The overlay's errors: the package's one error root lives in ``shardnet/errors.py``."""

from shardnet.errors import (  # noqa: F401
    AddressError,
    DialError,
    HeldError,
    IdentityError,
    NotStoredError,
    OverlayTimeout,
    PortInUseError,
    ProtocolNotSupported,
    RecordError,
    ShardnetError,
    StreamLimitError,
)
