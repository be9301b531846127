"""Prometheus metrics of a node (work in progress: filled in by the metrics change)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from shardnet.transport.node import Node


def exposition(node: Node) -> tuple[bytes, str]:
    """The node's metrics in Prometheus' text format, and its content type."""
    registry = CollectorRegistry(auto_describe=False)
    return generate_latest(registry), CONTENT_TYPE_LATEST
