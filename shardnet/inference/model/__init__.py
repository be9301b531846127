"""What a model is, independent of the network: checkpoints, families, blocks of layers, the
client's head, quantization, static decoders, wire dtypes, tiny random models."""

import logging

# transformers imports torchao when it is installed (it is: join --quantize), and torchao's import
# logs warnings meant for its own developers (torch's pytree deprecations, CUDA-only extensions
# that do not load on this build). They say nothing a user can act on and would clutter every
# CLI's stderr, so only their errors get through.
for _name in ("torch.utils._pytree", "torchao"):
    logging.getLogger(_name).setLevel(logging.ERROR)
