"""A compute peer that cheats, for tests: ``python cheating_peer.py MODE <shardnet arguments>``.

MODE ``perturb:EPS`` scales every output of its block by (1 + EPS): activations slightly wrong,
the same way every time (like a quantised or corrupted copy of the weights). MODE ``boost:TOKEN``
(with --hold-head) makes TOKEN the largest logit of every row it returns: it picks the tokens.
Either way it claims a throughput far above anyone else's (1e6 tokens/s), which drew every route
before clients weighed claims against what they observed (shardnet/inference/client/peer_speeds.py);
tests now put it in the first chain themselves.
"""

import sys
from pathlib import Path

mode, arg = sys.argv.pop(1).split(":")

import shardnet.inference.server.compute_peer as peer  # noqa: E402
from shardnet.inference.model.block import Block, Head  # noqa: E402

peer.measure_throughput = lambda block, *a, **kw: 1e6

if mode == "perturb":
    honest_forward = Block.forward

    def forward(self, hidden, cache, start_pos):
        return honest_forward(self, hidden, cache, start_pos) * (1 + float(arg))

    Block.forward = forward
elif mode == "boost":
    honest_logits = Head.logits

    def logits(self, hidden):
        out = honest_logits(self, hidden).clone()  # (a normal tensor: in-place writes allowed)
        out[..., int(arg)] = out.max(-1).values + 1.0
        return out

    Head.logits = logits
else:
    raise SystemExit(f"unknown mode {mode!r}")

from shardnet.cli import main  # noqa: E402

main()
