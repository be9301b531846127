"""Serving an ASGI app with Hypercorn on trio, in the event loop of the node it shows: the
gateway, and a node's metrics endpoint (``--metrics-port``)."""

from __future__ import annotations

import errno
import logging

import trio

from shardnet.errors import PortInUseError


async def serve_asgi(app, *, host: str, port: int, what: str = "HTTP",
                     task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``app`` until cancelled; ``task_status.started`` gets the bound URLs. A port in use
    (or any bind failure) is one PortInUseError naming ``what`` listens there."""
    from hypercorn.config import Config
    from hypercorn.trio.run import worker_serve
    from hypercorn.utils import wrap_app

    config = Config()
    config.bind = [f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    config.graceful_timeout = 5.0
    # Bind here, before Hypercorn's nurseries, so a port in use is one clear error.
    try:
        sockets = config.create_sockets()
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise PortInUseError(f"{what} {host}:{port}: port {port} is already in use by another process") from None
        raise PortInUseError(f"{what} {host}:{port}: cannot bind: {e.strerror or e}") from None
    for sock in sockets.insecure_sockets:
        sock.listen(config.backlog)
    await worker_serve(wrap_app(app, config.wsgi_max_body_size, "asgi"), config, sockets=sockets,
                       task_status=task_status)


async def answer_lifespan(receive, send) -> None:
    """An ASGI lifespan scope, for apps with nothing to start or stop: say so until shutdown."""
    while (msg := await receive())["type"] != "lifespan.shutdown":
        if msg["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
    await send({"type": "lifespan.shutdown.complete"})


async def respond(send, status: int, body: bytes, content_type: str, headers=(), *, head: bool = False) -> None:
    """One whole HTTP response (``head``: the headers alone, as a HEAD request wants)."""
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": b"" if head else body, "more_body": False})


def http_app(handle):
    """An ASGI app from a handler of HTTP requests: a lifespan scope answered, others ignored."""
    async def app(scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
        elif scope["type"] == "http":
            await handle(scope, receive, send)

    return app
