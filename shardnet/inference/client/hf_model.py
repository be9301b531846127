"""A synchronous client in the Hugging Face style, for scripts and notebooks.

    import shardnet
    model = shardnet.DistributedModelForCausalLM.from_pretrained("tiny-llama", bootstrap=[MADDR])
    out = model.generate(input_ids, max_new_tokens=32)           # what transformers returns
    model.close()                                               # or: with ... as model:

The overlay runs on trio; a script or a notebook cell does not. So the node, the client and the
model's head live in one trio run on a background thread (started by ``from_pretrained``, ended by
``close``), and each call hands its work to that thread (``trio.from_thread``) and waits. The rows of
a batch run as concurrent sessions: compute peers batch their steps (continuous batching).

``generate`` takes what ``transformers``' ``generate`` takes for decoder-only models and returns
the same thing: ``input_ids`` with the new tokens appended, rows that stop early (end of sequence)
padded with ``pad_token_id``. Greedy output is token-identical to transformers on the same weights
and dtype. An argument it cannot honour is refused with a ``ValueError`` naming it, never ignored.
The async API underneath is ``shardnet.inference.client.client.Client`` (docs/embedding.md).
"""

from __future__ import annotations

import json
import logging
import threading
from contextlib import AsyncExitStack, aclosing
from pathlib import Path
from types import EllipsisType

import torch
import trio

from shardnet.errors import ShardnetError

log = logging.getLogger(__name__)

#: transformers' GenerationConfig defaults, for what neither the call nor the model sets
HF_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "max_length": 20}
#: arguments of transformers' generate that change nothing here (their default values are accepted)
ACCEPTED_DEFAULTS = {"num_beams": 1, "num_return_sequences": 1, "use_cache": True, "repetition_penalty": 1.0,
                     "output_scores": False, "output_logits": False, "return_dict_in_generate": False}


class _TrioThread:
    """One trio run on a daemon thread, holding what ``setup`` opened until ``close``."""

    def __init__(self, setup) -> None:
        self._setup = setup
        self._ready = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self.value = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="shardnet-trio", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self.error is not None:
            self._thread.join()
            raise self.error

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as e:  # a failure after setup (setup's own is kept in _main)
            if self.error is None:
                self.error = e
            self._ready.set()

    async def _main(self) -> None:
        async with AsyncExitStack() as stack:
            try:
                self.value = await self._setup(stack)
            except BaseException as e:
                self.error = e
                self._ready.set()
                return
            self._token = trio.lowlevel.current_trio_token()
            self._stop = trio.Event()
            self._ready.set()
            await self._stop.wait()

    def call(self, afn, *args):
        """Run ``afn(*args)`` in the trio thread; its result, or its exception."""
        if self._stop is None or self._stop.is_set():
            raise ShardnetError("this model is closed")
        return trio.from_thread.run(afn, *args, trio_token=self._token)

    def close(self) -> None:
        if self._stop is not None and not self._stop.is_set():
            trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        self._thread.join(timeout=30)


