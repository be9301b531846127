"""``org/name`` resolves from a real Hugging Face cache, laid out by huggingface_hub's own download
code: a local HTTP server impersonates the hub for a few repos, serving the shipped tiny-llama as
``testorg/tiny-llama``.

The fake hub answers what snapshot_download and hf_hub_download ask (huggingface_hub 2.x): the
revision (``GET /api/models/<repo>/revision/<rev>``: id and commit sha), the file list
(``GET /api/models/<repo>/tree/<commit>``: path, size, git blob id, LFS sha256 for weights) and
each file (``HEAD``/``GET /<repo>/resolve/<commit>/<file>``, with X-Repo-Commit, ETag (the blob
id, or for an LFS file its sha256 as X-Linked-Etag) and Content-Length). Unknown repos, revisions
and files get the 404s with X-Error-Code the hub sends."""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from huggingface_hub import constants, hf_hub_download, scan_cache_dir

from shardnet.errors import CheckpointError
from shardnet.inference.model.hub import looks_like_repo_id, resolve_hub_checkpoint
from shardnet.testing.helpers import free_port

TINY_LLAMA = Path(__file__).resolve().parents[3] / "shardnet" / "models" / "tiny-llama"
REPO = "testorg/tiny-llama"
#: files a repo holds besides the checkpoint's: never fetched
NOT_CHECKPOINT = {"README.md": b"# tiny llama\n", "pytorch_model.bin": b"not fetched " * 100}


