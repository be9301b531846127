"""A Hugging Face checkpoint in a local directory, read selectively.

A compute peer never materializes the whole model: it asks for the tensors of its layers and
``safe_open`` reads just those. The manifest (the model's identity) names every file and tensor
the model is made of with its size and a root over its 1 MiB chunks' hashes (protocols/weights.py),
hashing each tensor's raw bytes straight from the file, streaming: computing it costs I/O, not
memory. The model ID is the hash of the manifest.

Two kinds of directory are checkpoints: a complete one (as Hugging Face ships it), and one the
swarm filled (weights/store.py): it holds the manifest it was fetched by (``shardnet-manifest.cbor``,
whose hash is the model ID) and only the tensors fetched so far. Both answer the same questions
about the whole model (``catalog``: every tensor's dtype and shape; layers; the head's parts);
only ``load`` needs the tensors to be here.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cbor2

from shardnet.errors import CheckpointError
from shardnet.inference.model.families import Family, family_for
from shardnet.inference.model.formats import stored_quant
from shardnet.protocols.weights import CHUNK_SIZE, blob_root, chunk_hash

log = logging.getLogger(__name__)

MANIFEST_VERSION = 2
#: where a complete checkpoint's manifest and its blobs' chunk hashes are cached (keyed on the files)
MANIFEST_CACHE = ".shardnet-manifest.cbor"
#: the manifest a swarm-filled directory was fetched by (its hash is the model ID)
FETCHED_MANIFEST = "shardnet-manifest.cbor"
#: chunk hashes of the blobs a swarm-filled directory holds (to serve them on)
FETCHED_HASHES = "shardnet-hashes"
FETCHED_INFO = "shardnet-fetched.json"
#: the header of the GGUF file a swarm-filled GGUF checkpoint was fetched from (its config)
FETCHED_GGUF_HEADER = "shardnet-gguf-header"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt")
#: the files besides tensors that a model is made of (those present are in its manifest)
MODEL_FILES = ("config.json", "generation_config.json", "chat_template.jinja", *TOKENIZER_FILES)
LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
HF_SNAPSHOT_RE = re.compile(r"^models--(.+)$")


@dataclass(frozen=True)
class TensorEntry:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class TensorInfo:
    """What the manifest says of a tensor, whether or not it is stored here."""

    dtype: str
    shape: tuple[int, ...]
    size: int


def find_gguf(path: Path) -> Path | None:
    """The .gguf file a checkpoint path names: the file itself, or the one .gguf in a directory
    that has no config.json; None for a safetensors checkpoint."""
    if path.is_file() and path.suffix == ".gguf":
        return path
    if not path.is_dir() or (path / "config.json").exists():
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        raise CheckpointError(f"{path} holds {len(found)} .gguf files ({found[0].name}, {found[1].name}...); "
                              "name one of them")
    return found[0] if found else None


class Checkpoint:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser().resolve()
        self._manifest: dict | None = None
        self._manifest_bytes: bytes | None = None
        #: filled by the swarm (holds a fetched manifest and what was fetched so far)
        self.fetched = self.path.is_dir() and (self.path / FETCHED_MANIFEST).is_file()
        if self.fetched:
            self._open_fetched_manifest()
        #: a GGUF checkpoint (gguf.py): its config and tensors are read from this one file (a
        #: directory the swarm filled holds its header, and safetensors groups of its tensors)
        self.gguf_file = None if self.fetched else find_gguf(self.path)
        self._gguf = None
        #: (the header's name in the manifest, the file holding it from byte 0, its size)
        self._gguf_header: tuple[str, Path, int] | None = None
        if self.gguf_file is not None:
            from shardnet.inference.model.gguf import read_gguf  # (torch: imported where a GGUF is read)

            self.path = self.gguf_file.parent
            self._gguf = read_gguf(self.gguf_file, TensorEntry)
            self._gguf_header = (self.gguf_file.name, self.gguf_file, self._gguf.header_size)
        elif self.fetched and "gguf" in self._manifest:
            name, size, _root = self._manifest["gguf"]
            header = self.path / FETCHED_GGUF_HEADER
            if not header.is_file():
                raise CheckpointError(f"{self.path} has not fetched the header of {name} yet")
            from shardnet.inference.model.gguf import read_gguf_header

            self._gguf = read_gguf_header(header, self._manifest, TensorEntry)
            self._gguf_header = (name, header, size)
        if self._gguf is not None:
            self.raw_config = self._gguf.raw_config
            cfg_file = self._gguf_header[1]
        else:
            cfg_file = self.path / "config.json"
            if not cfg_file.is_file():
                raise CheckpointError(f"{self.path} has no config.json (nor a .gguf file)")
            try:
                self.raw_config = json.loads(cfg_file.read_text())
            except json.JSONDecodeError as e:
                raise CheckpointError(f"{cfg_file} is not valid JSON: {e}") from None
        self.family: Family = family_for(self.raw_config)
        self.model_type = self.family.model_type
        self._hashes: dict[str, bytes] = {}
        if self.fetched:
            self.entries = self._index(allow_none=True)
            self.catalog = {n: TensorInfo(d, tuple(shape), size)
                            for n, (d, shape, size, _root) in self._manifest["tensors"].items()}
        else:
            self.entries = self._index()
            self.catalog = {n: TensorInfo(e.dtype, e.shape, e.size) for n, e in self.entries.items()}
        if not any(LAYER_RE.match(n) for n in self.catalog):
            raise CheckpointError(f"model_type {self.model_type!r} is not supported: its weights have no "
                                  "model.layers.N decoder stack")
        n = self.raw_config.get("num_hidden_layers")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise CheckpointError(f"{cfg_file}: num_hidden_layers must be a positive integer, not {n!r}")
        self.num_layers = n
        #: the stored (low-bit) format, None when not quantized (formats.py)
        self.quant = stored_quant(self.raw_config)
        self._config = None
        if self.fetched:
            self.check_structure()  # its manifest was checked against the model ID, not against its config

    def _open_fetched_manifest(self) -> None:
        raw = (self.path / FETCHED_MANIFEST).read_bytes()
        try:
            manifest = cbor2.loads(raw)
        except Exception:
            raise CheckpointError(f"{self.path / FETCHED_MANIFEST} is not a manifest") from None
        check_manifest(manifest)
        self._manifest, self._manifest_bytes = manifest, raw

    @property
    def names(self) -> list[str]:
        """What people call this model: the Hugging Face repo of a hub-cache snapshot, the
        config's ``_name_or_path`` when it is a repo name, the directory's name; for a directory the
        swarm filled, the names it was fetched by."""
        if self.fetched:
            try:
                info = json.loads((self.path / FETCHED_INFO).read_text())
                return [n for n in info.get("names", []) if isinstance(n, str)]
            except (OSError, json.JSONDecodeError, AttributeError):
                return []
        out = []
        snapshot = self.path.parent.name == "snapshots" and HF_SNAPSHOT_RE.match(self.path.parent.parent.name)
        if snapshot:
            out.append(snapshot[1].replace("--", "/"))  # the directory itself is named by a commit
        given = self.raw_config.get("_name_or_path")
        if isinstance(given, str) and given and not given.startswith(("/", ".", "~")) and given.count("/") <= 1:
            out.append(given)
        if not snapshot:
            out.append(self.path.name)
        return list(dict.fromkeys(out))

    @property
    def total_bytes(self) -> int:
        return sum(t.size for t in self.catalog.values())

    @property
    def stored_dtype(self) -> str:
        """The dtype the checkpoint stores its weights in, as its config says (transformers'
        default load uses it); float32 when the config names none."""
        name = self.raw_config.get("dtype") or self.raw_config.get("torch_dtype") or "float32"
        if name not in ("float32", "bfloat16", "float16"):
            raise CheckpointError(f"{self.path.name}/config.json says dtype {name!r}; "
                                  "choose --dtype float32, bfloat16 or float16")
        return name

    # -- structure ---------------------------------------------------------------------------
    @property
    def config(self):
        """The transformers config object (read from the local directory only)."""
        if self._config is None:
            from huggingface_hub.errors import StrictDataclassError
            from transformers import AutoConfig

            try:
                if self._gguf is not None:  # its metadata as transformers' GGUF load reads it
                    self._config = AutoConfig.for_model(**self.raw_config)
                else:
                    self._config = AutoConfig.from_pretrained(str(self.path), local_files_only=True)
            except (ValueError, TypeError, KeyError, OSError, StrictDataclassError) as e:
                text = " ".join(str(e).split())[:300]
                raise CheckpointError(f"{self.path.name}/config.json: transformers refuses it: {text}") from None
        return self._config

    def _index(self, allow_none: bool = False) -> dict[str, TensorEntry]:
        if self._gguf is not None and not self.fetched:
            return {n: e for n, (_, e) in self._gguf.tensors.items()}
        index_file = self.path / "model.safetensors.index.json"
        if index_file.is_file():
            weight_map = json.loads(index_file.read_text())["weight_map"]
            files = sorted({self.path / f for f in weight_map.values()})
        else:
            files = sorted(self.path.glob("*.safetensors"))
        if not files and not allow_none:
            raise CheckpointError(f"{self.path} has no *.safetensors files")
        entries: dict[str, TensorEntry] = {}
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{f} is listed in the index but missing")
            for name, e in _read_safetensors_header(f).items():
                entries[name] = e
        return entries

    def layer_tensors(self, layer: int) -> list[str]:
        prefix = f"model.layers.{layer}."
        return sorted(n for n in self.catalog if n.startswith(prefix))

    def head_tensors(self) -> dict[str, str | None]:
        """Names of the embedding, final norm and LM head weights (None when tied to the embedding)."""
        lm = "lm_head.weight" if "lm_head.weight" in self.catalog else None
        return {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "lm_head": lm}

    def head_parts(self) -> dict[str, list[str]]:
        """Every tensor of the embedding, the final norm and the LM head (biases included; an
        empty LM head when it is tied to the embedding)."""
        prefixes = {"embed": "model.embed_tokens.", "norm": "model.norm.", "lm_head": "lm_head."}
        return {part: sorted(n for n in self.catalog if n.startswith(p)) for part, p in prefixes.items()}

    def other_tensors(self) -> list[str]:
        """Tensors of neither a layer nor the head (a few checkpoints store e.g. rotary tables)."""
        head = {n for part in self.head_parts().values() for n in part}
        return sorted(n for n in self.catalog if not LAYER_RE.match(n) and n not in head)

    def refresh(self) -> None:
        """Look at the tensors stored here again (a swarm-filled directory gained some)."""
        self.entries = self._index(allow_none=self.fetched)

    def holds(self, names: list[str]) -> bool:
        """Whether every one of ``names`` is stored here (a swarm-filled directory may lack some)."""
        return all(n in self.entries for n in names)

    def load(self, names: list[str], dtype: Any = None, device: str = "cpu") -> dict:
        """Load exactly ``names`` (torch tensors), nothing else."""
        from safetensors import safe_open

        by_file: dict[Path, list[str]] = {}
        for n in names:
            if n not in self.entries:
                if n in self.catalog:
                    raise CheckpointError(f"tensor {n} has not been fetched to {self.path}")
                raise CheckpointError(f"tensor {n} is not in {self.path}")
            by_file.setdefault(self.entries[n].file, []).append(n)
        if self._gguf is not None:
            from shardnet.inference.model.gguf import read_tensors as read_gguf_tensors

            out = read_gguf_tensors(self._gguf, self.entries, names, device)
            return {n: t.to(dtype) for n, t in out.items()} if dtype is not None else out
        out = {}
        for f, ns in by_file.items():
            with safe_open(str(f), framework="pt", device=device) as st:
                for n in ns:
                    t = st.get_tensor(n)
                    out[n] = t.to(dtype) if dtype is not None else t
        return out

    # -- identity ----------------------------------------------------------------------------
    def check_structure(self) -> None:
        """The config agrees with the tensors: layers 0..num_hidden_layers-1 all present with the
        same tensor names, none beyond, the embedding and final norm there, hidden_size matching
        the embedding. Reads only the headers; raises CheckpointError with a one-line reason."""
        per_layer: dict[int, set[str]] = {}
        for name in self.catalog:
            m = LAYER_RE.match(name)
            if m:
                per_layer.setdefault(int(m[1]), set()).add(name[m.end():])
        # DeepSeek-V3/R1 and GLM-4.5 store their multi-token-prediction layers after the stack
        # (model.layers.61 in DeepSeek-V3); transformers does not load them, and neither does a block
        mtp = self.raw_config.get("num_nextn_predict_layers") or 0
        mtp = mtp if isinstance(mtp, int) and not isinstance(mtp, bool) and mtp > 0 else 0
        for i in range(self.num_layers, self.num_layers + mtp):
            per_layer.pop(i, None)
        found = sorted(per_layer)
        where = f"{self.path.name}/config.json says num_hidden_layers = {self.num_layers}"
        if found != list(range(self.num_layers)):
            have = f"layers {found[0]}-{found[-1]}" if found else "no layers"
            missing = sorted(set(range(self.num_layers)) - set(found))
            extra = [i for i in found if i >= self.num_layers]
            detail = (f"; missing {len(missing)} (first: {missing[0]})" if missing else "") + \
                     (f"; {len(extra)} beyond it" if extra else "")
            raise CheckpointError(f"{where} but the weights hold {have}{detail}")
        # dense and mixture-of-experts layers may alternate (dense first layers, sparse steps):
        # each layer must hold what the first layer of its kind holds
        first_of_kind: dict[bool, int] = {}
        for i in found:
            like = first_of_kind.setdefault(any(".experts." in n for n in per_layer[i]), i)
            if per_layer[i] != per_layer[like]:
                diff = sorted(per_layer[like] ^ per_layer[i])
                raise CheckpointError(f"layer {i} of {self.path.name} does not have the tensors layer {like} has "
                                      f"(differs in {', '.join(diff[:3])}{', ...' if len(diff) > 3 else ''})")
        head = self.head_tensors()
        for part in ("embed", "norm"):
            if head[part] not in self.catalog:
                raise CheckpointError(f"{self.path.name} has no {head[part]} tensor")
        hidden = self.raw_config.get("hidden_size")
        shape = self.catalog[head["embed"]].shape
        if hidden is not None and (len(shape) != 2 or shape[1] != hidden):
            raise CheckpointError(f"{self.path.name}/config.json says hidden_size = {hidden} but "
                                  f"{head['embed']} has shape {list(shape)}")

    def manifest(self) -> dict:
        """Every file and tensor of the model with its size and chunk root (cached on disk).
        Checks first that the config agrees with the tensors (``check_structure``)."""
        if self._manifest is None:
            self.check_structure()
            if not self._load_cached_manifest():
                self._compute_manifest()
        return self._manifest

    def manifest_bytes(self) -> bytes:
        """The manifest as the model ID hashes it (canonical CBOR): what peers serve and fetch."""
        self.manifest()
        return self._manifest_bytes

    @property
    def model_id(self) -> str:
        return model_id_of(self.manifest())

    # -- blobs, as the weights protocol serves them ----------------------------------------------
    def blob_location(self, blob: str) -> tuple[Path, int, int] | None:
        """(file, start, end) of a blob (``file:NAME``, ``tensor:NAME``, ``gguf:NAME``: a GGUF
        file's header) stored here, or None."""
        kind, _, name = blob.partition(":")
        if kind == "tensor" and name in self.entries:
            e = self.entries[name]
            return e.file, e.start, e.end
        if kind == "gguf" and self._gguf_header is not None and name == self._gguf_header[0]:
            return self._gguf_header[1], 0, self._gguf_header[2]
        if kind == "file" and name in self.manifest()["files"]:
            f = self.path / name
            if f.is_file():
                return f, 0, f.stat().st_size
        return None

    def blob_hashes(self, blob: str) -> bytes | None:
        """The chunk hashes of a blob stored here (what its manifest root is computed from)."""
        self.manifest()
        if blob in self._hashes:
            return self._hashes[blob]
        return read_fetched_hashes(self.path, blob) if self.fetched else None

    def held_prefixes(self) -> list[str]:
        """The blobs this directory can serve, as blob-name prefixes (``""``: all of them)."""
        if not self.fetched:
            return [""]
        out = ["file:", "gguf:"] if self._gguf_header is not None else ["file:"]
        for name in self.entries:
            m = LAYER_RE.match(name)
            out.append(f"tensor:{m[0]}" if m else f"tensor:{name}")
        return list(dict.fromkeys(out))

    def _fingerprint(self) -> list:
        """What the manifest cache is keyed on, per file: besides name, size and mtime (which an
        in-place edit can keep: ``os.utime``, ``cp -p``, ``rsync -t``), the inode and the ctime,
        which every write and every utime moves and no user call can set back. A copied or
        restored directory hashes again, once."""
        files = sorted({e.file for e in self.entries.values()}
                       | {self.path / t for t in MODEL_FILES if (self.path / t).exists()})
        out = []
        for f in files:
            st = f.stat()
            out.append([f.name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev])
        return out

    def _load_cached_manifest(self) -> bool:
        try:
            cached = cbor2.loads((self.path / MANIFEST_CACHE).read_bytes())
            raw, hashes = cached["manifest"], cached["hashes"]
            if cached.get("fingerprint") != self._fingerprint() or not isinstance(hashes, dict):
                return False
            manifest = cbor2.loads(raw)
            check_manifest(manifest)
        except (OSError, KeyError, TypeError, ValueError, CheckpointError, cbor2.CBORDecodeError):
            return False
        self._manifest, self._manifest_bytes, self._hashes = manifest, raw, hashes
        return True

    def _compute_manifest(self) -> None:
        log.info("hashing %s for its manifest (once; cached in %s)", self.path, MANIFEST_CACHE)
        files, tensors, hashes = {}, {}, {}
        for name in MODEL_FILES:
            f = self.path / name
            if f.is_file():
                size = f.stat().st_size
                hashes[f"file:{name}"] = _chunk_hashes(f, 0, size)
                files[name] = [size, blob_root(size, hashes[f"file:{name}"])]
        for name in sorted(self.entries):
            e = self.entries[name]
            h = _chunk_hashes(e.file, e.start, e.end)
            hashes[f"tensor:{name}"] = h
            tensors[name] = [e.dtype, list(e.shape), e.size, blob_root(e.size, h)]
        manifest = {"version": MANIFEST_VERSION, "model_type": self.model_type, "num_layers": self.num_layers,
                    "chunk_size": CHUNK_SIZE, "files": files, "tensors": tensors}
        if self._gguf_header is not None:
            # the config is the GGUF header (metadata and tensor infos): its bytes are the model's too
            name, f, size = self._gguf_header
            hashes[f"gguf:{name}"] = h = _chunk_hashes(f, 0, size)
            manifest["gguf"] = [name, size, blob_root(size, h)]
        raw = cbor2.dumps(manifest, canonical=True)
        self._manifest, self._manifest_bytes, self._hashes = manifest, raw, hashes
        try:
            (self.path / MANIFEST_CACHE).write_bytes(cbor2.dumps(
                {"fingerprint": self._fingerprint(), "manifest": raw, "hashes": hashes}))
        except OSError:
            pass  # read-only model directory: recompute next time


def check_manifest(manifest: Any) -> None:
    """A manifest has the shape this version writes (raise CheckpointError saying what is wrong)."""
    if not isinstance(manifest, dict) or manifest.get("version") != MANIFEST_VERSION:
        raise CheckpointError(f"manifest version {manifest.get('version') if isinstance(manifest, dict) else None!r} "
                              f"is not supported (this shardnet reads version {MANIFEST_VERSION})")
    files, tensors = manifest.get("files"), manifest.get("tensors")
    gguf = manifest.get("gguf")  # a GGUF checkpoint's header: its config (gguf.py)
    if manifest.get("chunk_size") != CHUNK_SIZE or not isinstance(files, dict) or not isinstance(tensors, dict) \
            or ("config.json" not in files and gguf is None):
        raise CheckpointError("manifest is malformed (chunk size, files or tensors)")
    if gguf is not None and not (isinstance(gguf, list) and len(gguf) == 3 and isinstance(gguf[0], str)
                                 and gguf[0].endswith(".gguf") and "/" not in gguf[0] and _nonneg_int(gguf[1])
                                 and isinstance(gguf[2], str) and len(gguf[2]) == 64):
        raise CheckpointError("manifest entry for the GGUF header is malformed")
    for name, v in files.items():
        if not (isinstance(name, str) and name in MODEL_FILES and isinstance(v, list) and len(v) == 2
                and _nonneg_int(v[0]) and isinstance(v[1], str) and len(v[1]) == 64):
            raise CheckpointError(f"manifest entry for file {name!r} is malformed")
    for name, v in tensors.items():
        if not (isinstance(name, str) and isinstance(v, list) and len(v) == 4 and isinstance(v[0], str)
                and isinstance(v[1], list) and all(_nonneg_int(d) for d in v[1]) and _nonneg_int(v[2])
                and isinstance(v[3], str) and len(v[3]) == 64):
            raise CheckpointError(f"manifest entry for tensor {name!r} is malformed")


def _nonneg_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def read_fetched_hashes(directory: Path, blob: str) -> bytes | None:
    """The chunk hashes a swarm-filled directory keeps for ``blob``, or None."""
    f = directory / FETCHED_HASHES / hashes_file_name(blob)
    return f.read_bytes() if f.is_file() else None


def hashes_file_name(blob: str) -> str:
    """A file name for a blob's chunk hashes (blob names may hold any character)."""
    return hashlib.sha256(blob.encode()).hexdigest()[:32] + ".sha256s"


def _chunk_hashes(f: Path, start: int, end: int) -> bytes:
    out = bytearray()
    with open(f, "rb") as fh:
        fh.seek(start)
        left = end - start
        while True:
            data = fh.read(min(left, CHUNK_SIZE))
            if len(data) != min(left, CHUNK_SIZE):
                raise CheckpointError(f"{f} ends inside a tensor")
            out += chunk_hash(data)
            left -= len(data)
            if not left:
                return bytes(out)


def model_id_of(manifest: dict) -> str:
    """The model ID every protocol message carries: a hash of the whole manifest."""
    return hashlib.sha256(cbor2.dumps(manifest, canonical=True)).hexdigest()


def _read_safetensors_header(f: Path) -> dict[str, TensorEntry]:
    with open(f, "rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{f} is not a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 << 20:
            raise CheckpointError(f"{f}: implausible safetensors header size {n}")
        try:
            header = json.loads(fh.read(n))
        except json.JSONDecodeError:
            raise CheckpointError(f"{f}: corrupt safetensors header") from None
    base = 8 + n
    size = os.path.getsize(f)
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        a, b = meta["data_offsets"]
        if not 0 <= a <= b or base + b > size:
            raise CheckpointError(f"{f}: tensor {name} lies outside the file")
        out[name] = TensorEntry(f, meta["dtype"], tuple(meta["shape"]), base + a, base + b)
    return out
