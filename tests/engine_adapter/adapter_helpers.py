"""Helpers for the engine_adapter tests: RAG-shaped prompts with stored variants."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_adapter import blend
from engine_adapter.blend import FreshChunk, blend_prefill
from engine_adapter.llama import LlamaEngine
from engine_adapter.policies.picks import QuestionReads
from engine_adapter.policy import Policy
from engine_adapter.probe import TRUSTED
from engine_adapter.prompt import Layout, Segment
from engine_adapter.source import InMemoryLayerSource, LayerSource
from kvkernels import apply_rope


def variant(engine: LlamaEngine, prefix: list[list[int]], chunk: list[int]) -> FreshChunk:
    """The stored variant of `chunk` computed behind `prefix` chunks (as a previous request made it)."""
    segs = [Segment(c) for c in prefix] + [Segment(chunk)]
    return blend_prefill(engine, segs, Policy("full"), InMemoryLayerSource({}), gate=TRUSTED).fresh[len(prefix)]


@dataclass
class Prompt:
    chunks: list[list[int]]
    question: list[int]
    cache: dict[int, FreshChunk]  # chunk index -> stored variant

    @property
    def tokens(self) -> torch.Tensor:
        return torch.tensor(sum(self.chunks, []) + self.question)

    def segments(self, recompute: float = 0.0) -> list[Segment]:
        """Every chunk cached; the plan recomputes the top `recompute` fraction by eq. 14."""
        out = []
        for i, c in enumerate(self.chunks):
            tia = torch.tensor(self.cache[i].stats.token_inter_attention)
            n = round(recompute * len(c))
            top = tia.topk(n).indices.tolist() if n else []
            out.append(Segment(c, cached=True, cached_prefix=self.cache[i].prefix, recompute=top))
        return out + [Segment(self.question, question=True)]

    def source(self, withhold=()) -> InMemoryLayerSource:
        return InMemoryLayerSource({i: v.kv for i, v in self.cache.items()}, withhold=withhold)


def make_prompt(engine: LlamaEngine, seed: int, *, behind: str = "other", n_chunks: int = 4,
                chunk_len: int = 24, question_len: int = 6) -> Prompt:
    """behind="other": each chunk cached behind an unrelated chunk (the usual RAG case);
    "same": cached behind exactly the chunks before it here (exact KV)."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(0, engine.cfg.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    chunks = [rand(chunk_len) for _ in range(n_chunks)]
    question = rand(question_len)
    if behind == "same":
        r = blend_prefill(engine, [Segment(c) for c in chunks], Policy("full"), InMemoryLayerSource({}),
                          gate=TRUSTED)
        cache = dict(r.fresh)
    else:
        cache = {i: variant(engine, [rand(chunk_len)], c) for i, c in enumerate(chunks)}
    return Prompt(chunks, question, cache)


def question_reads(engine: LlamaEngine, segments: list[Segment], source: LayerSource, deviation: bool = False,
                   layer_budget_s: float = 1.0, steps=None) -> QuestionReads:  # noqa: ANN001
    """The default policy's question pass alone, every cached chunk reused: what it measured
    (`steps`: on the engine's static steps, `graphs.StepGraphs`)."""
    lay = Layout.of(segments, engine.model_spec().fingerprint())
    reused = [s for s, seg in enumerate(segments) if seg.cached]
    return blend.question_reads(engine, lay, source, reused, deviation=deviation, layer_budget_s=layer_budget_s,
                                steps=steps)


def rel_dev(logits: torch.Tensor, ref: torch.Tensor) -> float:
    return float((logits - ref).norm() / ref.norm())


@torch.no_grad()
def reference_shallow_rows(engine, p, depth: int) -> tuple[torch.Tensor, list]:
    """Plain torch: every row through layers 0..depth-1 as in full prefill, then the question's
    rows alone over the chunks' stored KV (K rotated to their rows). The last row's logits
    and, per layer, K (rotated) and V of every row."""
    c = engine.cfg
    g = c.num_heads // c.num_kv_heads
    n_ctx = sum(map(len, p.chunks))
    starts = [sum(map(len, p.chunks[:i])) for i in range(len(p.chunks))]
    rows = torch.arange(len(p.tokens))
    h = engine.embed(torch.as_tensor(p.tokens))
    kv = []
    for layer in range(c.num_layers):
        q, k, v = engine.qkv_heads(layer, h).split([c.num_heads, c.num_kv_heads, c.num_kv_heads])
        q, k = apply_rope(q, rows, engine.rope), apply_rope(k, rows, engine.rope)
        if layer >= depth:
            stored = [p.cache[i].kv[layer] for i in range(len(p.chunks))]
            k = torch.cat([apply_rope(sk, torch.arange(s, s + sk.shape[1]), engine.rope)
                           for (sk, _), s in zip(stored, starts)] + [k], dim=1)
            v = torch.cat([sv for _, sv in stored] + [v], dim=1)
        kv.append((k, v))
        s = (q @ k.repeat_interleave(g, 0).transpose(1, 2)) * engine.scale
        s = s.masked_fill(torch.arange(k.shape[1])[None, None, :] > rows[None, :, None], float("-inf"))
        h = engine.layer_out(layer, h, s.softmax(-1) @ v.repeat_interleave(g, 0))
        if layer == depth - 1:  # the chunks' rows stop here
            rows, h = rows[n_ctx:], h[n_ctx:]
    return engine.logits(h[-1:])[-1], kv
