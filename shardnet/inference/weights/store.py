"""A model directory the swarm fills: only the tensors this node needs, verified, in a layout
anyone can read (``~/.cache/shardnet/models/<model ID>/``, or ``$SHARDNET_CACHE``).

    shardnet-manifest.cbor        the manifest (its SHA-256 is the directory's name, the model ID)
    shardnet-fetched.json         the names the model was fetched by
    config.json, tokenizer.json…  the model's files, each checked against the manifest
    model-embed.safetensors       the embedding;  model-norm / model-lm_head likewise
    model-layer-00012.safetensors one file per decoder layer
    model.safetensors.index.json  which tensor is in which file (only those fetched)
    shardnet-hashes/              the chunk hashes of what is here (to serve it on to others)
    .partial/                     groups being fetched: a safetensors file with its final layout
                                  whose chunks are written as they arrive verified, plus one
                                  byte per chunk saying which are in

A group (a layer, a part of the head) moves out of ``.partial/`` with an atomic rename once every
chunk is in, and only then is it named in the index: what transformers, safetensors or shardnet
load from is complete and verified; a fetch that dies leaves ``.partial/`` to resume from.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import struct
from collections.abc import AsyncIterator
from pathlib import Path

import cbor2
import trio

from shardnet.errors import CheckpointError
from shardnet.inference.model.checkpoint import (
    FETCHED_GGUF_HEADER,
    FETCHED_HASHES,
    FETCHED_INFO,
    FETCHED_MANIFEST,
    LAYER_RE,
    hashes_file_name,
    check_manifest,
    model_id_of,
    read_fetched_hashes,
)
from shardnet.protocols.weights import chunk_count, chunk_span

log = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"
PARTIAL = ".partial"


def default_cache_root() -> Path:
    env = os.environ.get("SHARDNET_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(base).expanduser() / "shardnet" / "models"


def group_of(tensor: str) -> str:
    """The file a tensor is kept in: its layer's, or its part of the head's."""
    m = LAYER_RE.match(tensor)
    if m:
        return f"layer-{int(m[1]):05d}"
    for part, prefix in (("embed", "model.embed_tokens."), ("norm", "model.norm."), ("lm_head", "lm_head.")):
        if tensor.startswith(prefix):
            return part
    return "other"


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class WeightStore:
    """One model's directory in the cache."""

    def __init__(self, model_id: str, root: Path | None = None, *, path: Path | None = None) -> None:
        """The store of ``model_id`` under ``root`` (the cache), or at ``path`` (a directory the
        swarm filled, wherever the user has moved it)."""
        self.model_id = model_id
        self.path = path or (root or default_cache_root()) / model_id
        self.path.mkdir(parents=True, exist_ok=True)

    @contextlib.asynccontextmanager
    async def locked(self) -> AsyncIterator[None]:
        """Hold the directory against other processes filling it (waits while one does)."""
        with open(self.path / ".lock", "a") as fh:
            said = False
            while True:
                try:
                    fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if not said:
                        log.info("another shardnet process is filling %s; waiting for it", self.path)
                        said = True
                    await trio.sleep(0.5)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    # -- manifest, names and files -------------------------------------------------------------
    @property
    def manifest_file(self) -> Path:
        return self.path / FETCHED_MANIFEST

    def has_manifest(self) -> bool:
        return self.manifest_file.is_file()

    def manifest(self) -> dict:
        return cbor2.loads(self.manifest_file.read_bytes())

    def put_manifest(self, raw: bytes) -> dict:
        """Keep the manifest, once its hash is the model ID (else CheckpointError)."""
        if hashlib.sha256(raw).hexdigest() != self.model_id:
            raise CheckpointError(f"the manifest received does not hash to model {self.model_id[:16]}…")
        manifest = cbor2.loads(raw)
        check_manifest(manifest)
        if model_id_of(manifest) != self.model_id:  # not canonical CBOR: it would not hash the same re-encoded
            raise CheckpointError(f"the manifest of model {self.model_id[:16]}… is not in canonical form")
        _write_atomically(self.manifest_file, raw)
        return manifest

    def add_names(self, names: list[str]) -> None:
        info_file = self.path / FETCHED_INFO
        try:
            info = json.loads(info_file.read_text())
        except (OSError, json.JSONDecodeError):
            info = {}
        known = [n for n in info.get("names", []) if isinstance(n, str)] if isinstance(info, dict) else []
        _write_atomically(info_file, json.dumps({"model_id": self.model_id,
                                                 "names": list(dict.fromkeys(known + names))}, indent=1).encode())

    def has_file(self, name: str) -> bool:
        return (self.path / name).is_file()

    def put_file(self, name: str, data: bytes, hashes: bytes, blob: str | None = None) -> None:
        """A model file whose bytes were checked against the manifest (``blob``: its name there,
        ``file:NAME`` unless given)."""
        _write_atomically(self.path / name, data)
        self.put_hashes(blob or f"file:{name}", hashes)

    def missing_files(self, manifest: dict) -> list[str]:
        """The model's files not here yet (a GGUF checkpoint's header among them)."""
        out = [f for f in manifest.get("files", {}) if not self.has_file(f)]
        if "gguf" in manifest and not self.has_file(FETCHED_GGUF_HEADER):
            out.append(FETCHED_GGUF_HEADER)
        return out

    def put_hashes(self, blob: str, hashes: bytes) -> None:
        d = self.path / FETCHED_HASHES
        d.mkdir(exist_ok=True)
        _write_atomically(d / hashes_file_name(blob), hashes)

    def hashes(self, blob: str) -> bytes | None:
        return read_fetched_hashes(self.path, blob)

    # -- tensors ---------------------------------------------------------------------------------
    def weight_map(self) -> dict[str, str]:
        try:
            return json.loads((self.path / INDEX).read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError):
            return {}

    def missing(self, tensors: list[str]) -> list[str]:
        held = self.weight_map()
        return [t for t in tensors if t not in held]

    def group_writer(self, group: str, tensors: dict[str, list]) -> GroupWriter:
        """The staging file of ``group`` (created, or reopened to resume). ``tensors``: name ->
        the manifest's [dtype, shape, size, root]."""
        return GroupWriter(self, group, tensors)

    def finish_group(self, writer: GroupWriter) -> None:
        """Move a complete group where models are loaded from, then name it in the index."""
        final = self.path / f"model-{writer.group}.safetensors"
        os.fsync(writer.fd)
        writer.close()
        os.replace(writer.data_path, final)
        weight_map = self.weight_map()
        for name in writer.names:
            weight_map[name] = final.name
        _write_atomically(self.path / INDEX, json.dumps({"metadata": {"shardnet_model_id": self.model_id},
                                                        "weight_map": dict(sorted(weight_map.items()))},
                                                       indent=1).encode())
        writer.bitmap_path.unlink(missing_ok=True)


