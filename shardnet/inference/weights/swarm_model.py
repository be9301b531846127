"""Opening a model the swarm serves: resolve a name or ID, fetch the manifest and the model's
files into the local cache, then the tensors a role needs (a span of layers; the head)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import trio

from shardnet.inference.model.checkpoint import Checkpoint
from shardnet.inference.weights.cards import MODEL_ID_RE, ModelCard, draft_named_for, resolve_model
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


#: the most a draft a card names may weigh, as a share of its model's bytes (a draft is small by purpose)
DRAFT_MAX_SHARE = 0.5
#: seconds to find the draft a card names and fetch its manifest and files (its tensors then come
#: with a progress bar of their own)
DRAFT_LOOKUP_S = 20.0


async def fetch_draft(node: Node, model_id: str, *, vocab_size: int, model_bytes: int, cache_root: Path | None = None,
                      progress: ProgressFn | None = None, timeout: float = DRAFT_LOOKUP_S) -> Path | None:
    """The draft model the cards of ``model_id`` name, fetched whole into the cache (a draft runs
    on the client: all of it), or None when no card names one. Refused (FetchError) before any
    tensor is fetched when it is over ``DRAFT_MAX_SHARE`` of the model's ``model_bytes`` or its
    vocabulary is not ``vocab_size``: a card's publisher chooses what it names."""
    opened = None
    with trio.move_on_after(timeout):
        draft_id = await draft_named_for(node, model_id, timeout=timeout / 2)
        if draft_id is None:
            return None
        log.info("fetching the draft model %s… the card of %s… names", draft_id[:16], model_id[:16])
        opened = await open_from_swarm(node, draft_id, cache_root=cache_root, progress=progress)
    if opened is None:
        raise FetchError(f"the draft of {model_id[:16]}… was not found and opened within {timeout:.0f} s")
    path, _card = opened
    ckpt = Checkpoint(path)  # its size from the manifest, checked against the model ID (not the card's word)
    if ckpt.total_bytes > DRAFT_MAX_SHARE * model_bytes:
        raise FetchError(f"the draft a card names ({ckpt.total_bytes / 1e6:.1f} MB) is over "
                         f"{DRAFT_MAX_SHARE:.0%} of the model's size ({model_bytes / 1e6:.1f} MB)")
    if ckpt.config.vocab_size != vocab_size:
        raise FetchError(f"the draft a card names has a vocabulary of {ckpt.config.vocab_size} tokens, the model "
                         f"{vocab_size}")
    await fetch_tensors(node, ckpt, list(ckpt.catalog), progress=progress)
    return path


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