def commit_of(repo: str) -> str:
    return hashlib.sha1(repo.encode()).hexdigest()


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class FakeHub:
    """The hub's model endpoints for ``repos`` (repo ID -> {file name: bytes}), on 127.0.0.1."""

    def __init__(self, repos: dict[str, dict[str, bytes]]) -> None:
        self.repos = repos
        self.fetched: list[str] = []  # "<repo>/<file>" of every GET of a file
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_HEAD(self):
                hub.answer(self, body=False)

            def do_GET(self):
                hub.answer(self, body=True)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        # a short poll: stop() waits for serve_forever to notice
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()

    def answer(self, req: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlsplit(req.path).path)
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path):
            repo, files, commit = self.find(req, m[1], m[2] or "main")
            if files is not None:
                self.send_json(req, {"id": repo, "sha": commit, "private": False,
                                     "siblings": [{"rfilename": f} for f in sorted(files)]}, body)
        elif m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)", path):
            repo, files, commit = self.find(req, m[1], m[2])
            if files is not None:
                self.send_json(req, [self.tree_entry(name, data) for name, data in sorted(files.items())], body)
        elif m := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
            repo, files, commit = self.find(req, m[1], m[2])
            if files is None:
                return
            if m[3] not in files:
                self.send_error(req, 404, "EntryNotFound", commit)
                return
            data = files[m[3]]
            req.send_response(200)
            req.send_header("X-Repo-Commit", commit)
            if m[3].endswith(".safetensors"):  # an LFS file: its etag is its sha256
                req.send_header("X-Linked-Etag", f'"{hashlib.sha256(data).hexdigest()}"')
                req.send_header("X-Linked-Size", str(len(data)))
                req.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
            else:
                req.send_header("ETag", f'"{git_blob_id(data)}"')
            req.send_header("Content-Length", str(len(data)))
            req.send_header("Content-Type", "application/octet-stream")
            req.end_headers()
            if body:
                self.fetched.append(f"{repo}/{m[3]}")
                req.wfile.write(data)
        else:
            self.send_error(req, 404, "EntryNotFound", None)

    def find(self, req, repo: str, revision: str) -> tuple[str, dict[str, bytes] | None, str]:
        if repo not in self.repos:
            self.send_error(req, 404, "RepoNotFound", None)
            return repo, None, ""
        commit = commit_of(repo)
        if revision not in ("main", commit):
            self.send_error(req, 404, "RevisionNotFound", None)
            return repo, None, ""
        return repo, self.repos[repo], commit

    @staticmethod
    def tree_entry(name: str, data: bytes) -> dict:
        entry = {"type": "file", "path": name, "size": len(data), "oid": git_blob_id(data)}
        if name.endswith(".safetensors"):
            entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        return entry

    @staticmethod
    def send_json(req, obj, body: bool) -> None:
        raw = json.dumps(obj).encode()
        req.send_response(200)
        req.send_header("Content-Type", "application/json")
        req.send_header("Content-Length", str(len(raw)))
        req.end_headers()
        if body:
            req.wfile.write(raw)

    @staticmethod
    def send_error(req, status: int, code: str, commit: str | None) -> None:
        raw = json.dumps({"error": code}).encode()
        req.send_response(status)
        req.send_header("X-Error-Code", code)
        if commit:
            req.send_header("X-Repo-Commit", commit)
        req.send_header("Content-Type", "application/json")
        req.send_header("Content-Length", str(len(raw)))
        req.end_headers()
        if req.command != "HEAD":
            req.wfile.write(raw)


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache in tmp_path, online, no token. huggingface_hub reads its
    environment when imported, so its constants are set too."""
    home = tmp_path / "hf"
    cache = home / "hub"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(home / "token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(home / "stored_tokens"))
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
                "HF_HUB_ETAG_TIMEOUT"):
        monkeypatch.delenv(var, raising=False)
    set_offline(monkeypatch, False)
    return cache


def set_endpoint(monkeypatch, url: str) -> None:
    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.setattr(constants, "ENDPOINT", url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")


def set_offline(monkeypatch, offline: bool) -> None:
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)


def tiny_llama_files() -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in TINY_LLAMA.iterdir() if p.is_file() and not p.name.startswith(".")}


@pytest.fixture
def hub(hf_cache, monkeypatch):
    no_weights = {"config.json": (TINY_LLAMA / "config.json").read_bytes(),
                  "pytorch_model.bin": NOT_CHECKPOINT["pytorch_model.bin"]}
    fake = FakeHub({REPO: {**tiny_llama_files(), **NOT_CHECKPOINT}, "testorg/no-weights": no_weights})
    set_endpoint(monkeypatch, fake.url)
    yield fake
    fake.stop()


def test_downloads_then_resolves_offline_to_the_same_checkpoint(hub, hf_cache, monkeypatch):
    snapshot = resolve_hub_checkpoint(REPO)
    assert snapshot == hf_cache / "models--testorg--tiny-llama" / "snapshots" / commit_of(REPO)
    repos = {r.repo_id: r for r in scan_cache_dir(hf_cache).repos}
    assert REPO in repos and commit_of(REPO) in {r.commit_hash for r in repos[REPO].revisions}
    # the checkpoint's files, and nothing else of the repo
    assert sorted(f.removeprefix(REPO + "/") for f in hub.fetched) == sorted(tiny_llama_files())
    assert sorted(p.name for p in snapshot.iterdir()) == sorted(tiny_llama_files())

    hub.stop()
    set_offline(monkeypatch, True)
    assert resolve_hub_checkpoint(REPO) == snapshot
    assert resolve_hub_checkpoint(REPO, revision=commit_of(REPO)) == snapshot
    for name, data in tiny_llama_files().items():
        assert (snapshot / name).read_bytes() == data
    from shardnet.inference.model.checkpoint import Checkpoint

    assert Checkpoint(snapshot).model_id == Checkpoint(TINY_LLAMA).model_id
    assert REPO in Checkpoint(snapshot).names


def test_a_partly_cached_repo_is_completed_online(hub, hf_cache):
    # what transformers' AutoConfig leaves behind: the snapshot holds config.json alone
    hf_hub_download(REPO, "config.json")
    snapshot = resolve_hub_checkpoint(REPO)
    assert (snapshot / "model.safetensors").read_bytes() == (TINY_LLAMA / "model.safetensors").read_bytes()


def test_unknown_repo_offline_is_none(hf_cache, monkeypatch):
    set_offline(monkeypatch, True)
    assert resolve_hub_checkpoint("testorg/unknown") is None
    assert resolve_hub_checkpoint("not a repo id") is None


def test_unknown_repo_on_the_hub_is_none(hub):
    assert resolve_hub_checkpoint("testorg/unknown") is None
    assert resolve_hub_checkpoint(REPO, revision="no-such-branch") is None


def test_a_cached_repo_without_safetensors_is_a_one_line_error(hub, monkeypatch):
    with pytest.raises(CheckpointError, match=r"^testorg/no-weights from the Hugging Face hub has no "
                                              r"\*\.safetensors weights$"):
        resolve_hub_checkpoint("testorg/no-weights")
    hub.stop()
    set_offline(monkeypatch, True)
    with pytest.raises(CheckpointError) as refused:
        resolve_hub_checkpoint("testorg/no-weights")
    assert "\n" not in str(refused.value)
    assert re.fullmatch(r"testorg/no-weights in the Hugging Face cache \(.*\) has no \*\.safetensors weights",
                        str(refused.value))


def test_an_interrupted_download_is_a_one_line_error_offline(hub, monkeypatch):
    snapshot = resolve_hub_checkpoint(REPO)
    (snapshot / "model.safetensors").unlink()
    hub.stop()
    set_offline(monkeypatch, True)
    with pytest.raises(CheckpointError, match=r"is an incomplete download \(missing model\.safetensors\)$") as refused:
        resolve_hub_checkpoint(REPO)
    assert "\n" not in str(refused.value)


def test_an_unreachable_hub_is_none_within_seconds(hf_cache, monkeypatch):
    set_endpoint(monkeypatch, f"http://127.0.0.1:{free_port()}")  # nothing listens there
    started = time.monotonic()
    assert resolve_hub_checkpoint(REPO) is None
    assert time.monotonic() - started < 5
    assert resolve_hub_checkpoint(REPO, download=False) is None


def test_looks_like_repo_id(tmp_path, monkeypatch):
    assert looks_like_repo_id("testorg/tiny-llama") and looks_like_repo_id("gpt2")
    assert not looks_like_repo_id("a/b/c") and not looks_like_repo_id("org/name--x")
    assert not looks_like_repo_id("./model") and not looks_like_repo_id("/abs/path")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not looks_like_repo_id("org/name")  # an existing directory is a directory


def test_a_repo_cached_by_commit_alone_resolves_offline(hub, hf_cache, monkeypatch):
    # fetched by its commit: huggingface_hub writes no refs/main, and the one snapshot is the answer
    snapshot = resolve_hub_checkpoint(REPO, revision=commit_of(REPO))
    assert not (hf_cache / "models--testorg--tiny-llama" / "refs" / "main").exists()
    hub.stop()
    set_offline(monkeypatch, True)
    assert resolve_hub_checkpoint(REPO) == snapshot
