"""What the benchmarks share: synthetic RAG traces (workload), MuSiQue prompts and answer
metrics (musique), the real model's folder (realmodel: `kvcraft model fetch`), hosts simulated
with network namespaces (netns), vLLM engine processes (engines), timing and transfer rows (rows),
count arguments refused below their least (args)."""
