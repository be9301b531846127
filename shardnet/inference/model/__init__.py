"""What a model is, independent of the network: checkpoints, blocks of layers, the client's head,
static decoders, wire dtypes, tiny random models."""
