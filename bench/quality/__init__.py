"""Answer-quality benchmark: a synthetic multi-hop RAG task and a small
Llama trained on it, to measure whether chunk-KV reuse keeps answers right.

- ``kvbench.quality.data``: seeded (chunks, question, answer) generator, splits.
- ``kvbench.quality.modeling``: tokenizer, config, ``load()`` of the committed model.
- ``kvbench.quality.train``: CPU training script that writes ``model/``.
- ``kvbench.quality.naive_check``: full prefill vs naive per-chunk KV reuse.

Submodules are imported on demand: ``data`` needs no torch.
"""
