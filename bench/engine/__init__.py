"""Benchmarks of the engine side: time to first token, the per-layer timeline, the blend
loop's static steps, the Triton kernels on a GPU."""
