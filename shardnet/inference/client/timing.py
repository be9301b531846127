"""How long a client waits, in one place: the request path uses these, and the swarm simulator
(bench/swarm_sim) models healing and queueing with the same numbers (this module imports
nothing heavy, so the simulator runs without torch)."""

#: how long a request waits in line for a busy chain before failing "busy" (``session.open_session``)
QUEUE_TIMEOUT = 60.0
#: a chain whose peer failed: how long the probes that find the failed peer may take
PROBE_TIMEOUT = 3.0
#: how long a failure waits for a hop to name the peer after it that failed
NAMED_ERROR_WAIT = 1.0
