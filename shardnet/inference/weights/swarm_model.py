"""Opening a model the swarm serves: resolve a name or ID, fetch the manifest and the model's
files into the local cache, then the tensors a role needs (a span of layers; the head)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from shardnet.inference.model.checkpoint import Checkpoint
from shardnet.inference.weights.cards import MODEL_ID_RE, ModelCard, resolve_model
from shardnet.inference.weights.fetcher import (
    FetchError,
    FetchProgress,
    ProgressFn,
    Transfer,
    fetch_manifest,
    find_sources,
)
from shardnet.inference.weights.names import model_name
from shardnet.inference.weights.store import WeightStore
from shardnet.transport.node import Node

log = logging.getLogger(__name__)


async def open_from_swarm(node: Node, name_or_id: str, *, cache_root: Path | None = None,
                          progress: ProgressFn | None = None) -> tuple[Path, ModelCard]:
    """The local directory of the model the swarm serves as ``name_or_id`` (or ``NAME@ID-PREFIX``:
    cards.resolve_model), holding its manifest and files (config, tokenizer) and whatever
    tensors earlier fetches brought."""
    card = await resolve_model(node, name_or_id)
    store = WeightStore(card.model_id, cache_root)
    log.info("model %s is %s… (%s, %d layers, %.1f MB); cache %s", name_or_id, card.model_id[:16], card.family,
             card.num_layers, card.total_bytes / 1e6, store.path)
    async with store.locked():
        manifest = store.manifest() if store.has_manifest() else None
        files = store.missing_files(manifest or {})
        if manifest is None or files:
            sources = await find_sources(node, card.model_id)
            if not sources:
                raise FetchError(f"no peer serves the weights of model {name_or_id} ({card.model_id[:16]}…) now")
            if manifest is None:
                manifest = store.put_manifest(await fetch_manifest(node, card.model_id, sources))
                files = store.missing_files(manifest)
            transfer = Transfer(node, store, manifest, progress=progress)
            try:
                transfer.add_files(files)
                await transfer.run(sources)
            finally:
                transfer.close()
        store.add_names([*card.names, *([] if MODEL_ID_RE.match(name_or_id) else [model_name(name_or_id)])])
    return store.path, card


async def fetch_tensors(node: Node, ckpt: Checkpoint, names: list[str], *,
                        progress: ProgressFn | None = None) -> FetchProgress | None:
    """Make ``names`` local in a swarm-filled checkpoint (None when they already are)."""
    if not ckpt.fetched:
        return None
    store = WeightStore(ckpt.model_id, path=ckpt.path)
    async with store.locked():
        missing = store.missing(names)
        if not missing:
            ckpt.refresh()
            return None
        sources = await find_sources(node, ckpt.model_id)
        transfer = Transfer(node, store, ckpt.manifest(), progress=progress)
        try:
            transfer.add_tensors(missing)
            log.info("fetching %d tensors (%.1f MB, %.1f MB already here) from %d peers", len(missing),
                     transfer.progress.total / 1e6, transfer.progress.reused / 1e6, len(sources))
            report = await transfer.run(sources)
        finally:
            transfer.close()
            ckpt.refresh()
    log.info("fetched %.1f MB in %.1f s (%.1f MB/s) from %d peers%s", report.done / 1e6,
             time.monotonic() - report.started, report.rate / 1e6, len(report.per_source),
             f"; dropped {len(report.bad)} for bad bytes" if report.bad else "")
    return report


def head_tensor_names(ckpt: Checkpoint, *, embed: bool = True, lm_head: bool = True) -> list[str]:
    """What a client holds: the embedding, and unless the last peer applies them, the final
    norm and LM head (tied heads have no LM head tensors of their own)."""
    parts = ckpt.head_parts()
    names = list(parts["embed"]) if embed else []
    if lm_head:
        names += parts["norm"] + parts["lm_head"]
    return names + ckpt.other_tensors()


def span_tensor_names(ckpt: Checkpoint, start: int, end: int) -> list[str]:
    """What a peer serving layers start..end fetches: those layers and, at the model's edges, the
    parts of the head next to them (the first span the embedding, the last the final norm and LM
    head, and the embedding too when the LM head is tied to it): so that a swarm whose peers all
    joined by name still holds, and serves, what thin clients and ``--hold-head`` need."""
    names = [n for i in range(start, end) for n in ckpt.layer_tensors(i)]
    parts = ckpt.head_parts()
    if start == 0:
        names += parts["embed"] + ckpt.other_tensors()
    if end == ckpt.num_layers:
        names += parts["norm"] + parts["lm_head"] + (parts["embed"] if not parts["lm_head"] else [])
    return list(dict.fromkeys(names))
