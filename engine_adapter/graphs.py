"""Layer steps over static buffers, captured as CUDA graphs (docs/adapter.md, "Static steps").

On a GPU the blend loop is bound by the host: a layer's kernel launches and the Python
between them take longer than the kernels (docs/gpu.md). A step whose every tensor keeps
its shape and address from one request to the next can be captured once as a CUDA graph
and replayed for each request: one launch a layer. Shapes are fixed per `Bucket`: the
prompt's tokens rounded up to TOKENS_STEP, with at least one position past the prompt,
and the computed rows rounded up to ROWS_STEP. Padded rows write their K/V at the
bucket's last position, past every prompt row, so the position-causal mask hides it from
every prompt row; they see no key themselves (their attention output is 0, they read
nothing), and their results are never read.

`StepGraphs` (one per engine, `LlamaEngine(graphs=True)`) keeps the buckets it has seen,
the least recently used dropped first, and a prefill leases it whole (`lease`): a second
prefill on the same engine at the same time (a fidelity shadow) runs the eager step
instead of waiting. `StaticStep` is one bucket of rows: its buffers and, on CUDA, one
graph per layer and kind of step (adding up reads or not, returning the attention mass or
not), captured at its first use. `SelectStep` is a step that also chooses which of its
rows run on (by their KV deviation, CacheBlend §4.3), the choice inside the graph. On the
CPU (tests, Triton's interpreter) the same step runs eagerly over the same buffers: what
CUDA captures is what the CPU tests check.

Which layers run here is the loop's choice (`driver._Blend.static_step`).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import Tensor

from kvkernels import KeyReads, RopeConfig, kv_deviation, rope_tables, rotate_triton, selective_attention_triton
from kvkernels.layer import rope_write_triton

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
    rows_out: int = 0  # a `SelectStep`'s: >= the rows it keeps (0: a `StaticStep`)


class Caches:
    """One bucket of tokens: every layer's merged cache, K post-RoPE and V [L, Hkv, N, D],
    one layer's stored K before its rotation, the RoPE tables of every position, the keys'
    positions in this prefill (`keys_at`), what rows read of each key (`reads`), the prompt's
    segments for the attention mass (`segments_of`), and zeros for the positions past a prompt."""

    def __init__(self, engine: Any, rope: RopeConfig, tokens: int, pad: int):
        c = engine.cfg
        like = {"dtype": engine.dtype, "device": engine.device}
        self.tokens = tokens
        self.raw = torch.zeros(c.num_kv_heads, tokens, c.head_dim, **like)
        self.K = torch.zeros(c.num_layers, c.num_kv_heads, tokens, c.head_dim, **like)
        self.V = torch.zeros_like(self.K)
        self.pos = torch.arange(tokens, device=engine.device)
        self.tables = rope_tables(rope, self.pos)  # fp32 cos, sin [N, D/2]
        self.key_pos = self.pos.clone()  # where the attention sees each key (`keys_at`)
        self.reads = KeyReads(tokens, engine.device)  # the default's question phase (`query.QuestionPhase`)
        self.zeros = torch.zeros(c.num_kv_heads, pad, c.head_dim, **like)  # pad >= tokens - any prompt's n
        self.segments: dict[int, Tensor] = {}  # S' -> [S' + 1] key bounds (`segments_of`)

    def keys_at(self, pos: Tensor) -> None:
        """The prompt's keys at positions `pos` [n] for the attention (their prompt positions,
        or past the end where a phase hides them); the padding at its own."""
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
        in prompt order as pieces [Hkv, t, D] (`_Blend.pieces`), in one concatenation each."""
        pad = self.zeros[:, :self.tokens - n]
        torch.cat([*k, pad], 1, out=self.raw)
        torch.cat([*v, pad], 1, out=self.V[layer])


