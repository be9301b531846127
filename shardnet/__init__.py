"""shardnet: a peer-to-peer overlay that runs language models too large for any one machine.

    async with shardnet.open_node(shardnet.NodeConfig(bootstrap=[...])) as node:
        ...
"""

__version__ = "0.1.0"

from .transport import Node, NodeConfig, ShardnetError, Stream, open_node  # noqa: E402

__all__ = ["Node", "NodeConfig", "ShardnetError", "Stream", "open_node", "__version__"]
