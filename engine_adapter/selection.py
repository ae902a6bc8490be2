"""What a reuse policy tells the loop, and what it sees of it: the plug-in interface.

A policy states its passes (`Pass`: which chunks are served from stored KV, which rows run
layer 0, and a `Selection`, the choice of rows per layer). Per layer the loop shows the
selection a read-only `LayerView` (the rows, the candidates, the layout) and asks it:

    choice(view)   keep only this many of the candidates (the rows of reused chunks still
                   computed), those whose K/V deviate most from the stored (CacheBlend §4.3);
                   the step makes the choice inside the layer (`step.Choice`)
    wants(view)    what the layer's attention should return: the question's reads of each
                   key (`reads`), the question rows' attention mass per segment (`mass`)
    seen(view, s)  what the step returned that it asked for (`Seen`)
    drop(view)     prompt rows that stop after this layer (with their chunks' KV as stored)
    finish(view)   once the pass ends

A pass may also carry a change of how some rows read the keys (`Rescale`: APE's attention
temperature and scale, `policies.ape`).

A selection never writes the loop's state and imports nothing private of it; every default
changes nothing. Plug-ins: `policies.cacheblend` (HKVD), `policies.cachecraft` (Alg. 1),
`policies.default` (the question pass and the chunk heads).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from torch import Tensor

from engine_adapter.prompt import Layout


@dataclass(frozen=True)
class Wants:
    reads: bool = False  # the question's reads of each key, summed over heads and question rows
    mass: bool = False  # the question rows' attention mass per segment


@dataclass(frozen=True)
class Seen:
    """What one layer step showed a selection (what it asked for; the rest None)."""

    rows: Tensor  # [R] the prompt rows that ran the layer's attention
    h: Tensor  # [R, d] their hidden states after it
    qkv: Tensor  # [Hq+2Hkv, R0, D] pre-RoPE q/k/v heads of the rows whose K/V the layer wrote (`rows_in`)
    rows_in: Tensor  # [R0] those rows
    kv_heads: int
    deviation: Tensor | None = None  # [C] with a choice: each candidate's deviation
    cand: Tensor | None = None  # [C] with a choice: the candidates, indices into `rows_in`
    mass: Tensor | None = None  # [Q, S] the question rows' attention mass per segment (`Wants.mass`)

    @property
    def candidates(self) -> Tensor:
        """[C] with a choice: the candidates' prompt rows."""
        return self.rows_in.index_select(0, self.cand)

    @property
    def k(self) -> Tensor:
        """[Hkv, R0, D] pre-RoPE k of `rows_in` (a view)."""
        return self.qkv[-2 * self.kv_heads:-self.kv_heads]

    @property
    def v(self) -> Tensor:
        return self.qkv[-self.kv_heads:]


class LayerView:
    """The loop as a selection may see it at one layer: read-only."""

    def __init__(self, layout: Layout, layer: int, num_layers: int, rows: Callable[[], tuple[int, ...]],
                 candidates: int, reused_tokens: int, live: Sequence[int], question: Sequence[int]):
        self.layout, self.layer, self.num_layers = layout, layer, num_layers
        self._rows = rows
        self.candidates = candidates  # rows of reused chunks still served from stored KV, computed now
        self.reused_tokens = reused_tokens  # tokens of the chunks the pass reuses
        self.live = tuple(live)  # segments still served from stored KV
        self.question = tuple(question)  # the question's rows (the last row where the prompt has none)

    @property
    def rows(self) -> tuple[int, ...]:
        """The rows computed now, sorted (on the host: a read of the device only where a choice
        made them there)."""
        return self._rows()


class Selection:
    """A pass's choice of rows, per layer (the module docstring). Each default changes nothing."""

    def choice(self, view: LayerView) -> int | None:
        return None

    def wants(self, view: LayerView) -> Wants:
        return Wants()

    def seen(self, view: LayerView, seen: Seen) -> None:
        pass

    def drop(self, view: LayerView) -> Sequence[int]:
        return ()

    def finish(self, view: LayerView, reads: Tensor | None) -> None:
        """reads: [N] what the question read of each key over the layers it asked (None: none)."""


