"""A small causal LM run over a preallocated KV cache, for the client's draft model.

Drafting is a loop of single-token forward passes whose cost, for a small draft, is mostly
per-call overhead: Python, kernel launches and the growth of a dynamic cache. Here the cache is
two fixed tensors per layer and the write position is a 0-d tensor on the model's device, so
one decode step has fixed shapes and no host decision in it. On CUDA that step is captured once
in a CUDA graph and replayed; rolling the cache back after rejected drafts is a ``fill_`` of the
position tensor, which the graph reads on every replay. Entries past the position stay in memory
but are masked out and overwritten by the next write. On CPU the same code runs eagerly.

The layers, norms and rotary tables are the Hugging Face model's own modules and buffers, so any
llama-family model (llama, mistral, qwen2, qwen3) loads the way it always does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardnet.errors import ShardnetError

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")


class UnsupportedModel(ShardnetError, ValueError):
    """The model cannot run on the static-cache decoder (its family, its attention, its device)."""

    code = "unsupported_model"


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class StaticKVDecoder:
    """``model``: a transformers ``*ForCausalLM`` of a supported family, already on its device.

    ``feed(tokens)`` appends tokens at the current position and returns the logits of the last;
    ``step(token)`` does the same for one token given as a device tensor (graphed on CUDA);
    ``rollback(n)`` forgets everything from position n on.
    """

    def __init__(self, model, max_len: int, *, cuda_graph: bool | None = None) -> None:
        cfg = model.config
        if cfg.model_type not in SUPPORTED:
            raise UnsupportedModel(f"no static-cache decoder for model type {cfg.model_type!r}")
        if "sliding_attention" in (getattr(cfg, "layer_types", None) or []):
            raise UnsupportedModel("sliding-window attention layers are not supported")
        window = getattr(cfg, "sliding_window", None) if cfg.model_type == "mistral" else None
        self.max_len = min(max_len, window) if window else max_len
        self.model = model
        inner = model.model
        self.embed, self.layers, self.norm = inner.embed_tokens, inner.layers, inner.norm
        weight = self.embed.weight
        self.device, dtype = weight.device, weight.dtype
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        kv_heads = cfg.num_key_value_heads
        shape = (len(self.layers), 1, kv_heads, self.max_len, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        slots = torch.arange(self.max_len, device=self.device)
        cos, sin = inner.rotary_emb(self.k_cache[0], slots[None])
        self.cos, self.sin = cos[0], sin[0]  # [max_len, head_dim]
        self.slots = slots
        #: the write position; lives on the device so a captured graph sees rollbacks
        self.position = torch.zeros((), dtype=torch.long, device=self.device)
        self.length = 0  # its host-side mirror, for bounds checks without a device sync
        self.graph = None
        if cuda_graph is None:
            cuda_graph = self.device.type == "cuda"
        if cuda_graph:
            if self.device.type != "cuda":
                raise UnsupportedModel("CUDA graphs need the model on a CUDA device")
            self._capture()

    # -- the computation ----------------------------------------------------------------------

    def _forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: [T] on the device. Writes T cache entries, advances the position, returns
        logits [T, vocab]. Free of host synchronisation, so it can be captured."""
        t = tokens.shape[0]
        pos = self.position + torch.arange(t, device=self.device)
        visible = self.slots[None, :] <= pos[:, None]  # [T, max_len]: causal, and hides stale slots
        cos = self.cos.index_select(0, pos)[None, None]
        sin = self.sin.index_select(0, pos)[None, None]
        x = self.embed(tokens)[None]
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(1, t, -1, self.head_dim)
            k = attn.k_proj(h).view(1, t, -1, self.head_dim)
            if hasattr(attn, "q_norm"):  # qwen3 normalises each head's query and key
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            v = attn.v_proj(h).view(1, t, -1, self.head_dim).transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            self.k_cache[i].index_copy_(2, pos, k)
            self.v_cache[i].index_copy_(2, pos, v)
            o = F.scaled_dot_product_attention(q, self.k_cache[i], self.v_cache[i], attn_mask=visible,
                                               scale=attn.scaling, enable_gqa=True)
            x = x + attn.o_proj(o.transpose(1, 2).reshape(1, t, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        self.position.add_(t)
        return self.model.lm_head(self.norm(x))[0]

    def _capture(self) -> None:
        self.graph_input = torch.zeros(1, dtype=torch.long, device=self.device)
        start = self.position.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(3):  # warm-up outside the graph: lazy initialisation, autotuning
                self._forward(self.graph_input)
                self.position.copy_(start)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), torch.inference_mode():
            self.graph_output = self._forward(self.graph_input)
        self.position.copy_(start)
        self.graph = graph

    # -- the interface ------------------------------------------------------------------------

    def _reserve(self, n: int) -> None:
        if self.length + n > self.max_len:
            raise OverflowError(f"the draft cache holds {self.max_len} tokens; {self.length + n} needed")
        self.length += n

    @torch.inference_mode()
    def feed(self, tokens: list[int]) -> torch.Tensor:
        """Append ``tokens``; logits [vocab] after the last one."""
        if not tokens:
            raise ValueError("nothing to feed")
        if len(tokens) == 1 and self.graph is not None:
            return self.step(torch.tensor(tokens, device=self.device)[0])
        self._reserve(len(tokens))
        return self._forward(torch.tensor(tokens, device=self.device))[-1]

    @torch.inference_mode()
    def step(self, token: torch.Tensor) -> torch.Tensor:
        """Append one token given as a 0-d device tensor (no host sync); logits [vocab]. Under a
        graph the result is a static buffer, valid until the next step."""
        self._reserve(1)
        if self.graph is None:
            return self._forward(token.reshape(1))[-1]
        self.graph_input.copy_(token.reshape(1))
        self.graph.replay()
        return self.graph_output[-1]

    def rollback(self, length: int) -> None:
        """Forget every position from ``length`` on."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: the cache holds {self.length}")
        self.length = length
        self.position.fill_(length)
