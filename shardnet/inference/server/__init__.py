"""The compute peer: serving a block of layers to sessions, placement, the block scheduler, KV budget, claims.

Never imported by ``inference/client`` (tests/unit/test_layering.py)."""
