"""Benchmarks of the service: planning, Plan latency, eviction and hit rate, reuse writes,
crash safety, Store/fetch throughput, concurrent load, the remote tier, the CRAFT front's order."""