class StaticStep:
    """One bucket of rows over a bucket of tokens: the rows' hidden states, prompt rows and
    RoPE tables, and the layer step over them (`run`)."""

    def __init__(self, engine: Any, caches: Caches, rows: int):
        c = engine.cfg
        self.e, self.caches = engine, caches
        self.h = torch.zeros(rows, c.hidden_size, dtype=engine.dtype, device=engine.device)
        self.rows = torch.full((rows,), caches.tokens - 1, dtype=torch.long, device=engine.device)
        self.at = torch.full((rows,), -1, dtype=torch.long, device=engine.device)  # the rows' positions
        # to the attention: a padded row at -1 sees no key (its output 0, its reads none)
        self.cos = torch.empty(rows, c.head_dim // 2, dtype=torch.float32, device=engine.device)
        self.sin = torch.empty_like(self.cos)
        # (layer, reads, segments: `Caches.segments_of`, 0 for no mass) -> the rows' rotated q, their
        # q/k/v heads, their attention mass per segment or None; and the step's CUDA graph
        self.out: dict[tuple[int, bool, int], tuple[Tensor, Tensor, Tensor | None]] = {}
        self.graphs: dict[tuple[int, bool, int], Any] = {}
        self.pool: Any = None  # the graphs' memory pool

    def load(self, rows: Tensor, h: Tensor) -> None:
        """Rows [R] (sorted prompt rows, R <= the bucket's) and their hidden states h [R, d];
        the spare slots padded: their K/V written at the bucket's last position (where no
        prompt row sees them), seeing no key themselves, hidden states 0."""
        R = rows.shape[0]
        self.rows[R:].fill_(self.caches.tokens - 1)
        self.rows[:R].copy_(rows)
        self.h[R:].zero_()
        self.h[:R].copy_(h)

    def _place(self) -> None:
        """What the step derives from its rows (inside it: a load is four copies): their
        positions to the attention (a padded row at -1) and their RoPE tables."""
        pad = self.caches.tokens - 1  # no prompt row's: the bucket has a position past the prompt
        self.at.copy_(self.rows).masked_fill_(self.rows == pad, -1)
        torch.index_select(self.caches.tables[0], 0, self.rows, out=self.cos)
        torch.index_select(self.caches.tables[1], 0, self.rows, out=self.sin)

    def after(self) -> Tensor:
        """The rows' hidden states after the step."""
        return self.h

    def run(self, layer: int, reads: bool = False, segments: int = 0) -> tuple[Tensor, Tensor, Tensor | None]:
        """Layer `layer` of the loaded rows, over the layer's stored K/V (`Caches.merge`):
        their hidden states after it in `h`, their K/V written into the layer's cache, and
        with `reads` what they read of each key added into `Caches.reads`. Returns their
        rotated q [Hq, R, D], q/k/v heads [Hq+2Hkv, R, D] and, with `segments` (S' of
        `Caches.segments_of`), their attention mass per segment [R, S'] (valid until the layer
        runs again). CUDA: a graph replayed (captured at the first run)."""
        key = (layer, reads, segments)
        if self.h.device.type != "cuda":
            self.out[key] = self._body(*key)
        elif key in self.graphs:
            self.graphs[key].replay()
        else:
            self._capture(*key)
        return self.out[key]

    def _body(self, layer: int, reads: bool, segments: int) -> tuple[Tensor, Tensor, Tensor | None]:
        """The kernels of one layer (Triton): norm and QKV, the stored K rotated into the
        layer's cache, the rows' q and k rotated and their K/V written, attention by
        position, o-proj and the MLP. No host reads, no allocation that depends on a value."""
        e, cc = self.e, self.caches
        K, V = cc.K[layer], cc.V[layer]
        self._place()
        qkv = e.qkv_heads(layer, self.h)
        rotate_triton(cc.raw, *cc.tables, out=K)
        q = rope_write_triton(qkv, e.cfg.num_heads, self.cos, self.sin, self.rows, K, V)
        o, mass = selective_attention_triton(q, self.at, K, V, cc.key_pos, scale=e.scale,
                                             segments=cc.segments[segments] if segments else None,
                                             reads=cc.reads if reads else None, validate=False)
        self.h.copy_(e.layer_out(layer, self.h, o))
        return q, qkv, mass

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
                _, qkv, mass = self._body(layer, reads, segments)
                eager = (self.after().clone(), qkv.clone(), None if mass is None else mass.clone())
            torch.cuda.current_stream().wait_stream(side)
            # The warm-up moved h on by a layer and added its reads; K and V it wrote again as they were.
            self.h.copy_(h)
            self.caches.reads.restore(read)
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                out = self._body(layer, reads, segments)
            graph.replay()
            wrong = replay_differs(eager, (self.after(), out[1], out[2]))
        except Exception as e:  # noqa: BLE001 - any failure of the capture: the eager step instead
            wrong = f"{type(e).__name__}: {e}"
        if wrong:
            self.h.copy_(h)
            self.caches.reads.restore(read)
            raise StepFailed(f"layer {layer}'s CUDA graph: {wrong}")
        self.out[layer, reads, segments] = out
        self.graphs[layer, reads, segments] = graph


class SelectStep(StaticStep):
    """A static step that keeps some of its rows after their K/V are written: every row not a
    candidate, and the `keep` candidates whose K/V written deviate most from the stored ones
    (CacheBlend §4.3's HKVD choice; `keep` 0: the candidates run no further, as the default's
    question phase does after measuring them, `query.QuestionPhase`). The choice is made on the
    device (the deviation, a stable sort, prefix sums) over a fixed count of slots: the graph
    holds the selection. Its rows in are a bucket of `rows` (`load`, `choose`), its rows out a
    bucket of `rows_out` (`rows_out`, `h_out`, `cand_out`, valid until the step runs again);
    the layer's attention and MLP run for those."""

    def __init__(self, engine: Any, caches: Caches, rows: int, rows_out: int):
        super().__init__(engine, caches, rows)
        c, dev = engine.cfg, engine.device
        self.cand = torch.zeros(rows, dtype=torch.long, device=dev)  # the candidates' slots among the rows
        self.counts = torch.zeros(2, dtype=torch.long, device=dev)  # candidates, and how many of them stay
        self.slots = torch.arange(1, rows + 1, device=dev)
        self.slots_out = torch.arange(1, rows_out + 1, device=dev)
        self.rows_out = torch.full((rows_out,), caches.tokens - 1, dtype=torch.long, device=dev)
        self.h_out = torch.zeros(rows_out, c.hidden_size, dtype=engine.dtype, device=dev)
        self.cand_out = torch.zeros(rows, dtype=torch.long, device=dev)  # the kept candidates' slots out
        self.dev = torch.zeros(rows, dtype=torch.float32, device=dev)  # the candidates' deviation

    def choose(self, cand: Tensor, keep: int) -> None:
        """Candidates `cand` [C] (indices into the loaded rows, in order), of which `keep` stay."""
        C = cand.shape[0]
        self.cand[C:].zero_()
        self.cand[:C].copy_(cand)
        self.counts[0].fill_(C)  # (not a copy from host memory: on CUDA that would wait for the stream)
        self.counts[1].fill_(keep)

    def _body(self, layer: int, reads: bool, segments: int) -> tuple[Tensor, Tensor, Tensor | None]:
        """As `StaticStep._body`, with the choice between the rows' K/V and their attention:
        the candidates' stored K (rotated) and V taken before the rows' writes and compared with
        what was written; the rows out (in order), their hidden states, rotated q and q/k/v heads
        gathered from the rows in; the attention and MLP for them. Returns what `run` does, of
        the rows out (q/k/v heads: of the rows in, and of the rows out, concatenated)."""
        e, cc = self.e, self.caches
        K, V = cc.K[layer], cc.V[layer]
        pad = cc.tokens - 1
        self._place()
        valid = self.slots <= self.counts[0]  # [slots] which candidate slots hold one
        at = torch.where(valid, self.rows.index_select(0, self.cand), pad)  # their prompt rows
        qkv = e.qkv_heads(layer, self.h)
        rotate_triton(cc.raw, *cc.tables, out=K)
        k_old, v_old = K.index_select(1, at), V.index_select(1, at)
        q = rope_write_triton(qkv, e.cfg.num_heads, self.cos, self.sin, self.rows, K, V)
        dev = kv_deviation(K.index_select(1, at), V.index_select(1, at), k_old, v_old)
        self.dev.copy_(dev.masked_fill(~valid, float("-inf")))
        # The `keep` of highest deviation, ties to the lower slot (`kvkernels.kv_deviation_topk`'s
        # stable sort): a candidate stays where fewer than `keep` rank before it.
        order = torch.sort(self.dev, descending=True, stable=True).indices
        rank = torch.empty_like(order).scatter_(0, order, self.slots - 1)
        chosen = (rank < self.counts[1]) & valid
        # The rows that stay: the loaded rows less the candidates, and the chosen candidates (the
        # spare candidate slots add 0); in order, out slot j takes the (j+1)-th (prefix sums, a search).
        stays = (self.rows != pad).long().index_add_(0, self.cand, chosen.long() - valid.long())
        counts = stays.cumsum(0)
        src = torch.searchsorted(counts, self.slots_out).clamp_(max=self.rows.shape[0] - 1)
        kept = self.slots_out <= counts[-1]
        self.rows_out.copy_(torch.where(kept, self.rows.index_select(0, src), pad))
        self.h_out.copy_(self.h.index_select(0, src))
        q_out, qkv_out = q.index_select(1, src), qkv.index_select(1, src)
        # The kept candidates' slots among the rows out, in order (the next choice's candidates).
        picked = torch.searchsorted(chosen.long().cumsum(0), self.slots).clamp_(max=self.cand.shape[0] - 1)
        self.cand_out.copy_(counts.index_select(0, self.cand.index_select(0, picked)) - 1)
        o, mass = selective_attention_triton(q_out, torch.where(kept, self.rows_out, -1), K, V, cc.key_pos,
                                             scale=e.scale, segments=cc.segments[segments] if segments else None,
                                             reads=cc.reads if reads else None, validate=False)
        self.h_out.copy_(e.layer_out(layer, self.h_out, o))
        return q_out, torch.cat((qkv, qkv_out), 1), mass

    def after(self) -> Tensor:
        return self.h_out


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
    """An engine's static steps: buckets of tokens (`Caches`) and of rows (`StaticStep`),
    least recently used dropped first, leased by one prefill at a time."""

    def __init__(self, engine: Any, rope: RopeConfig, tokens_step: int = TOKENS_STEP, rows_step: int = ROWS_STEP):
        self.e, self.rope = engine, rope
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
            caches = self._caches[tokens] = Caches(self.e, self.rope, tokens, self.tokens_step)
        else:
            self._caches.move_to_end(tokens)
        return caches

    def step(self, n: int, rows: int, rows_out: int | None = None) -> StaticStep:
        """The static step of a prompt of n tokens computing `rows` rows; with `rows_out`, the
        `SelectStep` that keeps that many of them."""
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
        step = self._steps[bucket] = (SelectStep(self.e, caches, bucket.rows, bucket.rows_out) if bucket.rows_out
                                      else StaticStep(self.e, caches, bucket.rows))
        return step

    def buckets(self) -> list[Bucket]:
        """The buckets kept, least recently used first."""
        return list(self._steps)
