"""What differs between model families, one small adapter each, found from the config.

Every family here is a decoder-only stack ``model.layers.N`` whose layers, norms, rotary tables
and experts are transformers' own modules (built by :mod:`shell`). What transformers does *around*
that stack in the family's ``*Model.forward`` and ``*ForCausalLM.forward`` is what a block and a
head must redo, and that is what an adapter declares: a multiplier on the embeddings, how the
logits are finished, whether each attention type has its own rotary table. Masks follow the
config's ``layer_types`` (full or sliding-window), which transformers already reads per layer.

A family without an adapter still runs when its stack is the standard one: ``generic(model_type)``
gives it the default adapter, and the first load of such a checkpoint runs its first layer
against transformers (:mod:`family_check`), refusing it on any mismatch. What can be told from the
config alone (not a causal LM, an attention kind with no mask here, bidirectional attention) is
refused before any weight is read.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shardnet.errors import CheckpointError

if TYPE_CHECKING:
    import torch

#: attention kinds a block knows how to mask (transformers' names, from ``config.layer_types``)
KNOWN_LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class Family:
    model_type: str
    #: how the family is proven here ("" for a family run generically and checked at first load)
    tested: str = ""
    #: config attribute the input embeddings are multiplied by (Granite's embedding_multiplier)
    embed_multiplier: str | None = None
    #: config attribute the logits are divided by (Granite's logits_scaling)
    logit_divisor: str | None = None
    #: config attribute the logits are multiplied by (Cohere's logit_scale)
    logit_multiplier: str | None = None
    #: config attribute for tanh soft-capping of the final logits (Gemma 2 and 3)
    logit_softcap: str | None = None
    #: the rotary module keeps a table per attention type and takes the type as an argument
    #: (Gemma 3, OLMo 3); None: told by the rotary module's signature
    rotary_per_layer_type: bool | None = None
    #: a mixture-of-experts family (for docs, the benchmark and init-random's shapes)
    moe: bool = False
    #: its blocks run tree steps exactly (``Block.forward(tree=)``; tests/integration/test_tree_block.py)
    trees: bool = False

    @property
    def generic(self) -> bool:
        return not self.tested

    def layer_types(self, config) -> list[str]:
        """The attention kind of every layer: the config's ``layer_types`` where it has them; else
        (Mistral, Mixtral, Starcoder2) every layer slides when a window is set, as their models'
        masks do."""
        types = getattr(config, "layer_types", None)
        if types:
            return list(types)
        kind = "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"
        return [kind] * config.num_hidden_layers

    def scale_embeddings(self, config, h: torch.Tensor) -> torch.Tensor:
        if self.embed_multiplier:
            h = h * getattr(config, self.embed_multiplier)
        return h

    def finish_logits(self, config, logits: torch.Tensor) -> torch.Tensor:
        if self.logit_multiplier:
            logits = logits * getattr(config, self.logit_multiplier)
        if self.logit_divisor:
            logits = logits / getattr(config, self.logit_divisor)
        cap = getattr(config, self.logit_softcap, None) if self.logit_softcap else None
        if cap is not None:
            logits = (logits / cap).tanh() * cap
        return logits

    def position_embeddings(self, rotary, hidden: torch.Tensor, position_ids: torch.Tensor,
                            layer_types: list[str]) -> dict[str, tuple]:
        """The (cos, sin) each attention type of this block uses."""
        per_type = self.rotary_per_layer_type
        if per_type is None:
            per_type = _takes_layer_type(type(rotary))
        if per_type:
            return {kind: rotary(hidden, position_ids, kind) for kind in set(layer_types)}
        shared = rotary(hidden, position_ids)
        return dict.fromkeys(set(layer_types), shared)


@functools.lru_cache(maxsize=None)
def _takes_layer_type(rotary_class) -> bool:
    """Whether a rotary embedding's forward takes the layer type (asked once per class: reading a
    signature costs more than the rest of a small decode step's rotary)."""
    return "layer_type" in inspect.signature(rotary_class.forward).parameters


_PROVEN = "greedy token-identical and logits within tolerance vs transformers, 1-3 peers (CI)"

FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llama", _PROVEN, trees=True),
    Family("mistral", _PROVEN),
    Family("qwen2", _PROVEN),
    Family("qwen3", _PROVEN),
    Family("gemma2", _PROVEN, logit_softcap="final_logit_softcapping"),
    Family("gemma3_text", _PROVEN, logit_softcap="final_logit_softcapping", rotary_per_layer_type=True),
    Family("phi3", _PROVEN),
    Family("olmo2", _PROVEN),
    Family("granite", _PROVEN, embed_multiplier="embedding_multiplier", logit_divisor="logits_scaling"),
    Family("mixtral", _PROVEN, moe=True),
    Family("qwen2_moe", _PROVEN, moe=True),
    Family("qwen3_moe", _PROVEN, moe=True),
    Family("gpt_oss", _PROVEN, moe=True),
    Family("deepseek_v3", _PROVEN, moe=True),
    Family("glm4_moe", _PROVEN, moe=True),
    # declared, run generically and checked at first load (no CI test of their own)
    Family("cohere", logit_multiplier="logit_scale"),
    Family("cohere2", logit_multiplier="logit_scale"),
    Family("cohere2_moe", logit_multiplier="logit_scale"),
    Family("vaultgemma", logit_softcap="final_logit_softcapping"),
)}


def family_for(raw_config: dict) -> Family:
    """The adapter for a checkpoint's config, or CheckpointError with a one-line reason."""
    model_type = raw_config.get("model_type", "")
    if not isinstance(model_type, str) or not model_type:
        raise CheckpointError("config.json has no model_type")
    if model_type in FAMILIES:
        family = FAMILIES[model_type]
    else:
        from transformers.models.auto.modeling_auto import (
            MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        )

        if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            raise CheckpointError(f"model_type {model_type!r} is not supported: the installed transformers has "
                                  f"no causal language model for it (supported: {', '.join(FAMILIES)})")
        family = Family(model_type)
    odd = sorted({t for t in raw_config.get("layer_types") or [] if t not in KNOWN_LAYER_TYPES})
    if odd:
        raise CheckpointError(f"model_type {model_type!r} is not supported: its layers use "
                              f"{', '.join(map(repr, odd))}, and a block masks only {', '.join(KNOWN_LAYER_TYPES)}")
    if raw_config.get("use_bidirectional_attention"):
        raise CheckpointError(f"model_type {model_type!r} is not supported with use_bidirectional_attention "
                              "(a block runs causal attention only)")
    return family
