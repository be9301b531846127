"""A node's metrics over HTTP (``--metrics-port``): ``GET /metrics`` in Prometheus' text format;
every other path is a 404 naming the one that exists."""

from __future__ import annotations

from contextlib import asynccontextmanager

import trio

from shardnet.inference.metrics import exposition
from shardnet.transport.node import Node

from .http import http_app, respond, serve_asgi


def metrics_app(node: Node):
    @http_app
    async def app(scope, receive, send) -> None:
        if scope["path"] == "/metrics" and scope["method"] in ("GET", "HEAD"):
            status, (body, ctype) = 200, exposition(node)
        else:
            status, body, ctype = 404, b"not found: metrics are at /metrics\n", "text/plain; charset=utf-8"
        await respond(send, status, body, ctype, head=scope["method"] == "HEAD")

    return app


@asynccontextmanager
async def metrics_served(node: Node, host: str, port: int):
    """Serve the node's metrics while inside; yields the URL of /metrics."""
    async with trio.open_nursery() as nursery:
        urls = await nursery.start(lambda task_status: serve_asgi(metrics_app(node), host=host, port=port,
                                                                  what="metrics", task_status=task_status))
        try:
            yield f"{urls[0]}/metrics"
        finally:
            nursery.cancel_scope.cancel()
