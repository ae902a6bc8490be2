"""What a prefill returns: `BlendResult` (the logits, the decode cache, what was reused and
computed, the new variants to store) with its per-layer `LayerTiming` and `FreshChunk`s."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable

from torch import Tensor

from kvcraft.records import VariantStats


@dataclass(frozen=True)
class LayerTiming:
    wait_s: float  # blocked in LayerSource.wait_layer
    compute_s: float  # everything else of the layer, catch-up included
    rotate_s: float = 0.0  # of compute_s: merging the stored K/V and rotating K
    attend_s: float = 0.0  # of compute_s: attention (and mass, reads) of the computed rows
    static: bool = False  # ran as the engine's static step (`graphs`; its attention not timed apart: 0);
    # the default policy's two passes: either of them


@dataclass(frozen=True)
class FreshChunk:
    """A chunk computed at every layer in this prompt: a new variant to store."""

    prefix: tuple[str, ...]  # keys of the chunks before it (the variant's prefix)
    kv: list[tuple[Tensor, Tensor]]  # per layer (K RoPE-free [Hkv,T,D], V [Hkv,T,D])
    later: Callable[[], VariantStats]  # its statistics, computed at the first read (`engine_adapter.stats`)

    @cached_property
    def stats(self) -> VariantStats:
        return self.later()


@dataclass
class BlendResult:
    logits: Tensor  # [V] at the last prompt position
    kv: list[tuple[Tensor, Tensor]]  # per layer merged (K post-RoPE [Hkv,N,D], V), ready for decode
    reuse: bool  # False: served without stored KV (policy full, no cached chunk, or the reuse gate said no)
    timings: list[LayerTiming] = field(default_factory=list)  # per layer; empty when served by engine.prefill
    computed_rows: list[int] = field(default_factory=list)  # rows computed per layer
    recomputed_rows: list[int] = field(default_factory=list)  # of those, rows of reused chunks
    reused_tokens: int = 0  # tokens of the chunks served from stored KV
    # Segment indices whose stored KV served the prefill to its end: the policy's reused
    # chunks (none with policy full, or when served by engine.prefill) less those that
    # fell back (computed from the start, `fallbacks`).
    reused_segments: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    fresh: dict[int, FreshChunk] = field(default_factory=dict)  # segment index -> new variant
    fallbacks: list[tuple[int, int]] = field(default_factory=list)  # (chunk, layer) computed instead
    focused: frozenset[int] | None = None  # Alg. 1 F* (segment indices), if decided
    focus_layer: int | None = None  # Alg. 1 L* (0-based), if decided
    logits_s: float = 0.0  # final norm + vocabulary projection
    last_hidden: Tensor | None = None  # [d] the last prompt row's final hidden state, before the final norm
    rows: Tensor | None = None  # rows computed at the last layer (with all_logits)
    row_logits: Tensor | None = None  # [len(rows), V] (with all_logits)

    @property
    def recompute_ratio(self) -> float:
        """Fraction of reused token-layers whose KV was recomputed (layer 0 included)."""
        if not self.reused_tokens or not self.recomputed_rows:
            return 0.0
        return sum(self.recomputed_rows) / (self.reused_tokens * len(self.recomputed_rows))

    @property
    def computed_share(self) -> float:
        """Fraction of the prompt's row-layers computed (every layer, question included):
        what sets the compute of a prefill; 1 / this is its ideal speed-up."""
        if not self.prompt_tokens or not self.computed_rows:
            return 1.0
        return sum(self.computed_rows) / (self.prompt_tokens * len(self.computed_rows))


__all__ = ["BlendResult", "FreshChunk", "LayerTiming"]
