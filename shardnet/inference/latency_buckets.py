"""The histogram buckets every step-latency metric shares, so a client's chain round trips and
each hop's share of them can be compared bucket for bucket: from a few milliseconds (a small
block on a LAN) to seconds (a long prefill, or a relayed hop across continents)."""

STEP_BUCKETS = (0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
