"""Tools for tests, benchmarks and interop runs: local swarms of real processes, the NAT lab."""
