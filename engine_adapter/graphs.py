"""The layer step over static buffers, captured as CUDA graphs (docs/adapter.md, "Static steps").

On a GPU the blend loop is bound by the host: a layer's kernel launches and the Python
between them take longer than the kernels (docs/gpu.md). A step whose every tensor keeps its
shape and address from one request to the next can be captured once as a CUDA graph and
replayed for each request: one launch a layer. Shapes are fixed per `Bucket`: the prompt's
tokens rounded up to TOKENS_STEP, with at least one position past the prompt, and the
computed rows rounded up to ROWS_STEP. Padded rows write their K/V at the bucket's last
position, past every prompt row, so the position-causal mask hides it from every prompt row;
they see no key themselves (their attention output is 0, they read nothing), and their
results are never read.

This module holds buffers and graphs, no layer: what a graph captures is `step.layer_step`
itself (vLLM's CUDAGraphWrapper pattern: the runnable wrapped and replayed per key), so the
CPU, where the same step runs eagerly over the same buffers, checks the code CUDA replays.
`StaticStep.run` is the wrapper (capture at a key's first use, replay after, a failed or
wrong capture turns the static steps off: `StepFailed`); `StepGraphs` keeps the buckets (the
least recently used dropped first), leased by one prefill at a time (a second prefill on the
same engine at the same time, a fidelity shadow, runs eagerly instead of waiting). Which layer
runs here is decided in one place, `dispatch.StaticRunner.layer`.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import Tensor

from engine_adapter.llama import LlamaEngine, rope_for_spec
from engine_adapter.step import Choice, LayerCache, Rotation, Rows, Stepped, layer_step
from kvkernels import KeyReads, rope_tables

log = logging.getLogger(__name__)

TOKENS_STEP = 256  # a bucket's prompt tokens: a multiple of this
ROWS_STEP = 64  # a bucket's computed rows: a multiple of this
SEGMENTS_STEP = 8  # the attention mass's segments (a prompt's and one past it): a multiple of this
MAX_STEPS = 16  # buckets of rows kept, each with a graph per layer
MAX_CACHES = 2  # buckets of tokens kept, each with every layer's merged K and V


def _up(x: int, step: int) -> int:
    return -(-x // step) * step


@dataclass(frozen=True)
class Bucket:
    tokens: int  # > the prompt's tokens: position tokens - 1 is where padded rows write their K/V
    rows: int  # >= the computed rows
    rows_out: int = 0  # with a choice (`step.Choice`): >= the rows it keeps (0: none)


class Caches:
    """One bucket of tokens: every layer's merged cache, K post-RoPE and V [L, Hkv, N, D],
    one layer's stored K before its rotation, the RoPE tables of every position, the keys'
    positions in this prefill (`keys_at`), what rows read of each key (`reads`), the prompt's
    segments for the attention mass (`segments_of`), and zeros for the positions past a prompt."""

    def __init__(self, engine: LlamaEngine, tokens: int, pad: int):
        c = engine.cfg
        like = {"dtype": engine.dtype, "device": engine.device}
        self.tokens = tokens
        self.raw = torch.zeros(c.num_kv_heads, tokens, c.head_dim, **like)
        self.K = torch.zeros(c.num_layers, c.num_kv_heads, tokens, c.head_dim, **like)
        self.V = torch.zeros_like(self.K)
        self.pos = torch.arange(tokens, device=engine.device)
        self.rot = Rotation(*rope_tables(rope_for_spec(engine.model_spec()), self.pos), True)  # fp32 [N, D/2]
        self.key_pos = self.pos.clone()  # where the attention sees each key (`keys_at`)
        self.reads = KeyReads(tokens, engine.device)  # the default's question pass
        self.zeros = torch.zeros(c.num_kv_heads, pad, c.head_dim, **like)  # pad >= tokens - any prompt's n
        self.segments: dict[int, Tensor] = {}  # S' -> [S' + 1] key bounds (`segments_of`)

    def keys_at(self, pos: Tensor) -> None:
        """The prompt's keys at positions `pos` [n] for the attention (their prompt positions,
        or past the end where a pass hides them); the padding at its own."""
        self.key_pos.copy_(self.pos)
        self.key_pos[:pos.shape[0]].copy_(pos)

    def segments_of(self, bounds: Tensor, n: int) -> int:
        """The prompt's segment bounds [S + 1] (n tokens) as the attention mass's segments over
        the bucket's keys: the S segments, then empty ones at n, then one over the positions
        past the prompt, S' in all (S + 1 rounded up to SEGMENTS_STEP). Returns S'; the bounds
        are `segments[S']`."""
        S = bounds.shape[0] - 1
        size = _up(S + 1, SEGMENTS_STEP)
        if size not in self.segments:
            self.segments[size] = torch.full((size + 1,), self.tokens, dtype=torch.long, device=self.pos.device)
        out = self.segments[size]
        out[:S + 1].copy_(bounds)
        out[S + 1:size].fill_(n)
        return size

    def merge(self, layer: int, k: list[Tensor], v: list[Tensor], n: int) -> None:
        """Layer `layer`'s stored K (before its rotation) and V of a prompt of n tokens, given
        in prompt order as pieces [Hkv, t, D] (`merge.Merge.stored_pieces`), one concatenation each."""
        pad = self.zeros[:, :self.tokens - n]
        torch.cat([*k, pad], 1, out=self.raw)
        torch.cat([*v, pad], 1, out=self.V[layer])

    def layer(self, layer: int) -> LayerCache:
        return LayerCache(self.K[layer], self.V[layer], self.key_pos, self.raw, self.rot)


class StaticRows(Rows):
    """A bucket of rows as the step sees them: their cache rows in a buffer (the padded ones at
    the bucket's last position), and the positions and RoPE tables the step derives from them
    inside itself (`place`: a load is a copy of the rows and hidden states)."""

    def __init__(self, caches: Caches, rows: int, device: torch.device):
        self.caches, self.pad = caches, caches.tokens - 1
        half = caches.rot.cos.shape[1]
        buf = torch.full((rows,), self.pad, dtype=torch.long, device=device)
        cos, sin = (torch.empty(rows, half, dtype=torch.float32, device=device) for _ in range(2))
        super().__init__(buf, torch.full((rows,), -1, dtype=torch.long, device=device), Rotation(cos, sin, True), None)

    def load(self, rows: Tensor) -> None:
        R = rows.shape[0]
        self.rows[R:].fill_(self.pad)
        self.rows[:R].copy_(rows)

    def place(self) -> None:
        """Positions to the attention (a padded row at -1: it sees no key) and RoPE tables."""
        self.pos.copy_(self.rows).masked_fill_(self.rows == self.pad, -1)
        torch.index_select(self.caches.rot.cos, 0, self.rows, out=self.rot.cos)
        torch.index_select(self.caches.rot.sin, 0, self.rows, out=self.rot.sin)

    def index_of(self, prompt_rows: Tensor) -> Tensor:
        return torch.searchsorted(self.rows, prompt_rows)  # the rows change per prefill: no memo

    def computed(self, n: int) -> Tensor:
        return torch.zeros(n, dtype=torch.bool, device=self.rows.device).index_fill_(0, self.rows, True)  # (nor here)


class StaticStep:
    """One bucket of rows over a bucket of tokens: the rows' hidden states and the step over
    them (`run`); with `rows_out`, the step chooses which of them run on (`choose`), into a
    bucket of rows out (`rows_out`, `h_out`, `cand_out`, valid until the step runs again)."""

    def __init__(self, engine: LlamaEngine, caches: Caches, rows: int, rows_out: int = 0):
        c, dev = engine.cfg, engine.device
        self.e, self.caches = engine, caches
        self.h = torch.zeros(rows, c.hidden_size, dtype=engine.dtype, device=dev)
        self.rows = StaticRows(caches, rows, dev)
        self.choice: Choice | None = None
        if rows_out:
            self.cand = torch.zeros(rows, dtype=torch.long, device=dev)  # the candidates' slots among the rows
            self.counts = torch.zeros(2, dtype=torch.long, device=dev)  # candidates, and how many of them stay
            self.choice = Choice(self.cand, self.counts[0], self.counts[1], rows_out, self._after_choice)
            self.out_rows = StaticRows(caches, rows_out, dev)
            self.h_out = torch.zeros(rows_out, c.hidden_size, dtype=engine.dtype, device=dev)
            self.cand_out = torch.zeros(rows, dtype=torch.long, device=dev)
        # (layer, reads, segments: `Caches.segments_of`, 0 for no mass) -> what the step made, its graph
        self.out: dict[tuple[int, bool, int], Stepped] = {}
        self.graphs: dict[tuple[int, bool, int], torch.cuda.CUDAGraph] = {}
        self.pool = None  # the graphs' memory pool

    def load(self, rows: Tensor, h: Tensor) -> None:
        """Rows [R] (sorted prompt rows, R <= the bucket's) and their hidden states h [R, d];
        the spare slots padded (hidden states 0)."""
        R = rows.shape[0]
        self.rows.load(rows)
        self.h[R:].zero_()
        self.h[:R].copy_(h)

    def choose(self, cand: Tensor, keep: int) -> None:
        """Candidates `cand` [C] (indices into the loaded rows, in order), of which `keep` stay."""
        C = cand.shape[0]
        self.cand[C:].zero_()
        self.cand[:C].copy_(cand)
        self.counts[0].fill_(C)  # (not a copy from host memory: on CUDA that would wait for the stream)
        self.counts[1].fill_(keep)

    def _after_choice(self, kept: Tensor, real: Tensor, cand_out: Tensor) -> Rows:
        out = self.out_rows
        out.rows.copy_(torch.where(real, self.rows.rows.index_select(0, kept), out.pad))
        out.pos.copy_(torch.where(real, out.rows, -1))
        self.cand_out.copy_(cand_out)
        return out

    def after(self) -> Tensor:
        """The hidden states after the step (of the rows out, with a choice)."""
        return self.h if self.choice is None else self.h_out

    def run(self, layer: int, reads: bool = False, segments: int = 0) -> Stepped:
        """Layer `layer` of the loaded rows over the layer's stored K/V (`Caches.merge`): their
        hidden states after it in `after()`, their K/V written into the layer's cache, with
        `reads` what they read of each key added into `Caches.reads`, with `segments` (S' of
        `Caches.segments_of`) their attention mass per segment (valid until the layer runs
        again). CUDA: a graph replayed (captured at the key's first run)."""
        key = (layer, reads, segments)
        if self.h.device.type != "cuda":
            self.out[key] = self._step(*key)
        elif key in self.graphs:
            self.graphs[key].replay()
        else:
            self._capture(*key)
        return self.out[key]

    def _step(self, layer: int, reads: bool, segments: int) -> Stepped:
        """What a graph captures: the rows' positions and tables, then the layer step."""
        cc = self.caches
        self.rows.place()
        out = layer_step(self.e, layer, self.h, self.rows, cc.layer(layer), choice=self.choice,
                         segments=cc.segments[segments] if segments else None, reads=cc.reads if reads else None)
        self.after().copy_(out.h)
        return out

    def _capture(self, layer: int, reads: bool, segments: int) -> None:
        """Capture the step's graph and run it once: a warm-up run first (Triton compiles a
        kernel at its first launch, never inside a capture), then the capture, then a replay
        over the warm-up's inputs, which must give the warm-up's outputs (`replay_differs`).
        StepFailed (the step's inputs as they were) where the capture fails or its replay
        differs: the caller runs the layer eagerly."""
        h, read = self.h.clone(), self.caches.reads.save()
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                first = self._step(layer, reads, segments)
                eager = (self.after().clone(), first.qkv.clone(), None if first.mass is None else first.mass.clone())
            torch.cuda.current_stream().wait_stream(side)
            # The warm-up moved h on by a layer and added its reads; K and V it wrote again as they were.
            self.h.copy_(h)
            self.caches.reads.restore(read)
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                out = self._step(layer, reads, segments)
            graph.replay()
            wrong = replay_differs(eager, (self.after(), out.qkv, out.mass))
        except Exception as e:  # noqa: BLE001 - any failure of the capture: the eager step instead
            wrong = f"{type(e).__name__}: {e}"
        if wrong:
            self.h.copy_(h)
            self.caches.reads.restore(read)
            raise StepFailed(f"layer {layer}'s CUDA graph: {wrong}")
        self.out[layer, reads, segments] = out
        self.graphs[layer, reads, segments] = graph


class StepFailed(RuntimeError):
    """A static step's CUDA graph could not be captured, or its replay gave other outputs than
    the eager run of the same step."""


def replay_differs(eager: tuple[Tensor | None, ...], replayed: tuple[Tensor | None, ...]) -> str:
    """How a graph's replay differs from the eager run of the same step on the same inputs
    (hidden states, q/k/v heads, attention mass): "" where every output is within 1% of its
    largest value (the same kernels: at most a rounding apart, should the capture choose
    another GEMM algorithm); else which output, by how much."""
    for name, a, b in zip(("hidden states", "q/k/v", "attention mass"), eager, replayed):
        if a is None:
            continue
        diff, scale = (a.float() - b.float()).abs().max().item(), a.float().abs().max().item()
        if not diff <= 0.01 * scale:  # NaN too
            return f"its replay's {name} differ from the eager run's by {diff:.3g} (largest {scale:.3g})"
    return ""


class StepGraphs:
    """A model's static steps: buckets of tokens (`Caches`) and of rows (`StaticStep`), least
    recently used dropped first, leased by one prefill at a time. Made for an engine on its
    Triton kernels (CUDA, or the interpreter in tests)."""

    def __init__(self, engine: LlamaEngine, tokens_step: int = TOKENS_STEP, rows_step: int = ROWS_STEP):
        if not engine.triton:
            raise ValueError("static steps need the engine's Triton kernels (triton=True; by default on CUDA)")
        self.e = engine
        self.failed = ""  # why the static steps are off for good (`fail`), "" while they are on
        self._oom_said = False  # `out_of_memory` warned once
        self.tokens_step, self.rows_step = tokens_step, rows_step
        self._caches: collections.OrderedDict[int, Caches] = collections.OrderedDict()
        self._steps: collections.OrderedDict[Bucket, StaticStep] = collections.OrderedDict()
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def lease(self) -> Iterator[bool]:
        """Whether this prefill has the static steps (False: another prefill has them now, or
        they failed)."""
        got = not self.failed and self._lock.acquire(blocking=False)
        try:
            yield got
        finally:
            if got:
                self._lock.release()

    def fail(self, error: StepFailed) -> None:
        """A step failed (`StaticStep.run`): the engine's prefills run eagerly from now on,
        said once in the log; the buffers and graphs are dropped."""
        self.failed = str(error)
        self._drop()
        log.warning("static steps off for this engine, prefills run eagerly: %s", error)

    def out_of_memory(self, n: int, error: Exception) -> None:
        """The device had no memory for a bucket's buffers (`caches`, `step`): the buckets kept
        are dropped, so the memory goes back to the prefill, which runs eagerly from there; a
        later prefill allocates afresh. Said once in the log, then at debug level."""
        self._drop()
        (log.debug if self._oom_said else log.warning)(
            "no device memory for the static steps' buffers of a %d-token prompt, the prefill runs eagerly: %s",
            n, error)
        self._oom_said = True

    def _drop(self) -> None:
        """Every bucket kept, with its buffers and graphs (freed once no prefill holds them)."""
        self._steps.clear()
        self._caches.clear()

    def bucket(self, n: int, rows: int) -> Bucket:
        """The bucket of a prompt of n tokens computing `rows` rows."""
        return Bucket(_up(n + 1, self.tokens_step), _up(max(rows, 1), self.rows_step))

    def caches(self, n: int) -> Caches:
        """The caches of a prompt of n tokens' bucket."""
        tokens = self.bucket(n, 1).tokens
        caches = self._caches.get(tokens)
        if caches is None:
            while len(self._caches) >= MAX_CACHES:
                dropped, _ = self._caches.popitem(last=False)
                for b in [b for b in self._steps if b.tokens == dropped]:
                    del self._steps[b]
            caches = self._caches[tokens] = Caches(self.e, tokens, self.tokens_step)
        else:
            self._caches.move_to_end(tokens)
        return caches

    def step(self, n: int, rows: int, rows_out: int | None = None) -> StaticStep:
        """The static step of a prompt of n tokens computing `rows` rows; with `rows_out`, the
        one that keeps that many of them (`StaticStep.choose`)."""
        bucket = self.bucket(n, rows)
        if rows_out is not None:
            bucket = Bucket(bucket.tokens, bucket.rows, _up(max(rows_out, 1), self.rows_step))
        caches = self.caches(n)
        step = self._steps.get(bucket)
        if step is not None:
            self._steps.move_to_end(bucket)
            return step
        while len(self._steps) >= MAX_STEPS:
            self._steps.popitem(last=False)
        step = self._steps[bucket] = StaticStep(self.e, caches, bucket.rows, bucket.rows_out)
        return step

    def buckets(self) -> list[Bucket]:
        """The buckets kept, least recently used first."""
        return list(self._steps)
