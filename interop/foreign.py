"""Driving foreign libp2p peers from tests: a js-libp2p process (interop/js/peer.js) that takes
JSON-line commands on stdin and answers on stdout."""

from __future__ import annotations

import base64
import itertools
import json
import os
import queue
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
JS_DIR = HERE / "js"


class ForeignError(RuntimeError):
    pass


def js_available() -> str | None:
    """None when the js peer can run here, else why not."""
    if shutil.which("node") is None:
        return "node is not installed"
    if not (JS_DIR / "node_modules" / "libp2p").is_dir():
        return "run `npm ci` in interop/js first (interop/run.sh does)"
    return None


class JsPeer:
    def __init__(self, log_dir: Path, name: str = "js", *, prefix: list[str] = (), debug: str = "",
                 **opts) -> None:
        """``prefix``: argv to run it under (a NAT lab host's); ``debug``: js-libp2p's DEBUG
        namespaces for its log (e.g. "libp2p:dcutr*")."""
        self.log_path = log_dir / f"{name}.log"
        self.log = open(self.log_path, "wb")
        env = {**os.environ, "DEBUG": debug} if debug else None
        self.proc = subprocess.Popen(
            [*prefix, "node", "--import", "./polyfill.js", "peer.js", json.dumps(opts)], cwd=JS_DIR, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, start_new_session=True)
        self.pid = self.proc.pid
        self.lines: queue.Queue[dict | None] = queue.Queue()
        self.messages: list[dict] = []
        self._ids = itertools.count(1)
        threading.Thread(target=self._pump, daemon=True).start()
        ready = self._next(lambda e: e.get("event") == "ready", 30)
        self.peer_id: str = ready["peer_id"]
        self.addrs: list[str] = ready["addrs"]
        self.protocols: list[str] = ready["protocols"]

    def _pump(self) -> None:
        for raw in self.proc.stdout:
            try:
                self.lines.put(json.loads(raw))
            except json.JSONDecodeError:
                continue
        self.lines.put(None)

    def _next(self, pred, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            try:
                e = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise ForeignError(f"js peer: no answer within {timeout:g} s") from None
            if e is None:
                raise ForeignError("js peer exited")
            if e.get("event") == "message":
                self.messages.append(e)
            if pred(e):
                return e

    def call(self, cmd: str, timeout: float = 30.0, **args) -> dict:
        """Run a command; its result, or ForeignError with the js side's error."""
        cid = next(self._ids)
        self.proc.stdin.write((json.dumps({"cmd": cmd, "id": cid, **args}) + "\n").encode())
        self.proc.stdin.flush()
        r = self._next(lambda e: e.get("event") == "result" and e.get("id") == cid, timeout)
        if not r["ok"]:
            raise ForeignError(r["error"])
        return r

    def wait_message(self, topic: str, timeout: float = 30.0) -> bytes:
        for m in self.messages:
            if m["topic"] == topic:
                self.messages.remove(m)
                return base64.b64decode(m["data"])
        m = self._next(lambda e: e.get("event") == "message" and e["topic"] == topic, timeout)
        self.messages.remove(m)
        return base64.b64decode(m["data"])

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(10)
            except (subprocess.TimeoutExpired, OSError):
                os.killpg(self.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()
