"""The two models simulated, by their published architectures, and what one decode step of a span
costs on a GPU (a roofline: weights read once per step, FLOPs per token).

- ``llama-70b``: Llama 3 70B (Meta's model card and config: 80 layers, hidden 8192, 64 query and
  8 key/value heads of 128, MLP 28672).
- ``deepseek-v3``: DeepSeek-V3 (arXiv:2412.19437 and its config: 61 layers, the first 3 dense
  with MLP 18432, then 256 routed experts of 2048 and 1 shared, 8 routed per token; hidden 7168;
  multi-head latent attention with a 512 + 64 wide KV cache per token and layer).

Both are served quantized to 4 bits (4.5 bits a parameter with group scales; an assumption: what
owners of 10-32 GB cards run these models in; ``shardnet join --quantize int4``).
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.swarm_sim.world import BANDWIDTH_EFFICIENCY, FLOPS_EFFICIENCY, Gpu

BYTES_PER_PARAM = 4.5 / 8
KV_BYTES = 2  # float16 cache


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    #: parameters per layer that every token reads (attention, dense MLP or shared expert)
    dense_params: tuple[int, ...]
    #: routed experts per layer (0: a dense layer), parameters per expert, experts per token
    experts: tuple[int, ...]
    expert_params: int
    experts_per_token: int
    #: KV cache bytes per token and layer
    kv_bytes_per_token: int

    def layer_bytes(self, layer: int) -> int:
        return int((self.dense_params[layer] + self.experts[layer] * self.expert_params) * BYTES_PER_PARAM)

    def layer_sizes(self) -> list[int]:
        return [self.layer_bytes(i) for i in range(self.num_layers)]

    def total_bytes(self) -> int:
        return sum(self.layer_sizes())

    def step_seconds(self, gpu: Gpu, start: int, end: int, batch: int) -> float:
        """One decode step of ``batch`` sessions (one token each) through layers start:end: the
        weights the step touches read once at the achieved bandwidth, plus the FLOPs of every
        token at the achieved tensor throughput. A mixture-of-experts layer reads only the
        experts the batch's tokens were routed to: E * (1 - (1 - k/E)^batch) of them when routing
        is uniform (it is balanced by design in DeepSeek-V3)."""
        read = 0.0
        flops = 0.0
        for layer in range(start, end):
            e = self.experts[layer]
            touched = e * (1 - (1 - self.experts_per_token / e) ** batch) if e else 0.0
            read += (self.dense_params[layer] + touched * self.expert_params) * BYTES_PER_PARAM
            active = self.dense_params[layer] + (self.experts_per_token * self.expert_params if e else 0)
            flops += 2 * active * batch
        return (read / (gpu.bandwidth_gbs * 1e9 * BANDWIDTH_EFFICIENCY)
                + flops / (gpu.tflops * 1e12 * FLOPS_EFFICIENCY))

    def prefill_seconds(self, gpu: Gpu, start: int, end: int, tokens: int) -> float:
        """A prompt of ``tokens`` through start:end in one pass (compute bound)."""
        return self.step_seconds(gpu, start, end, max(1, tokens))


def _llama_70b() -> ModelSpec:
    h, inter, heads, kv_heads, hd = 8192, 28672, 64, 8, 128
    attn = h * heads * hd * 2 + h * kv_heads * hd * 2
    mlp = 3 * h * inter
    return ModelSpec("llama-70b", 80, (attn + mlp,) * 80, (0,) * 80, 0, 0, kv_heads * hd * 2 * KV_BYTES)


def _deepseek_v3() -> ModelSpec:
    h, heads = 7168, 128
    q_lora, kv_lora, rope, nope, v = 1536, 512, 64, 128, 128
    attn = (h * q_lora + q_lora * heads * (nope + rope) + h * (kv_lora + rope)
            + kv_lora * heads * (nope + v) + heads * v * h)
    dense_mlp = 3 * h * 18432
    expert = 3 * h * 2048
    router = h * 256
    dense = tuple(attn + dense_mlp if i < 3 else attn + expert + router for i in range(61))
    experts = tuple(0 if i < 3 else 256 for i in range(61))
    return ModelSpec("deepseek-v3", 61, dense, experts, expert, 8, (kv_lora + rope) * KV_BYTES)


MODELS = {m.name: m for m in (_llama_70b(), _deepseek_v3())}
