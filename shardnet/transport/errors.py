"""Errors the overlay raises. Each carries a one-line message fit for a CLI user."""


class ShardnetError(Exception):
    """Base class: anything shardnet raises on purpose."""


class IdentityError(ShardnetError):
    """The identity key file is missing its key, corrupt, foreign or unsafe."""


class AddressError(ShardnetError):
    """A multiaddr could not be parsed or is unusable for its purpose."""


class DialError(ShardnetError):
    """A peer could not be reached in time."""


class ProtocolNotSupported(ShardnetError):
    """The remote peer does not speak the requested protocol."""


class PortInUseError(ShardnetError):
    """A fixed listen port is already bound by another process."""


class OverlayTimeout(ShardnetError):
    """A network wait ran past its deadline."""


class RecordError(ShardnetError):
    """A DHT record is malformed or its signature does not verify."""
