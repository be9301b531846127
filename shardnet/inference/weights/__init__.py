"""Model weights over the swarm: the local cache the swarm fills (store), the weights protocol's
two ends (server, fetcher), model cards in the DHT (cards), and what commands call (swarm_model)."""
