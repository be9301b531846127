"""Start and stop local swarms of ``shardnet`` processes (used by ``shardnet demo`` and tests).

Each process is started in its own session and stopped by its PID (SIGTERM, then SIGKILL after a
grace period), so nothing outlives its owner. Output is read by a thread per process into a
queue, so a slow reader never blocks the child.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from shardnet.errors import ShardnetError


def shardnet_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "shardnet", *args]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ShardnetProcess:
    """One ``shardnet`` child process with line-oriented stdout and a log file for stderr."""

    def __init__(self, name: str, args: list[str], *, workdir: Path, env: dict | None = None,
                 prefix: list[str] | None = None, program: list[str] | None = None) -> None:
        self.name = name
        self.log_path = workdir / f"{name}.log"
        self._log = open(self.log_path, "wb")
        child_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        # prefix: e.g. ["ip", "netns", "exec", "ns1"] to run the node inside a network namespace
        self.proc = subprocess.Popen(
            # program: another entry point taking shardnet's arguments (tests' misbehaving peers)
            [*(prefix or []), *(program + args if program else shardnet_argv(*args))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=child_env,
            start_new_session=True,
        )
        self.pid = self.proc.pid
        #: when it was started, and when the line ``next_line`` returned last came (monotonic
        #: times; stamped by the reading thread, so a late reader still learns when it came)
        self.started = time.monotonic()
        self.line_at = self.started
        self.lines: queue.Queue[tuple[float, str | None]] = queue.Queue()
        self.seen: list[str] = []
        self._ids = itertools.count(1)
        threading.Thread(target=self._pump, daemon=True, name=f"stdout-{name}").start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.lines.put((time.monotonic(), raw.decode("utf-8", "replace").rstrip("\n")))
        self.lines.put((time.monotonic(), None))

    def next_line(self, timeout: float) -> str:
        try:
            at, line = self.lines.get(timeout=max(0.0, timeout))
        except queue.Empty:
            raise ShardnetError(f"{self.name}: no output within {timeout:.1f} s (log: {self.log_path})") from None
        if line is None:
            self.lines.put((at, None))
            raise ShardnetError(f"{self.name} exited with {self.proc.wait()}: {self.tail_log()}")
        self.seen.append(line)
        self.line_at = at
        return line

    def wait_for_line(self, predicate, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            line = self.next_line(deadline - time.monotonic())
            if predicate(line):
                return line

    def next_event(self, timeout: float) -> dict[str, Any]:
        line = self.next_line(timeout)
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            raise ShardnetError(f"{self.name}: not a JSON event: {line!r}") from None

    def wait_event(self, predicate, timeout: float, *, keep: list | None = None) -> dict[str, Any]:
        """The first event matching ``predicate``; others go to ``keep`` if given."""
        deadline = time.monotonic() + timeout
        while True:
            ev = self.next_event(deadline - time.monotonic())
            if predicate(ev):
                return ev
            if keep is not None:
                keep.append(ev)

    def command(self, cmd: dict[str, Any], timeout: float = 30.0, *, keep: list | None = None) -> dict:
        """Send one JSON command (``--events`` mode) and return its result event."""
        cid = next(self._ids)
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({**cmd, "id": cid}) + "\n").encode())
        self.proc.stdin.flush()
        return self.wait_event(lambda e: e.get("event") == "result" and e.get("id") == cid, timeout, keep=keep)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, grace: float = 10.0) -> int:
        """Stop by PID: ``sig`` first, SIGKILL if it is still there after ``grace`` seconds."""
        if self.proc.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.proc.wait(5)
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                if f:
                    f.close()
            except Exception:
                pass
        self._log.close()
        return self.proc.returncode

    def tail_log(self, n: int = 5) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join(lines[-n:])


def stop_processes(procs: list[ShardnetProcess], grace: float = 10.0) -> None:
    """Stop them all by PID: SIGTERM to every one first, then each waited for (SIGKILL if still
    there after ``grace`` seconds), so that their shutdowns overlap instead of adding up."""
    for p in procs:
        if p.alive():
            try:
                os.kill(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    for p in procs:
        p.stop(0, grace)  # signal 0 sends nothing: the SIGTERM went out above


class LocalSwarm:
    """A bootstrap plus N ``shardnet node --events`` processes on loopback; with ``swarm_key`` (a
    key file) every process it starts is a member of that private swarm."""

    def __init__(self, workdir: Path | None = None, *, swarm_key: Path | None = None) -> None:
        self.swarm_key = swarm_key
        self._tmp = None if workdir else tempfile.TemporaryDirectory(prefix="shardnet-swarm-")
        self.workdir = Path(workdir or self._tmp.name)  # type: ignore[union-attr]
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.procs: list[ShardnetProcess] = []
        self.bootstrap_addr: str | None = None
        self.bootstrap: ShardnetProcess | None = None

    def start_bootstrap(self, timeout: float = 30.0) -> str:
        p = self._spawn("bootstrap", ["bootstrap", "--identity", str(self.workdir / "bootstrap.key"),
                                      "--listen", "/ip4/127.0.0.1/tcp/0"])
        addrs: list[str] = []
        deadline = time.monotonic() + timeout
        while True:
            line = p.next_line(deadline - time.monotonic())
            if line.strip().startswith("/ip4/"):
                addrs.append(line.strip())
            if line.startswith("ready"):
                break
        if not addrs:
            raise ShardnetError("bootstrap printed no address")
        self.bootstrap, self.bootstrap_addr = p, addrs[0]
        return addrs[0]

    def start_node(self, name: str, *extra: str, timeout: float = 30.0,
                   command: str = "node") -> tuple[ShardnetProcess, dict]:
        """``shardnet node`` (or ``join``, with ``command``) in --events mode; waits for ready."""
        p = self.spawn_node(name, *extra, command=command)
        return p, self.wait_ready(p, timeout)

    def spawn_node(self, name: str, *extra: str, command: str = "node",
                   program: list[str] | None = None) -> ShardnetProcess:
        """Start without waiting (several nodes load in parallel); then ``wait_ready``."""
        if self.bootstrap_addr is None:
            raise ShardnetError("start the bootstrap first")
        return self._spawn(name, [command, "--events", "--identity", str(self.workdir / f"{name}.key"),
                                  "--listen", "/ip4/127.0.0.1/tcp/0", "--bootstrap", self.bootstrap_addr, *extra],
                           program=program)

    def join_spans(self, spans, *extra: str, timeout: float = 120.0) -> list[dict]:
        """One ``shardnet join --layers a:b`` per span (``extra`` arguments for each), loading in
        parallel; their ready events, in order."""
        first = len(self.procs)
        procs = [self.spawn_node(f"join{first + i}", "--layers", f"{a}:{b}", *extra, command="join")
                 for i, (a, b) in enumerate(spans)]
        return [self.wait_ready(p, timeout) for p in procs]

    def start_gateway(self, *extra: str, timeout: float = 60.0, name: str = "gateway") -> tuple[str, ShardnetProcess]:
        """``shardnet serve`` on a free port, bootstrapped here; its base URL once it listens
        (``name``: its log's, for a second gateway)."""
        p = self._spawn(name, ["serve", "--bootstrap", self.bootstrap_addr, "--port", str(free_port()), *extra])
        line = p.wait_for_line(lambda s: "serving the OpenAI API" in s, timeout)
        return re.search(r"http://[\d.]+:\d+", line).group(0), p

    def spawn_program(self, name: str, program: list[str], *args: str) -> ShardnetProcess:
        """Another program (a test's hostile peer or client), stopped with the swarm."""
        return self._spawn(name, list(args), program=program)

    @staticmethod
    def wait_ready(p: ShardnetProcess, timeout: float = 30.0) -> dict:
        return p.wait_event(lambda e: e.get("event") == "ready", timeout)

    def _spawn(self, name: str, args: list[str], program: list[str] | None = None) -> ShardnetProcess:
        env = {"SHARDNET_SWARM_KEY": str(self.swarm_key)} if self.swarm_key else None
        p = ShardnetProcess(name, args, workdir=self.workdir, program=program, env=env)
        self.procs.append(p)
        return p

    def stop_all(self) -> None:
        stop_processes(list(reversed(self.procs)))
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> LocalSwarm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()
