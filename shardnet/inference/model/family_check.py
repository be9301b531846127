"""Before a checkpoint is served: does shardnet's split reproduce transformers on it, layer by layer?

A block applies what the family's adapter declares around transformers' own layers; a family run
generically, or a config using a feature no test covered, may need more. Layers of one model can
differ by index (attention kind, window, rotary or none, dense or experts, per-layer scalings), so
a check of layer 0 alone proves little. Before a peer serves a span, every *distinct layer
configuration* in it is checked once:

- The reference is transformers' own: the family's causal LM built and loaded the way
  ``from_pretrained`` builds and loads it (its init contexts, ``_load_pretrained_model`` and
  ``_finalize_model_loading``: key conversion, fp32-kept modules, buffers, tied weights), from the
  checkpoint's own tensors of the layers under check. The other layers stand aside as
  pass-throughs (no weights), so a peer never allocates more than the layers it checks.
  Transformers' forward then runs the model end to end, and hooks record what goes into and comes
  out of every layer.
- shardnet's side is a :class:`Block` of that one layer (shardnet's own loader), fed the recorded
  input: a prefill, then single-token steps on its KV cache, then a batched step next to another
  session (the continuous-batching path). Each output must equal transformers' within float
  rounding (float32).
- Positions run past every window: the check's config shrinks a sliding window to
  :data:`CHECK_WINDOW` on both sides, so the window itself is exercised.
- Between layers transformers must pass the hidden state on unchanged (a model that rescales it
  between layers cannot be split at a layer boundary).
- Where the head is held (a client, or a peer holding the embedding, norm and LM head), the
  embedding (with its multiplier) and the logits (norm, head, soft-cap or scale) are checked too.

A difference beyond float rounding refuses the checkpoint with a one-line reason. Verdicts are kept
beside the manifest cache, one per layer configuration and one for the head, keyed on the model
ID and the transformers version, so each runs once.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import threading
from dataclasses import dataclass, field

import torch

from shardnet.errors import CheckpointError
from shardnet.inference.model.checkpoint import Checkpoint

log = logging.getLogger(__name__)

VERDICT_CACHE = ".shardnet-family-check.json"
#: positions run through each checked layer (past the shrunk window, several decode steps)
CHECK_TOKENS = 12
#: a sliding window longer than this is shrunk to it, on both sides, for the check
CHECK_WINDOW = 4
#: max |difference| allowed, relative to the largest |value| of transformers' output: float32
#: rounding of the same ops in another order stays orders of magnitude below it (measured ~1e-7);
#: a missed scale, mask or rotary does not
RELATIVE_TOLERANCE = 1e-4
#: the logits' tolerance (a norm and a vocabulary-wide product more than a layer)
LOGITS_TOLERANCE = 1e-3
#: (a layer's, the logits') tolerance by the dtype the check computes in. In bfloat16 and float16
#: both sides ran bit-identical on every tested family (tests/unit/inference/test_family_check_dtype.py:
#: the same modules on the same inputs, results rounded to the dtype), so a difference is the
#: rounding of one value near the top of the range landing the other way: two units in the last
#: place at the largest value (bfloat16's 8-bit significand: 2^-7; float16's 11: 2^-9). A missed
#: scale, mask or rotary moves the outputs by far more
TOLERANCES = {torch.float32: (RELATIVE_TOLERANCE, LOGITS_TOLERANCE),
              torch.bfloat16: (2.0 ** -7, 2.0 ** -6),
              torch.float16: (2.0 ** -9, 2.0 ** -8)}


@dataclass
class _Run:
    """What transformers' forward passed into and out of every layer."""

    inputs: dict[int, torch.Tensor] = field(default_factory=dict)
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)


