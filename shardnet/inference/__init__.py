"""Model loading, block execution, KV cache, generation: a consumer of the overlay."""
