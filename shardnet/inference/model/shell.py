"""The family's transformers model built on the meta device, filled in one part at a time.

Building ``AutoModelForCausalLM.from_config`` on the meta device allocates nothing, yet gives
every module transformers would build for the checkpoint (the decoder layer of each index, dense
or sparse; its experts, grouped the way transformers groups them; the norms and the rotary
tables) and picks the attention and experts implementations ``from_pretrained`` would pick.
A block or head then loads just its tensors into it through transformers' own key conversion
(the one ``from_pretrained`` applies: per-expert checkpoint tensors stacked into grouped expert
weights, renamed keys, fp32-kept modules), and takes the modules it needs; the rest stays on
meta and is dropped with the shell.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading

import torch

from shardnet.errors import CheckpointError
from shardnet.inference.model.checkpoint import Checkpoint
from shardnet.inference.model.formats import to_stored
from shardnet.inference.model.stored import stored_nbytes

log = logging.getLogger(__name__)

_BUILD_LOCK = threading.Lock()


@contextlib.contextmanager
def _quiet_transformers():
    """transformers draws a progress bar per load; shardnet reports progress itself."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


class ModelShell:
    def __init__(self, ckpt: Checkpoint, dtype: torch.dtype, config=None) -> None:
        """A shell whose parameters are ``dtype`` (those transformers keeps in float32 aside);
        ``config``: the checkpoint's own unless given (the family check builds a one-layer model)."""
        from transformers import AutoModelForCausalLM

        self.ckpt = ckpt
        # from_config writes its dtype into the config: build from a copy
        config = copy.deepcopy(config or ckpt.config)
        if ckpt.quant is not None:
            # kept as stored and computed from as any weight (formats.py, stored.py): the model is
            # built as the unquantized one
            del config.quantization_config
        try:
            # from_config sets torch's process-wide default dtype while it builds, and blocks
            # load in worker threads: one build at a time
            with _BUILD_LOCK, torch.device("meta"), _quiet_transformers():
                self.model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        except (ValueError, TypeError, KeyError, AttributeError, NotImplementedError) as e:
            raise CheckpointError(f"model_type {ckpt.model_type!r}: transformers cannot build it from "
                                  f"{ckpt.path.name}/config.json: {_one_line(e)}") from None
        self.config = self.model.config
        self.dtype = dtype
        self.base = getattr(self.model, self.model.base_model_prefix, None)
        missing = [part for part in ("layers", "embed_tokens", "norm", "rotary_emb")
                   if not hasattr(self.base, part)]
        if missing:
            raise CheckpointError(f"model_type {ckpt.model_type!r} is not supported: its transformers model has no "
                                  f"{', '.join(missing)} (a block needs the standard model.layers stack)")

    def load(self, names: list[str], *, device: str) -> int:
        """Load the checkpoint tensors ``names`` into the shell (converted as transformers
        would); returns the bytes they take on the device."""
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig

        tensors = to_stored(self.ckpt.quant, self.ckpt.load(names, device=device), self.dtype)
        config = LoadStateDictConfig(dtype=self.dtype, dtype_plan=self.model._get_dtype_plan(self.dtype),
                                     weight_mapping=get_model_conversion_mapping(self.model),
                                     device_map={"": device})
        with _quiet_transformers():
            info, _ = convert_and_load_state_dict_in_model(self.model, tensors, config)
        bad = sorted(info.unexpected_keys) or sorted(info.mismatched_keys) or sorted(info.conversion_errors)
        if bad:
            raise CheckpointError(f"{self.ckpt.path.name}: tensor {bad[0]} does not fit the {self.ckpt.model_type} "
                                  f"model transformers builds from config.json")
        return sum(stored_nbytes(t) for t in tensors.values())

    def take(self, module: torch.nn.Module, prefix: str, device: str) -> torch.nn.Module:
        """``module`` (a part of the shell, named ``prefix``) ready to run: its non-persistent
        buffers (rotary tables, embedding scales) computed the way transformers initializes them,
        and every parameter loaded."""
        for sub in module.modules():
            meta = [n for n, b in sub.named_buffers(recurse=False) if b.is_meta]
            if meta:
                for n in meta:
                    sub._buffers[n] = torch.empty_like(sub._buffers[n], device=device)
                # loaded parameters are marked initialized, so only the buffers are computed
                self.model._init_weights(sub)
        unloaded = [n for n, p in module.named_parameters() if p.is_meta]
        if unloaded:
            raise CheckpointError(f"{self.ckpt.path.name} has no tensor for {prefix}{unloaded[0]} "
                                  f"(the {self.ckpt.model_type} model transformers builds needs it)")
        return module.eval()


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text[:300] or type(e).__name__
