import os
import socket
import sys
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# The test models are tiny: one torch thread computes them faster than two that hand work to each
# other (and in-process peers, clients and test code share the machine's few cores).
import torch  # noqa: E402

torch.set_num_threads(1)

# A test never touches the user's real identity.
os.environ.setdefault("SHARDNET_IDENTITY", "/nonexistent/shardnet-test-identity.key")


def transformers_greedy(path, prompt: str, new: int) -> list[int]:
    """The ``new`` tokens plain single-process transformers generates greedily after ``prompt``:
    what every distributed run must reproduce."""
    from transformers import AutoModelForCausalLM
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(Path(path) / "tokenizer.json")).encode(prompt).ids
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def loopback_config():
    from shardnet.transport.config import NodeConfig

    def make(**kw):
        kw.setdefault("listen", ["/ip4/127.0.0.1/tcp/0"])
        kw.setdefault("dial_timeout", 5.0)
        return NodeConfig(**kw)

    return make


@asynccontextmanager
async def local_chain(loopback_config, path, ranges, **serve_kw):
    """A bootstrap, one node per layer range serving it, and a client node (all in this process);
    yields the client node once it has joined."""
    from shardnet.inference.peer import serve_block
    from shardnet.transport import open_node

    async with AsyncExitStack() as stack:
        boot = await stack.enter_async_context(open_node(loopback_config()))
        cfg = loopback_config(bootstrap=[str(boot.listen_addrs[0])])
        for a, b in ranges:
            peer = await stack.enter_async_context(open_node(cfg))
            await stack.enter_async_context(serve_block(peer, str(path), a, b, **serve_kw))
        client_node = await stack.enter_async_context(open_node(cfg))
        await client_node.wait_bootstrapped()
        yield client_node
