"""shardnet: a peer-to-peer overlay that runs language models too large for any one machine.

    async with shardnet.open_node(shardnet.NodeConfig(bootstrap=[...])) as node:
        ...

    model = shardnet.DistributedModelForCausalLM.from_pretrained("tiny-llama", bootstrap=[...])
    model.generate(input_ids, max_new_tokens=32)   # as transformers' generate, synchronous
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._version import __version__

__all__ = ["DistributedModelForCausalLM", "Node", "NodeConfig", "ShardnetError", "Stream", "open_node",
           "__version__"]

if TYPE_CHECKING:
    from .errors import ShardnetError
    from .inference.client.hf_model import DistributedModelForCausalLM
    from .transport import Node, NodeConfig, Stream, open_node

# Names resolved on first use, so that importing a light subpackage (shardnet.protocols, shardnet.errors)
# does not load py-libp2p through shardnet.transport.
_LAZY = {
    "Node": "shardnet.transport",
    "NodeConfig": "shardnet.transport",
    "Stream": "shardnet.transport",
    "open_node": "shardnet.transport",
    "ShardnetError": "shardnet.errors",
    "DistributedModelForCausalLM": "shardnet.inference.client.hf_model",  # loads torch
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