class DistributedModelForCausalLM:
    """A causal LM whose layers are served by the swarm; this process holds the embedding, the
    final norm and the LM head (or not even those: ``logits_on_last``)."""

    def __init__(self, loop: _TrioThread) -> None:
        self._loop = loop
        self.node, self.client = loop.value
        self.local_model = self.client.model
        self.name_or_path = str(self.local_model.ckpt.path)  # AutoTokenizer.from_pretrained takes it
        self.config = self.local_model.ckpt.config
        self.generation_defaults = _generation_defaults(Path(self.name_or_path), self.config)
        self.cache_dir: Path | None = None  # where a draft the model's card names is fetched to
        self._draft: Path | None | EllipsisType = ...  # not looked for yet
        self._draft_models: list = []  # one per row of the largest batch so far (ModelDrafter)

    @classmethod
    def from_pretrained(cls, name_or_path: str | Path | None = None, *, bootstrap: list[str] = (),
                        dtype: str = "auto", cache_dir: str | Path | None = None, route_timeout: float = 60.0,
                        logits_on_last: bool = False, listen: list[str] = ("/ip4/0.0.0.0/tcp/0",),
                        mdns: bool = False, audit_rate: float = 0.1) -> DistributedModelForCausalLM:
        """Join the swarm at ``bootstrap`` as a client of the model ``name_or_path``: a checkpoint
        directory, a repo in the local Hugging Face cache, or a name or model ID the swarm serves
        (its config, tokenizer and head fetched into ``cache_dir``; never a layer). None: the
        shipped tiny-llama."""
        from shardnet.inference.client.client import Client
        from shardnet.transport import NodeConfig, open_node

        if not bootstrap and not mdns:
            raise ShardnetError("from_pretrained needs bootstrap=[MADDR, ...] (or mdns=True) to reach a swarm")

        async def setup(stack: AsyncExitStack):
            cfg = NodeConfig(listen=list(listen), bootstrap=list(bootstrap), dht_mode="client", enable_mdns=mdns)
            node = await stack.enter_async_context(open_node(cfg))
            if bootstrap:
                await node.wait_bootstrapped()
            model = await _client_model(node, name_or_path, dtype=dtype, logits_on_last=logits_on_last,
                                        cache_dir=Path(cache_dir) if cache_dir else None)
            return node, Client(node, model, logits_on_last=logits_on_last, audit_rate=audit_rate,
                                route_timeout=route_timeout)

        model = cls(_TrioThread(setup))
        model.cache_dir = Path(cache_dir) if cache_dir else None
        return model

    # -- transformers' generate -------------------------------------------------------------------
    def generate(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None, *,
                 max_new_tokens: int | None = None, max_length: int | None = None, do_sample: bool | None = None,
                 temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                 eos_token_id: int | list[int] | None = ..., pad_token_id: int | None = None, streamer=None,
                 seed: int | None = None, speculate: str = "auto", **kwargs) -> torch.LongTensor:
        """``input_ids`` [batch, tokens] (or [tokens]) -> [batch, tokens + new] as transformers
        returns it. ``attention_mask`` marks left padding, which each row's session leaves out.
        ``seed`` fixes sampled output (default: drawn from torch's generator, so
        ``torch.manual_seed`` does). ``streamer``: a transformers streamer (``put``/``end``),
        batch size 1 as in transformers. ``speculate``: as ``shardnet generate --speculate``
        (auto: a draft model the model's card names, suffix matching or plain decoding, chosen
        as it goes by what each yields; lossless either way); ``last_drafters`` says what each
        row used."""
        from shardnet.inference.client.auto_drafter import SPECULATE_CHOICES

        if speculate not in SPECULATE_CHOICES:
            raise ValueError(f"generate: speculate={speculate!r}: one of {', '.join(SPECULATE_CHOICES)}")
        for name, value in kwargs.items():
            if name not in ACCEPTED_DEFAULTS or value != ACCEPTED_DEFAULTS[name]:
                raise ValueError(f"generate: {name}={value!r} is not supported by a distributed model")
        if input_ids is None:
            raise ValueError("generate: input_ids is required")
        ids = torch.as_tensor(input_ids)
        if ids.dim() == 1:
            ids = ids[None]
        if ids.dim() != 2 or ids.shape[1] == 0 or ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"generate: input_ids must be integer token ids [batch, tokens], got "
                             f"{tuple(ids.shape)} {ids.dtype}")
        if streamer is not None and ids.shape[0] > 1:
            raise ValueError("generate: a streamer takes batch size 1 (as in transformers)")
        mask = torch.ones_like(ids) if attention_mask is None else torch.as_tensor(attention_mask)
        if mask.shape != ids.shape:
            raise ValueError(f"generate: attention_mask {tuple(mask.shape)} does not match input_ids {tuple(ids.shape)}")
        d = self.generation_defaults
        if max_new_tokens is None:
            max_new_tokens = (max_length or d["max_length"]) - ids.shape[1]
        if max_new_tokens < 0:
            raise ValueError(f"generate: max_length {max_length} is shorter than the input ({ids.shape[1]} tokens)")
        sample = d.get("do_sample", False) if do_sample is None else do_sample
        params = dict(temperature=temperature if temperature is not None else d["temperature"],
                      top_p=top_p if top_p is not None else d["top_p"],
                      top_k=top_k if top_k is not None else d["top_k"]) if sample else dict(temperature=0.0)
        if sample and params["temperature"] == 0:
            raise ValueError("generate: do_sample=True needs temperature > 0")
        eos = d["eos_token_id"] if eos_token_id is ... else eos_token_id
        eos_ids = set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
        pad = pad_token_id if pad_token_id is not None else d.get("pad_token_id")
        if pad is None:
            pad = min(eos_ids) if eos_ids else 0
        if sample and seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())
        rows = [[int(t) for t, m in zip(row, mrow) if m] for row, mrow in zip(ids.tolist(), mask.tolist())]
        if any(not r for r in rows):
            raise ValueError("generate: a row of input_ids has no token its attention_mask keeps")
        if streamer is not None:
            streamer.put(ids[0].cpu())
        new = self._loop.call(self._generate_rows, rows, max_new_tokens, params, seed, eos_ids, streamer, speculate)
        if streamer is not None:
            streamer.end()
        width = max(map(len, new), default=0)
        tail = torch.full((ids.shape[0], width), pad, dtype=ids.dtype)
        for i, toks in enumerate(new):
            tail[i, :len(toks)] = torch.tensor(toks, dtype=ids.dtype)
        return torch.cat([ids, tail], dim=1)

    async def _generate_rows(self, rows, max_new: int, params: dict, seed, eos_ids: set[int], streamer,
                             speculate: str = "none"):
        out: list[list[int]] = [[] for _ in rows]
        drafters = [await self._drafter(speculate, i) for i in range(len(rows))]
        self.last_drafters = drafters

        async def one(i: int) -> None:
            if max_new == 0:
                return
            gen = self.client.generate(rows[i], max_new_tokens=max_new, stop_at_eos=False,
                                       seed=None if seed is None else seed + i, drafter=drafters[i], **params)
            async with aclosing(gen) as tokens:
                async for tok in tokens:
                    tok.apply(out[i])
                    if streamer is not None and tok.id is not None:
                        streamer.put(torch.tensor([tok.id]))
                    if tok.id in eos_ids:  # transformers keeps the end-of-sequence token, then pads
                        return

        async with trio.open_nursery() as nursery:
            for i in range(len(rows)):
                nursery.start_soon(one, i)
        return out

    async def _drafter(self, speculate: str, row: int):
        """Row ``row``'s drafter; a draft model is loaded once per row and kept (its cache
        follows each new text), not once per call."""
        from shardnet.inference.client.auto_drafter import drafter_for, find_draft
        from shardnet.inference.client.speculative import ModelDrafter

        vocab = self.config.vocab_size
        model = None
        if speculate in ("auto", "draft"):
            if self._draft is ...:  # looked for once: the shipped draft, else the one the card names
                self._draft = await find_draft(self.node, self.local_model, cache_dir=self.cache_dir)
            while self._draft is not None and len(self._draft_models) <= row:
                try:
                    self._draft_models.append(await trio.to_thread.run_sync(
                        lambda: ModelDrafter(self._draft, vocab_size=vocab)))
                except Exception as e:  # (auto goes on without it; draft says why)
                    log.warning("the draft model at %s cannot be used: %s: %s", self._draft, type(e).__name__, e)
                    self._draft = None
            if self._draft is not None:
                model = self._draft_models[row]
                model.forget()
        return drafter_for(speculate, vocab_size=vocab, draft_model=model)

    # -- lifetime ----------------------------------------------------------------------------------
    def close(self) -> None:
        """Leave the swarm and stop the background thread."""
        self._loop.close()

    def __enter__(self) -> DistributedModelForCausalLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _generation_defaults(path: Path, config) -> dict:
    """What transformers' generate would use when the call does not say: the model's
    generation_config.json over its config over transformers' own defaults."""
    d = dict(HF_DEFAULTS)
    d["eos_token_id"] = getattr(config, "eos_token_id", None)
    d["pad_token_id"] = getattr(config, "pad_token_id", None)
    gen = path / "generation_config.json"
    if gen.is_file():
        try:
            d.update({k: v for k, v in json.loads(gen.read_text()).items()
                      if k in ("temperature", "top_p", "top_k", "max_length", "do_sample", "eos_token_id",
                               "pad_token_id")})
        except (OSError, ValueError) as e:
            log.warning("ignoring %s: %s", gen, e)
    return d


async def _client_model(node, spec, *, dtype: str, logits_on_last: bool, cache_dir: Path | None):
    """The client's part of the model: from a directory or the local hub cache, else from the swarm."""
    from shardnet.inference.model.hub import looks_like_repo_id, resolve_hub_checkpoint
    from shardnet.inference.model.local_model import LocalModel
    from shardnet.models import default_model_path

    path = default_model_path() if spec is None else Path(spec).expanduser()
    if not path.is_dir():
        found = None
        if looks_like_repo_id(str(spec)):
            found = await trio.to_thread.run_sync(lambda: resolve_hub_checkpoint(str(spec), download=False))
        if found is not None:
            path = Path(found)
        else:
            from shardnet.inference.model.checkpoint import Checkpoint
            from shardnet.inference.weights.swarm_model import fetch_tensors, head_tensor_names, open_from_swarm

            path, _card = await open_from_swarm(node, str(spec), cache_root=cache_dir)
            ckpt = Checkpoint(path)
            await fetch_tensors(node, ckpt, head_tensor_names(ckpt, lm_head=not logits_on_last))
    return await trio.to_thread.run_sync(lambda: LocalModel(path, dtype=dtype, lm_head=not logits_on_last))
