"""A Hugging Face checkpoint in a local directory, read selectively.

A compute peer never materializes the whole model: it asks for the tensors of its layers and
``safe_open`` reads just those. The manifest (the model's identity) hashes each tensor's raw
bytes straight from the file, streaming, so computing it costs I/O, not memory.
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

log = logging.getLogger(__name__)

MANIFEST_VERSION = 1
MANIFEST_CACHE = ".shardnet-manifest.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt")
LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class TensorEntry:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int


class Checkpoint:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser().resolve()
        cfg_file = self.path / "config.json"
        if not cfg_file.is_file():
            raise CheckpointError(f"{self.path} has no config.json")
        try:
            self.raw_config = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{cfg_file} is not valid JSON: {e}") from None
        self.family: Family = family_for(self.raw_config)
        self.model_type = self.family.model_type
        self.entries = self._index()
        if not any(LAYER_RE.match(n) for n in self.entries):
            raise CheckpointError(f"model_type {self.model_type!r} is not supported: its weights have no "
                                  "model.layers.N decoder stack")
        n = self.raw_config.get("num_hidden_layers")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise CheckpointError(f"{cfg_file}: num_hidden_layers must be a positive integer, not {n!r}")
        self.num_layers = n
        self.fp8_block_size = _fp8_block_size(self.raw_config)
        self._config = None
        self._manifest: dict | None = None

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
                self._config = AutoConfig.from_pretrained(str(self.path), local_files_only=True)
            except (ValueError, TypeError, KeyError, OSError, StrictDataclassError) as e:
                text = " ".join(str(e).split())[:300]
                raise CheckpointError(f"{self.path.name}/config.json: transformers refuses it: {text}") from None
        return self._config

    def _index(self) -> dict[str, TensorEntry]:
        index_file = self.path / "model.safetensors.index.json"
        if index_file.is_file():
            weight_map = json.loads(index_file.read_text())["weight_map"]
            files = sorted({self.path / f for f in weight_map.values()})
        else:
            files = sorted(self.path.glob("*.safetensors"))
        if not files:
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
        return sorted(n for n in self.entries if n.startswith(prefix))

    def head_tensors(self) -> dict[str, str | None]:
        """Names of the embedding, final norm and LM head weights (None when tied to the embedding)."""
        lm = "lm_head.weight" if "lm_head.weight" in self.entries else None
        return {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "lm_head": lm}

    def head_parts(self) -> dict[str, list[str]]:
        """Every tensor of the embedding, the final norm and the LM head (biases included; an
        empty LM head when it is tied to the embedding)."""
        prefixes = {"embed": "model.embed_tokens.", "norm": "model.norm.", "lm_head": "lm_head."}
        return {part: sorted(n for n in self.entries if n.startswith(p)) for part, p in prefixes.items()}

    def load(self, names: list[str], dtype: Any = None, device: str = "cpu") -> dict:
        """Load exactly ``names`` (torch tensors), nothing else."""
        from safetensors import safe_open

        by_file: dict[Path, list[str]] = {}
        for n in names:
            if n not in self.entries:
                raise CheckpointError(f"tensor {n} is not in {self.path}")
            by_file.setdefault(self.entries[n].file, []).append(n)
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
        for name in self.entries:
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
            if head[part] not in self.entries:
                raise CheckpointError(f"{self.path.name} has no {head[part]} tensor")
        hidden = self.raw_config.get("hidden_size")
        shape = self.entries[head["embed"]].shape
        if hidden is not None and (len(shape) != 2 or shape[1] != hidden):
            raise CheckpointError(f"{self.path.name}/config.json says hidden_size = {hidden} but "
                                  f"{head['embed']} has shape {list(shape)}")

    def manifest(self) -> dict:
        """Content hashes of config, tokenizer files and every layer's tensors (cached on disk).
        Checks first that the config agrees with the tensors (``check_structure``)."""
        if self._manifest is None:
            self.check_structure()
            self._manifest = self._load_cached_manifest() or self._compute_manifest()
        return self._manifest

    @property
    def model_id(self) -> str:
        return model_id_of(self.manifest())

    def _fingerprint(self) -> list:
        """What the manifest cache is keyed on, per file: besides name, size and mtime (which an
        in-place edit can keep: ``os.utime``, ``cp -p``, ``rsync -t``), the inode and the ctime,
        which every write and every utime moves and no user call can set back. A copied or
        restored directory hashes again, once."""
        files = sorted({e.file for e in self.entries.values()} | {self.path / "config.json"}
                       | {self.path / t for t in TOKENIZER_FILES if (self.path / t).exists()})
        out = []
        for f in files:
            st = f.stat()
            out.append([f.name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev])
        return out

    def _load_cached_manifest(self) -> dict | None:
        try:
            cached = json.loads((self.path / MANIFEST_CACHE).read_text())
        except (OSError, json.JSONDecodeError):
            return None
        if cached.get("fingerprint") != self._fingerprint():
            return None
        return cached.get("manifest")

    def _compute_manifest(self) -> dict:
        log.info("hashing %s for its manifest (once; cached in %s)", self.path, MANIFEST_CACHE)
        tensors_hash = {}
        for name in sorted(self.entries):
            tensors_hash[name] = _hash_tensor(self.entries[name])

        def group(names: list[str]) -> str:
            h = hashlib.sha256()
            for n in sorted(names):
                h.update(n.encode() + b"\0" + bytes.fromhex(tensors_hash[n]))
            return h.hexdigest()

        head = self.head_parts()
        manifest = {
            "version": MANIFEST_VERSION,
            "model_type": self.model_type,
            "num_layers": self.num_layers,
            "config": hashlib.sha256(_canonical_json(self.raw_config)).hexdigest(),
            "tokenizer": {t: hashlib.sha256((self.path / t).read_bytes()).hexdigest()
                          for t in TOKENIZER_FILES if (self.path / t).exists()},
            "layers": [group(self.layer_tensors(i)) for i in range(self.num_layers)],
            "embed": group(head["embed"]),
            "norm": group(head["norm"]),
            "lm_head": group(head["lm_head"]) if head["lm_head"] else "tied",
        }
        try:
            (self.path / MANIFEST_CACHE).write_text(
                json.dumps({"fingerprint": self._fingerprint(), "manifest": manifest}, indent=1))
        except OSError:
            pass  # read-only model directory: recompute next time
        return manifest


def _fp8_block_size(raw_config: dict) -> tuple[int, int] | None:
    """The block size of an FP8 block-scaled checkpoint; None when it is not quantized; a
    one-line refusal for any other stored quantization."""
    q = raw_config.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method") if isinstance(q, dict) else None
    block = q.get("weight_block_size") if isinstance(q, dict) else None
    if method == "fp8" and isinstance(block, list) and len(block) == 2 and all(
            isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block):
        return block[0], block[1]
    raise CheckpointError(f"stored quantization {method!r} is not supported (supported: fp8 with "
                          "weight_block_size, as DeepSeek-V3 and Qwen3-FP8 ship)")


def model_id_of(manifest: dict) -> str:
    """The model ID every protocol message carries: a hash of the whole manifest."""
    return hashlib.sha256(cbor2.dumps(manifest, canonical=True)).hexdigest()


def _canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


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


def _hash_tensor(e: TensorEntry) -> str:
    h = hashlib.sha256(f"{e.dtype}:{list(e.shape)}:".encode())
    with open(e.file, "rb") as fh:
        fh.seek(e.start)
        left = e.end - e.start
        while left:
            chunk = fh.read(min(left, 1 << 22))
            if not chunk:
                raise CheckpointError(f"{e.file} ends inside a tensor")
            h.update(chunk)
            left -= len(chunk)
    return h.hexdigest()