def ensure_family_matches(ckpt: Checkpoint, layers: tuple[int, int] | None = None, *, head: bool = True,
                          dtype: torch.dtype | None = None) -> None:
    """Refuse ``ckpt`` (CheckpointError, one line) unless shardnet runs it as transformers does:
    every distinct layer configuration among ``layers`` (START, END; None: none) whose tensors are
    stored here, and the head (with ``head``, where its tensors are stored here), computed in
    ``dtype`` (default: the checkpoint's own, as ``--dtype auto``) with the weights as a block
    holds them (stored formats stay stored): no copy in a wider dtype. Each verdict is kept (per
    dtype), so what was checked once is not checked again."""
    import transformers

    from shardnet.inference.model.block import dtype_name, resolve_dtype

    dtype = dtype or resolve_dtype("auto", ckpt)
    if dtype not in TOLERANCES:
        dtype = torch.float32
    prefix = dtype_name(dtype) + ":"

    key = {"model_id": ckpt.model_id, "transformers": transformers.__version__, "family": repr(ckpt.family)}
    cache = ckpt.path / VERDICT_CACHE
    try:
        cached = json.loads(cache.read_text())
    except (OSError, json.JSONDecodeError):
        cached = None
    verdicts: dict = cached["verdicts"] if isinstance(cached, dict) and cached.get("key") == key \
        and isinstance(cached.get("verdicts"), dict) else {}

    todo: list[tuple[str, list[int] | None]] = []
    parts = ckpt.head_parts()
    if head and ckpt.holds(parts["embed"] + parts["norm"] + parts["lm_head"]):
        todo.append((prefix + "head", None))
    if layers is not None:
        for sig, index in representative_layers(ckpt, *layers).items():
            todo.append((prefix + sig, [index]))
    for item, _ in todo:
        if verdicts.get(item):
            raise CheckpointError(verdicts[item])
    todo = [(item, idx) for item, idx in todo if item not in verdicts]
    if not todo:
        return
    checked = [i for _, idx in todo if idx for i in idx]
    verdict_items = _compare(ckpt, checked, with_head=any(idx is None for _, idx in todo), dtype=dtype)
    for item, idx in todo:
        verdicts[item] = verdict_items.get("head" if idx is None else idx[0])
    _keep(cache, key, {item: verdicts[item] for item, _ in todo})
    for item, _ in todo:
        if verdicts[item]:
            raise CheckpointError(verdicts[item])


def _keep(cache, key: dict, new: dict) -> None:
    """Add ``new`` verdicts to the file (peers of one checkpoint directory may check at once:
    each adds its own, the file replaced whole)."""
    try:
        cached = json.loads(cache.read_text())
        kept = cached["verdicts"] if cached.get("key") == key and isinstance(cached.get("verdicts"), dict) else {}
    except (OSError, ValueError, AttributeError):
        kept = {}
    tmp = cache.with_name(f"{cache.name}.{os.getpid()}.{threading.get_ident()}")
    try:
        tmp.write_text(json.dumps({"key": key, "verdicts": {**kept, **new}}))
        tmp.replace(cache)
    except OSError:
        tmp.unlink(missing_ok=True)  # read-only model directory: check again next time


def check_config(ckpt: Checkpoint):
    """The config both sides of the check build from: float32, windows shrunk to CHECK_WINDOW."""
    cfg = copy.deepcopy(ckpt.config)
    window = getattr(cfg, "sliding_window", None)
    if isinstance(window, int) and window > CHECK_WINDOW:
        cfg.sliding_window = CHECK_WINDOW
    return cfg


def layer_signature(layer: torch.nn.Module, config, index: int, kind: str) -> str:
    """What makes a layer behave as it does, beyond its weights' values: its modules, their
    parameters' shapes, their plain attributes (window, scaling, rotary use, ...), its attention
    kind, and the config's per-layer entries at its index."""
    parts: list = [kind]
    for name, mod in layer.named_modules():
        attrs = sorted((k, v) for k, v in vars(mod).items()
                       if not k.startswith("_") and k not in ("training", "layer_idx")
                       and isinstance(v, (int, float, bool, str, type(None), tuple)))
        params = [(n, tuple(p.shape), str(p.dtype)) for n, p in mod.named_parameters(recurse=False)]
        parts.append((name, type(mod).__name__, attrs, params))
    n = config.num_hidden_layers
    for k, v in sorted(vars(config).items()):
        if isinstance(v, (list, tuple)) and len(v) == n and k != "layer_types":
            parts.append((k, repr(v[index])))
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


def representative_layers(ckpt: Checkpoint, start: int, end: int) -> dict[str, int]:
    """For each distinct layer configuration among layers [start, end) stored here: its first
    layer. Built on the meta device (nothing allocated)."""
    from shardnet.inference.model.shell import ModelShell

    cfg = check_config(ckpt)
    shell = ModelShell(ckpt, torch.float32, cfg)
    kinds = ckpt.family.layer_types(shell.config)
    out: dict[str, int] = {}
    for i in range(start, end):
        if not ckpt.holds(ckpt.layer_tensors(i)):
            continue
        out.setdefault("layer:" + layer_signature(shell.base.layers[i], shell.config, i, kinds[i]), i)
    return out


def _compare(ckpt: Checkpoint, checked: list[int], *, with_head: bool, dtype: torch.dtype = torch.float32) -> dict:
    """Verdicts (None: matches) for each layer in ``checked`` and, with ``with_head``, "head"."""
    what = ", ".join([f"layer {i}" for i in checked] + (["the head"] if with_head else []))
    log.info("checking %s (%s) against transformers: %s (once)", ckpt.path.name, ckpt.model_type, what)
    verdicts: dict = {}
    try:
        if with_head:
            verdicts["head"] = _compare_head(ckpt, dtype)
        if checked:
            verdicts.update(_compare_layers(ckpt, checked, dtype))
    except (CheckpointError, MemoryError, OSError):
        raise  # not a verdict on the family: nothing is kept, the next load checks again
    except Exception as e:  # noqa: BLE001 - any failure to run the family is a refusal, said in one line
        text = " ".join(str(e).split())[:200] or type(e).__name__
        verdict = (f"model_type {ckpt.model_type!r} is not supported: its layers do not run as shardnet blocks "
                   f"({type(e).__name__}: {text})")
        verdicts = dict.fromkeys([*checked, "head"], verdict)
    return verdicts


