"""What the swarm serves: each peer that holds a model publishes a signed *model card* in the DHT
(its ID, the names people call it by, family, layers, size), provides the names, and serves the
model's manifest and bytes on ``/shardnet/weights/1.0.0``.

The card is a signed DHT value of its publisher (records.py: nobody else can write it) and
points at the manifest by its hash, the model ID; the manifest itself, which for a model of
tens of thousands of tensors is megabytes (a DHT value holds at most 64 KiB), comes from the
serving peers over the weights protocol and is checked against that ID. So a card can be
wrong only about the names and figures its own publisher chose to sign; which model a name
means on this node, when cards disagree, is for names.py (the first binding seen is kept).

DHT keys (provider records): ``models`` (every peer publishing a card), ``model-name/<name>``
(peers serving a model by that name), ``weights/<model ID>`` (peers serving its bytes). The
card is the value ``model-card/<model ID>`` of each publisher.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

import cbor2
import trio

from shardnet.errors import ShardnetError
from shardnet.inference.claims import STATUS_PROVIDERS_PER_RANGE, find_claims, live_claims
from shardnet.inference.weights.names import NameBindings, choose, parse_model_spec
from shardnet.transport.node import Node

log = logging.getLogger(__name__)

MODELS_KEY = "models"
MODEL_ID_RE = re.compile(r"^[0-9a-f]{64}$")
MAX_NAMES = 8
MAX_NAME_CHARS = 200
#: models one peer lists as served (its ``models`` record)
MAX_MODELS_LISTED = 16


class ModelNotFound(ShardnetError):
    """No peer of the swarm serves a model by that name or ID."""

    code = "no_model"


def card_record_name(model_id: str) -> str:
    return f"model-card/{model_id}"


def name_key(name: str) -> str:
    return f"model-name/{name}"


def weights_key(model_id: str) -> str:
    return f"weights/{model_id}"


@dataclass(frozen=True)
class ModelCard:
    model_id: str
    names: tuple[str, ...]
    family: str
    num_layers: int
    total_bytes: int
    dtype: str
    #: the model ID of a draft for speculative decoding with this model (a small model of the same
    #: vocabulary the publisher also serves), or None. Optional in version 1: older decoders
    #: ignore it, and a card without it names no draft.
    draft: str | None = None

    def encode(self) -> bytes:
        doc = {"v": 1, "model_id": self.model_id, "names": list(self.names[:MAX_NAMES]), "family": self.family,
               "num_layers": self.num_layers, "bytes": self.total_bytes, "dtype": self.dtype}
        if self.draft is not None:
            doc["draft"] = self.draft
        return cbor2.dumps(doc, canonical=True)

    @classmethod
    def decode(cls, blob: bytes) -> ModelCard:
        try:
            m = cbor2.loads(blob)
            names = m["names"]
            card = cls(m["model_id"], tuple(names), m["family"], m["num_layers"], m["bytes"], m["dtype"],
                       m.get("draft"))
        except Exception:
            raise ShardnetError("malformed model card") from None
        if not (isinstance(card.model_id, str) and MODEL_ID_RE.match(card.model_id) and isinstance(names, list)
                and (card.draft is None or (isinstance(card.draft, str) and MODEL_ID_RE.match(card.draft)
                                            and card.draft != card.model_id))
                and len(names) <= MAX_NAMES
                and all(isinstance(n, str) and 0 < len(n) <= MAX_NAME_CHARS for n in names)
                and isinstance(card.family, str) and isinstance(card.num_layers, int)
                and isinstance(card.total_bytes, int) and isinstance(card.dtype, str)):
            raise ShardnetError("malformed model card")
        return card


def card_of(ckpt, extra_names: list[str] = (), *, draft: str | None = None) -> ModelCard:
    names = [n for n in dict.fromkeys([*extra_names, *ckpt.names]) if 0 < len(n) <= MAX_NAME_CHARS]
    return ModelCard(ckpt.model_id, tuple(names[:MAX_NAMES]), ckpt.model_type, ckpt.num_layers, ckpt.total_bytes,
                     ckpt.stored_dtype, draft)


async def publish_card(node: Node, card: ModelCard, *, serves_weights: bool, listed: bool = True) -> None:
    """Put the card and its provider records in the DHT (best effort: the next round retries);
    ``listed``: this peer is a provider of ``models`` for it too."""
    # the models record last: a peer listed as publishing a model is also findable by its name
    # and, when it serves them, for its bytes
    jobs = [("card", lambda: node.dht.put(card_record_name(card.model_id), card.encode()))]
    if serves_weights:
        jobs.append(("weights", lambda: node.dht.provide(weights_key(card.model_id))))
    jobs += [(f"name {n}", lambda n=n: node.dht.provide(name_key(n))) for n in card.names]
    if listed:
        jobs.append(("models", lambda: node.dht.provide(MODELS_KEY)))
    for what, job in jobs:
        try:
            await job()
        except Exception as e:
            log.info("publishing model card (%s) failed: %s", what, e)


@dataclass
class SwarmModel:
    """One model as the swarm serves it: what its cards say and who claims which layers."""

    card: ModelCard
    publishers: set[str] = field(default_factory=set)
    spans: list[tuple[int, int, str, str]] = field(default_factory=list)  # start, end, peer, quant
    #: name -> the publishers whose cards of this model give it that name
    named_by: dict[str, set[str]] = field(default_factory=dict)
    #: name -> the other models claiming it too (set by list_models)
    conflicts: dict[str, list[str]] = field(default_factory=dict)

    @property
    def covered(self) -> list[tuple[int, int]]:
        """The layer ranges some peer claims, merged."""
        out: list[list[int]] = []
        for start, end, _, _ in sorted(self.spans):
            if out and start <= out[-1][1]:
                out[-1][1] = max(out[-1][1], end)
            else:
                out.append([start, end])
        return [(a, b) for a, b in out]

    @property
    def peers(self) -> int:
        """Peers serving layers of it now (a card outlives its publisher for a while; a claim is
        counted only when its peer answers a ping)."""
        return len({p for *_, p, _ in self.spans})

    @property
    def quant(self) -> list[str]:
        return sorted({q for *_, q in self.spans}) or ["none"]

    def to_json(self) -> dict:
        c = self.card
        return {"model_id": c.model_id, "names": list(c.names), "family": c.family, "num_layers": c.num_layers,
                "bytes": c.total_bytes, "dtype": c.dtype, "covered": [list(r) for r in self.covered],
                "peers": self.peers, "quantization": self.quant, "publishers": sorted(self.publishers),
                "conflicts": {n: list(ids) for n, ids in sorted(self.conflicts.items())}}


async def _cards_from(node: Node, key: str, model_id: str | None, *, timeout: float) -> list[tuple[str, ModelCard]]:
    """(publisher, card) from each provider of ``key``: its card for ``model_id``, or (None) the
    cards of every model its ``models`` record lists."""
    out: list[tuple[str, ModelCard]] = []
    with trio.move_on_after(timeout):
        providers = await node.dht.find_providers(key, count=64)

        async def one(info) -> None:
            pid = str(info.peer_id)
            if info.addrs:
                node.host.get_peerstore().add_addrs(info.peer_id, info.addrs, 600)
            for mid in [model_id] if model_id else await _models_of(node, pid):
                try:
                    blob = await node.dht.get(pid, card_record_name(mid))
                    if blob:
                        card = ModelCard.decode(blob)
                        if card.model_id == mid:
                            out.append((pid, card))
                except ShardnetError as e:
                    log.debug("model card of %s: %s", pid[:16], e)

        async with trio.open_nursery() as nursery:
            for info in providers:
                nursery.start_soon(one, info)
    return out


async def _models_of(node: Node, peer: str) -> list[str]:
    try:
        blob = await node.dht.get(peer, MODELS_KEY)
        ids = cbor2.loads(blob) if blob else []
    except Exception:
        return []
    return [i for i in ids if isinstance(i, str) and MODEL_ID_RE.match(i)][:MAX_MODELS_LISTED] \
        if isinstance(ids, list) else []


async def publish_model_list(node: Node, model_ids: list[str]) -> None:
    """The models this peer publishes cards for (what ``list_models`` reads first)."""
    try:
        await node.dht.put(MODELS_KEY, cbor2.dumps(sorted(model_ids)[:MAX_MODELS_LISTED]))
    except Exception as e:
        log.info("publishing the model list failed: %s", e)


async def list_models(node: Node, *, timeout: float = 15.0) -> list[SwarmModel]:
    """Every model the swarm serves, with its cards' facts and its claims' coverage."""
    found: dict[str, SwarmModel] = {}
    for pid, card in await _cards_from(node, MODELS_KEY, None, timeout=timeout):
        m = found.setdefault(card.model_id, SwarmModel(card))
        m.publishers.add(pid)
        for n in card.names:
            m.named_by.setdefault(n, set()).add(pid)
    for m in found.values():
        for n in m.named_by:
            others = sorted(o.card.model_id for o in found.values() if o is not m and n in o.named_by)
            if others:
                m.conflicts[n] = others
    await _add_claims(node, list(found.values()), timeout=timeout)
    return sorted(found.values(), key=lambda m: (m.card.names[:1], m.card.model_id))


async def _add_claims(node: Node, models: list[SwarmModel], *, timeout: float) -> None:
    async def one(m: SwarmModel) -> None:
        claims = await find_claims(node, m.card.model_id, num_layers=m.card.num_layers,
                                   per_range=STATUS_PROVIDERS_PER_RANGE, timeout=timeout)
        for c in await live_claims(node, claims):
            if c.serving:
                m.spans.append((c.start, c.end, c.peer, c.quant))

    async with trio.open_nursery() as nursery:
        for m in models:
            nursery.start_soon(one, m)


async def resolve_model(node: Node, spec: str, *, timeout: float = 15.0,
                        bindings: NameBindings | None = None) -> ModelCard:
    """The card of the model the swarm serves as ``spec``: a model ID, a name, or ``NAME@ID-PREFIX``,
    looked for until ``timeout``. A name means the model bound to it on this node, or on first
    use the one model that claims it (names.py has the rules; NameConflict when they refuse).
    ModelNotFound names what the swarm does serve."""
    if MODEL_ID_RE.match(spec):
        return await _resolve_id(node, spec, timeout=timeout)
    name, prefix = parse_model_spec(spec)
    bindings = bindings or NameBindings()
    kept = None if prefix else bindings.get(name)
    deadline = trio.current_time() + timeout
    while True:  # until found, or timeout: a peer that just started publishes its card within seconds
        left = max(1.0, deadline - trio.current_time())
        # a bound name is looked up by its model ID first: fake peers flooding the name's provider
        # records cannot hide it
        cards = await _cards_from(node, weights_key(kept.model_id), kept.model_id, timeout=left) if kept else []
        if not cards:
            cards = [(pid, card) for pid, card in await _cards_from(node, name_key(name), None, timeout=left)
                     if name in card.names]
        ids = {card.model_id for _, card in cards}
        wanted = (kept is None or kept.model_id in ids) and (prefix is None or any(i.startswith(prefix) for i in ids))
        if (cards and wanted) or trio.current_time() + 1.0 >= deadline:
            break
        await trio.sleep(1.0)
    claims: dict[str, set[str]] = {}
    for pid, card in cards:
        claims.setdefault(card.model_id, set()).add(pid)
    model_id = choose(name, prefix, claims, kept, where=bindings.path)
    if model_id is None:
        raise await _not_found(node, spec, timeout=timeout)
    if kept is None:
        old = bindings.get(name) if prefix else None
        if old is None or old.model_id != model_id:
            if old is not None:
                log.warning("model name %s: bound to %s… from now on (was %s…)", name, model_id[:16],
                            old.model_id[:16])
            bindings.keep(name, model_id, list(claims[model_id]))
    if len(claims) > 1:
        log.warning("model name %s: %d other models claim it; taking %s…, the one %s", name, len(claims) - 1,
                    model_id[:16], "pinned" if prefix else "bound on this node")
    return next(card for _, card in cards if card.model_id == model_id)


async def _resolve_id(node: Node, model_id: str, *, timeout: float) -> ModelCard:
    deadline = trio.current_time() + timeout
    while True:
        cards = await _cards_from(node, weights_key(model_id), model_id,
                                  timeout=max(1.0, deadline - trio.current_time()))
        if cards:
            return cards[0][1]
        if trio.current_time() + 1.0 >= deadline:
            raise await _not_found(node, model_id, timeout=timeout)
        await trio.sleep(1.0)


async def draft_named_for(node: Node, model_id: str, *, timeout: float = 10.0) -> str | None:
    """The model ID of the draft the cards of ``model_id`` name (the one most of them name), or
    None when none does (or no card is found within ``timeout``)."""
    with trio.move_on_after(timeout):
        cards = await _cards_from(node, weights_key(model_id), model_id, timeout=timeout)
        drafts = [card.draft for _, card in cards if card.draft is not None]
        return max(sorted(set(drafts)), key=drafts.count) if drafts else None
    return None


async def _not_found(node: Node, spec: str, *, timeout: float) -> ModelNotFound:
    served = await list_models(node, timeout=timeout)
    listing = "; ".join(f"{(m.card.names or ('?',))[0]} ({m.card.model_id[:16]}…)" for m in served[:8])
    return ModelNotFound(f"the swarm serves no model {spec!r}"
                         + (f" (it serves: {listing})" if listing else " (it serves no model at all)"))
