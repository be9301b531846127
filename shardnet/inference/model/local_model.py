"""What a client holds of a model: tokenizer, embeddings, final norm, LM head, identity."""

from __future__ import annotations

import json
from pathlib import Path

from shardnet.errors import ShardnetError
from shardnet.inference.model.block import Head, pick_device, resolve_dtype
from shardnet.inference.model.checkpoint import Checkpoint
from shardnet.inference.model.family_check import ensure_family_matches


class LocalModel:
    """What a client holds of a model: tokenizer, embeddings, final norm, LM head, identity."""

    def __init__(self, path: str | Path, *, dtype: str = "auto", device: str | None = None,
                 lm_head: bool = True) -> None:
        from tokenizers import Tokenizer

        self.ckpt = Checkpoint(path)
        self.model_id = self.ckpt.model_id
        self.device = pick_device(device)
        self.dtype = resolve_dtype(dtype, self.ckpt, self.device)
        ensure_family_matches(self.ckpt, dtype=self.dtype)
        self.head = Head(self.ckpt, dtype=self.dtype, device=self.device, lm_head=lm_head)
        tok_file = self.ckpt.path / "tokenizer.json"
        if not tok_file.is_file():
            raise ShardnetError(f"{self.ckpt.path} has no tokenizer.json")
        self.tokenizer = Tokenizer.from_file(str(tok_file))
        self.eos_ids = self._eos_ids()

    def _eos_ids(self) -> set[int]:
        ids = set()
        eos = self.ckpt.raw_config.get("eos_token_id")
        for v in eos if isinstance(eos, list) else [eos]:
            if isinstance(v, int):
                ids.add(v)
        tc = self.ckpt.path / "tokenizer_config.json"
        if tc.is_file():
            tok = json.loads(tc.read_text()).get("eos_token")
            if isinstance(tok, str) and self.tokenizer.token_to_id(tok) is not None:
                ids.add(self.tokenizer.token_to_id(tok))
        return ids

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)
