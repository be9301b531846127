"""A checkpoint's copy with its tensors converted (the stored-format writers of
``shardnet model init-random --format`` and the tests' dequantized references): same files,
shards and tokenizer, each tensor replaced by what ``convert`` makes of it, the index and the
config rewritten."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

#: ``convert(name, tensor, tensors of its file) -> {name: tensor}``: what the copy stores for it
#: (several tensors, say a packed weight and its scales; none, for a companion already written)
Convert = Callable[[str, torch.Tensor, dict[str, torch.Tensor]], dict[str, torch.Tensor]]


def copy_side_files(src: Path, dst: Path) -> None:
    """Tokenizer and generation files; not the weights, the index or the config (rewritten), nor
    shardnet's dot-file caches (keyed on the source's files)."""
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and not f.name.startswith(".") \
                and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, dst / f.name)


def rewrite_checkpoint(src: str | Path, dst: str | Path, convert: Convert, config: dict) -> Path:
    """``src``'s copy at ``dst`` with every tensor through ``convert`` and ``config`` as its
    config.json; returns ``dst``."""
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    copy_side_files(src, dst)
    weight_map = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors = load_file(str(f))
        out = {}
        for name, t in tensors.items():
            out.update(convert(name, t, tensors))
        save_file({k: v.contiguous() for k, v in out.items()}, str(dst / f.name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(out, f.name))
    if (src / "model.safetensors.index.json").is_file():
        index = json.loads((src / "model.safetensors.index.json").read_text())
        index["weight_map"] = dict(sorted(weight_map.items()))
        (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst
