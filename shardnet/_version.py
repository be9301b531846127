"""The package version, in a module of its own so that a module needing it imports no package root."""

__version__ = "0.1.0"