def _reference(ckpt: Checkpoint, cfg, checked: list[int], with_head: bool, dtype: torch.dtype = torch.float32,
               loaded: dict[str, torch.Tensor] | None = None):
    """The family's causal LM as ``from_pretrained`` builds and loads it, from this checkpoint's
    tensors of the ``checked`` layers (and of the head, ``with_head``; ``loaded``: those tensors,
    already read); every other layer a pass-through. Returns the model and the hooks' record."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.modeling_utils import LoadStateDictConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    from transformers.monkey_patching import patch_output_recorders
    from transformers.utils.generic import ContextManagers

    cfg = copy.deepcopy(cfg)
    if ckpt.quant is not None:
        del cfg.quantization_config  # kept as stored below, computed from as the block does
    cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(cfg)]
    with ContextManagers(cls.get_init_context(dtype, False, False, None, cfg)):
        model = cls(cfg)
        patch_output_recorders(model)
    base = getattr(model, model.base_model_prefix)
    run = _Run()
    for i, layer in enumerate(base.layers):
        if i not in checked:
            base.layers[i] = layer = _PassThrough(layer)
        layer.register_forward_pre_hook(_record_input(run, i), with_kwargs=True)
        layer.register_forward_hook(_record_output(run, i))
    names = [n for i in checked for n in ckpt.layer_tensors(i)]
    if with_head:
        parts = ckpt.head_parts()
        names += parts["embed"] + parts["norm"] + parts["lm_head"]
    else:  # fed hidden states, read before the final norm: the head is not built
        base.embed_tokens, base.norm = _StandIn(cfg.hidden_size), _StandIn(cfg.hidden_size)
        model.lm_head = _StandIn(cfg.hidden_size)
    tensors = {n: loaded[n] for n in names} if loaded is not None else ckpt.load(names)
    tensors.update({f"{name}.weight": mod.weight.detach().clone() for name, mod in model.named_modules()
                    if isinstance(mod, _StandIn)})
    if ckpt.quant is not None:
        from shardnet.inference.model.formats import to_stored

        # kept as stored, as a block keeps them: transformers' modules run on them unchanged
        tensors = to_stored(ckpt.quant, tensors, dtype)
    load_config = LoadStateDictConfig(pretrained_model_name_or_path=str(ckpt.path), dtype=dtype,
                                      dtype_plan=model._get_dtype_plan(dtype),
                                      weight_mapping=get_model_conversion_mapping(model))
    info, _ = cls._load_pretrained_model(model, tensors, None, load_config)
    info = cls._finalize_model_loading(model, load_config, info)
    if info.unexpected_keys:
        raise ValueError(f"transformers' model has no place for {sorted(info.unexpected_keys)[0]}")
    return model.eval(), base, run


class _Loaded:
    """``ckpt`` whose ``load`` hands out ``tensors``, read from it before (a block built from it
    holds the very tensors transformers' model of the check held)."""

    def __init__(self, ckpt: Checkpoint, tensors: dict[str, torch.Tensor]) -> None:
        self.ckpt, self.tensors = ckpt, tensors

    def __getattr__(self, name: str):
        return getattr(self.ckpt, name)

    def load(self, names: list[str], dtype=None, device: str = "cpu") -> dict[str, torch.Tensor]:
        return {n: self.tensors[n].to(device=device, dtype=dtype) for n in names}


class _PassThrough(torch.nn.Module):
    """Stands for a decoder layer not under check: returns its input; answers attribute reads
    (attention kind, index) as the layer would; holds no weights."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "_stood_for", layer)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_stood_for"), name)

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


class _StandIn(torch.nn.Module):
    """Stands for a part of the head on a peer that does not hold it: passes hidden states on,
    and has a one-row weight for what reads or ties one."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size), requires_grad=False)

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


def _hidden_of(value):
    return value[0] if isinstance(value, (tuple, list)) else value


def _record_input(run: _Run, i: int):
    def hook(_module, args, kwargs):
        run.inputs[i] = _hidden_of(args[0] if args else kwargs["hidden_states"]).detach().clone()
    return hook


def _record_output(run: _Run, i: int):
    def hook(_module, _args, output):
        run.outputs[i] = _hidden_of(output).detach().clone()
    return hook


def _check_ids(ckpt: Checkpoint) -> torch.Tensor:
    return (torch.arange(CHECK_TOKENS).unsqueeze(0) * 7 + 3) % int(ckpt.config.vocab_size)


def _between_layers(ckpt: Checkpoint, run: _Run) -> str | None:
    """Transformers passes each layer's output to the next one unchanged, or a split cannot
    reproduce it."""
    for i in range(len(run.outputs) - 1):
        if i + 1 in run.inputs and not torch.equal(run.outputs[i], run.inputs[i + 1]):
            return (f"model_type {ckpt.model_type!r} is not supported: its model changes the hidden state between "
                    f"layers {i} and {i + 1}, which a split at layer boundaries cannot reproduce")
    return None


def _differs(ckpt: Checkpoint, what: str, mine: torch.Tensor, theirs: torch.Tensor, tolerance: float) -> str | None:
    theirs = theirs.float()
    mine = mine.float().to(theirs.device)
    scale = max(theirs.abs().max().item(), 1.0)
    diff = (mine - theirs).abs().max().item() if mine.shape == theirs.shape else float("inf")
    if not diff <= tolerance * scale:
        return (f"model_type {ckpt.model_type!r} is not supported: on {what} shardnet differs from transformers "
                f"by {diff:.3g} (of {scale:.3g}); its family needs an adapter")
    log.info("%s: %s matches transformers (max difference %.2g of %.2g)", ckpt.path.name, what, diff, scale)
    return None


def _compare_head(ckpt: Checkpoint, dtype: torch.dtype = torch.float32) -> str | None:
    """The embedding (scaled as the adapter says) and the logits (norm, head, finishing) against
    transformers' forward with every layer a pass-through."""
    from shardnet.inference.model.block import Head

    head = Head(ckpt, dtype=dtype)  # first: a model without the standard stack is refused by its shell, in its words
    cfg = check_config(ckpt)
    model, _, run = _reference(ckpt, cfg, [], with_head=True, dtype=dtype)
    ids = _check_ids(ckpt)
    with torch.inference_mode():
        theirs = model(input_ids=ids, use_cache=False).logits
    last = max(run.outputs)
    return (_between_layers(ckpt, run)
            or _differs(ckpt, "its embeddings", head.embed(ids), run.inputs[0], TOLERANCES[dtype][0])
            or _differs(ckpt, "its logits", head.logits(run.outputs[last]), theirs, TOLERANCES[dtype][1]))


def _compare_layers(ckpt: Checkpoint, checked: list[int], dtype: torch.dtype = torch.float32
                    ) -> dict[int, str | None]:
    """Each checked layer as a one-layer block (prefill, cached decode steps, a batched step)
    against what it computed inside transformers' forward."""
    from shardnet.inference.model.block import Block

    cfg = check_config(ckpt)
    # read once: transformers' model and then shardnet's block are built from the same tensors
    # (views of the checkpoint's file, in its stored format), so no layer is held twice
    loaded = _Loaded(ckpt, ckpt.load([n for i in checked for n in ckpt.layer_tensors(i)]))
    model, base, run = _reference(ckpt, cfg, checked, with_head=False, dtype=dtype, loaded=loaded.tensors)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, CHECK_TOKENS, cfg.hidden_size, generator=generator).to(dtype)
    with torch.inference_mode():
        base(inputs_embeds=x, use_cache=False)
    del model, base  # what it computed is recorded: its layers go before a block's come
    between = _between_layers(ckpt, run)
    out: dict[int, str | None] = {}
    t = CHECK_TOKENS
    for i in checked:
        if between:
            out[i] = between
            continue
        kind = ckpt.family.layer_types(cfg)[i]
        block = Block(loaded, i, i + 1, config=cfg, dtype=dtype)
        hidden, want = run.inputs[i], run.outputs[i]
        cache = block.new_cache()
        steps = [block.forward(hidden[:, :t - 3], cache, 0)]
        steps += [block.forward(hidden[:, p:p + 1], cache, p) for p in range(t - 3, t)]
        cache = block.new_cache()
        block.forward(hidden[:, :t - 2], cache, 0)
        batched = block.forward_batch([(hidden[:, t - 2:t - 1], cache), (hidden[:, :t - 1], block.new_cache())])
        out[i] = (_differs(ckpt, f"layer {i} ({kind}), prefill and cached steps", torch.cat(steps, dim=1), want,
                           TOLERANCES[dtype][0])
                  or _differs(ckpt, f"layer {i} ({kind}), batched steps",
                              torch.cat([batched[0], batched[1]], dim=1),
                              torch.cat([want[:, t - 2:t - 1], want[:, :t - 1]], dim=1), TOLERANCES[dtype][0]))
        del block  # one layer at a time
    return out