class Selections(Selection):
    """Several selections as one: the first choice that is not None, every want, every drop."""

    def __init__(self, parts: Sequence[Selection]):
        self.parts = list(parts)

    def choice(self, view: LayerView) -> int | None:
        return next((c for p in self.parts if (c := p.choice(view)) is not None), None)

    def wants(self, view: LayerView) -> Wants:
        ws = [p.wants(view) for p in self.parts]
        return Wants(reads=any(w.reads for w in ws), mass=any(w.mass for w in ws))

    def seen(self, view: LayerView, seen: Seen) -> None:
        for p in self.parts:
            p.seen(view, seen)

    def drop(self, view: LayerView) -> Sequence[int]:
        return sorted({r for p in self.parts for r in p.drop(view)})

    def finish(self, view: LayerView, reads: Tensor | None) -> None:
        for p in self.parts:
            p.finish(view, reads)


@dataclass(frozen=True)
class Carry:
    """Rows an earlier pass over the same stored KV computed through layer 0: they join at
    layer 1 (their layer-0 K/V do not depend on a chunk's prefix)."""

    rows: Tensor  # [R] sorted prompt rows
    h: Tensor  # [R, d] their hidden states after layer 0
    k: Tensor  # [Hkv, R, D] their layer-0 K (RoPE-free: the merge rotates it with the stored K)
    v: Tensor  # [Hkv, R, D]


MIN_TEMPERATURE = 0.01  # APE's T at least (its default 0.9): far below, the logits over T overflow fp32


@dataclass(frozen=True)
class Rescale:
    """APE's attention of the query over chunks encoded in parallel (Yang et al., "APE: Faster
    and Longer Context-Augmented Generation via Adaptive Parallel Encoding", ICLR 2025):
    the keys split in two groups, those of the chunks encoded apart (`keys`) and the rest (the
    shared prefix, the query). Within the chunks' group the logits are divided by the
    temperature T (sharper); the group's total weight is the softmax of the two groups'
    log-sum-exps with the chunks' taken as T lse(s/T) + log S (S: the scale), the rest's as
    usual. T = S = 1 is plain attention."""

    temperature: float
    scale: float
    keys: Tensor  # [N] bool over the cache's rows: the keys of the chunks encoded apart (past N: none)
    rows: Tensor | None = None  # the prompt rows that read this way, sorted (None: every row of the step)

    def __post_init__(self) -> None:
        if not MIN_TEMPERATURE <= self.temperature <= 1.0:
            raise ValueError(f"temperature {self.temperature} outside [{MIN_TEMPERATURE}, 1]")
        if not self.scale > 0.0:
            raise ValueError(f"scale must be > 0, got {self.scale}")


@dataclass(frozen=True)
class Pass:
    """One pass over the layers, as a policy states it."""

    reused: Sequence[int]  # segments served from stored KV
    first: Sequence[int]  # prompt rows computed from layer 0 (the last row always is)
    selection: Selection = field(default_factory=Selection)
    depth: int | None = None  # layers run (None: every layer, then the logits)
    stats: bool = True  # fresh chunks' KV and statistics (the variants to store)
    hidden: Sequence[int] = ()  # rows whose keys this pass hides (placed past the prompt's end)
    # the rows read (nearly) every key: each layer's attention over every key in one call (the
    # question's rows, at the end of the prompt), not in runs of rows each over its keys
    whole: bool = False
    carry: Carry | None = None  # rows computed through layer 0 already (they join at layer 1)
    # layer -> (K post-RoPE, V) an earlier pass merged over the same stored KV, every row it
    # computed at that layer among this pass's: this pass writes its rows over it
    caches: Mapping[int, tuple[Tensor, Tensor]] = field(default_factory=dict)
    rescale: Rescale | None = None  # some rows read the chunks encoded apart as APE does (eagerly: no static step)


__all__ = ["Carry", "LayerView", "Pass", "Rescale", "Seen", "Selection", "Selections", "Wants"]
