"""HTTP front ends to a swarm: an OpenAI-compatible API (``shardnet serve``)."""
