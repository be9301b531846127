"""Layer layouts: how a model's layers are split over peers."""

from shardnet.errors import ShardnetError


def split_layers(num_layers: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous, nearly equal ranges covering 0..num_layers."""
    if not 1 <= parts <= num_layers:
        raise ShardnetError(f"cannot split {num_layers} layers over {parts} peers")
    bounds = [round(i * num_layers / parts) for i in range(parts + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(parts)]