class GroupWriter:
    """A group's safetensors file, laid out in full before its first chunk arrives; chunks are
    written at their offsets (each one verified by the caller first), and a byte per chunk in a
    side file says which are in, written after the chunk's bytes."""

    def __init__(self, store: WeightStore, group: str, tensors: dict[str, list]) -> None:
        self.group = group
        self.names = sorted(tensors)
        header, offset = {}, 0
        self.data_offset: dict[str, int] = {}
        self.first_chunk: dict[str, int] = {}
        chunks = 0
        for name in self.names:
            dtype, shape, size, _root = tensors[name]
            header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
            self.data_offset[name] = offset
            self.first_chunk[name] = chunks
            offset += size
            chunks += chunk_count(size)
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # safetensors aligns the data to 8 bytes
        self.base = 8 + len(raw)
        self.sizes = {n: tensors[n][2] for n in self.names}
        partial = store.path / PARTIAL
        partial.mkdir(exist_ok=True)
        self.data_path = partial / f"model-{group}.safetensors"
        self.bitmap_path = partial / f"model-{group}.chunks"
        prologue = struct.pack("<Q", len(raw)) + raw
        resumable = self.data_path.is_file() and self.bitmap_path.is_file() and \
            self.bitmap_path.stat().st_size == chunks and self.data_path.stat().st_size == self.base + offset
        if resumable:
            with open(self.data_path, "rb") as fh:
                resumable = fh.read(len(prologue)) == prologue
        if not resumable:
            with open(self.data_path, "wb") as fh:
                fh.write(prologue)
                fh.truncate(self.base + offset)
            self.bitmap_path.write_bytes(bytes(chunks))
        self.fd = os.open(self.data_path, os.O_RDWR)
        self.bitmap_fd = os.open(self.bitmap_path, os.O_RDWR)
        self.bitmap = bytearray(os.pread(self.bitmap_fd, chunks, 0))

    def _slot(self, name: str, index: int) -> tuple[int, int, int]:
        start, end = chunk_span(self.sizes[name], index)
        return self.first_chunk[name] + index, self.base + self.data_offset[name] + start, end - start

    def has(self, name: str, index: int) -> bool:
        return bool(self.bitmap[self._slot(name, index)[0]])

    def read(self, name: str, index: int) -> bytes:
        _, offset, length = self._slot(name, index)
        return os.pread(self.fd, length, offset)

    def forget(self, name: str, index: int) -> None:
        """A chunk marked in but not intact after all (a crash tore its write): fetch it again."""
        bit, _, _ = self._slot(name, index)
        self.bitmap[bit] = 0
        os.pwrite(self.bitmap_fd, b"\0", bit)

    def write(self, name: str, index: int, data: bytes) -> None:
        bit, offset, length = self._slot(name, index)
        assert len(data) == length
        os.pwrite(self.fd, data, offset)
        self.bitmap[bit] = 1
        os.pwrite(self.bitmap_fd, b"\1", bit)

    def complete(self) -> bool:
        return all(self.bitmap)

    def close(self) -> None:
        for fd in (self.fd, self.bitmap_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fd = self.bitmap_fd = -1
