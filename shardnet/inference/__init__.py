"""Model loading, block execution, KV cache, generation: a consumer of the overlay.

The only layer that imports torch (tests/unit/test_layering.py).
"""

import os

# A compute peer waits on the network between forwards. OpenMP's default spin-wait keeps its idle
# threads burning the cores that the next hop (or the client) needs on a shared machine:
# measured through 3 local peers, 4.9 ms per hop with spinning, 1.7 ms without. Must be set
# before torch is imported; an explicit setting in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
