"""A node's metrics over HTTP (``--metrics-port``): ``GET /metrics`` in Prometheus' text format;
every other path is a 404 naming the one that exists."""

from __future__ import annotations

from contextlib import asynccontextmanager

import trio

from shardnet.inference.metrics import NodeMetrics

from .http import http_app, respond, serve_asgi


def metrics_app(metrics: NodeMetrics):
    @http_app
    async def app(scope, receive, send) -> None:
        if scope["path"] == "/metrics" and scope["method"] in ("GET", "HEAD"):
            status, (body, ctype) = 200, metrics.exposition()
        else:
            status, body, ctype = 404, b"not found: metrics are at /metrics\n", "text/plain; charset=utf-8"
        await respond(send, status, body, ctype, head=scope["method"] == "HEAD")

    return app


@asynccontextmanager
async def metrics_served(metrics: NodeMetrics, host: str, port: int):
    """Serve a node's metrics (its ``InferenceServices``' ``metrics``) while inside; yields the
    URL of /metrics."""
    async with trio.open_nursery() as nursery:
        urls = await nursery.start(lambda task_status: serve_asgi(metrics_app(metrics), host=host, port=port,
                                                                  what="metrics", task_status=task_status))
        try:
            yield f"{urls[0]}/metrics"
        finally:
            nursery.cancel_scope.cancel()
