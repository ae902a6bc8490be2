"""The blend loop's host cost, counted on the CPU: the operations a prefill dispatches (a
TorchDispatchMode counter; on a GPU each one is a kernel launch or host-side work between
launches, and the loop is bound by them: docs/gpu.md). Full prefill dispatches a constant
number per layer, whatever the prompt's length; so does every pass of every policy, whatever
the number of chunks, rows and layers: full prefill's layer step plus OVERHEAD_PER_LAYER at most.

Every pass runs the one layer step (`step.layer_step`), full prefill included: 40 operations a
layer on the tiny model (full prefill 42: its K and V copied into storage of their own). A
one-pass policy adds the merge of the stored K/V (two concatenations and the stored K's
rotation, which turns the rows' k with it: 6 less the rows' own turn of k, 5), the write of its rows' K/V into the merged cache (2) and the CPU attention's
second run of rows (4): 51. The default runs two passes a layer by design (it reads the
question before it chooses the rows): its question pass adds the merge and the write, and its
attention returns the question's reads from the same softmax as its output (5 more than fused
SDPA): 52; its second pass writes its rows over the question pass's merged caches (2) in runs
(4): 46; 98 a layer in all. Cache-Craft's Alg. 1
(`focus_window` > 0, off by default and not counted here) adds the question's attention mass
and a read of it on the layers while it decides.

On the engine's Triton path (the GPU's; its kernels in the interpreter here) what counts is
kernel launches: 11 a layer of full prefill, 12 of naive reuse, whatever the rows (the stored
K's rotation is done by the launch that writes the rows' K/V); the default policy's two passes
22, two of full prefill's (its question pass's reads are added up inside its attention's launch,
and its second pass writes its rows over the question pass's merged caches). On the static
steps (`graphs.StepGraphs`, each step one CUDA graph there): 3 a layer of naive reuse, 6 of
the default's two passes, 13 of a CacheBlend filter layer (55 eager: the choice over fixed
slots, the same code the graph holds)."""

from __future__ import annotations

import dataclasses
import functools
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine_adapter import blend
from engine_adapter.blend import blend_prefill
from engine_adapter.graphs import StaticStep, StepGraphs
from engine_adapter.llama import LlamaConfig, LlamaEngine
from engine_adapter.policy import POLICIES, Policy
from engine_adapter.probe import TRUSTED
from engine_adapter.source import InMemoryLayerSource
from tests.engine_adapter.adapter_helpers import make_prompt

# Beyond full prefill's ops, per layer of a pass: the merge of the stored K/V (6) and the write
# of the rows' K/V (2), then the CPU attention's second run of rows (4) or the question pass's
# reads from the attention's own softmax (5).
OVERHEAD_PER_LAYER = 13
# APE's attention of the question's rows a layer (below): its logits, the chunks' share
# sharpened and rescaled, one softmax, the product, written over the step's output
APE_ATTENTION_OPS = 17


class Dispatched(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _ops(policy: str | None, layers: int, chunk_len: int = 24, chunks: int = 4, seen: dict | None = None) -> int:
    """Operations one prefill dispatches: `policy` None is full prefill (LlamaEngine.prefill
    of the whole prompt), else blend_prefill with each chunk's KV computed behind a stranger;
    `seen` gets the counter as "spy"."""
    cfg = dataclasses.replace(LlamaConfig.named("tiny"), num_layers=layers)
    engine = LlamaEngine.random(cfg, seed=0, std=0.1)
    p = make_prompt(engine, seed=1, behind="other", chunk_len=chunk_len, n_chunks=chunks)
    segments = p.segments()
    tokens = torch.tensor([t for s in segments for t in s.tokens])
    source = InMemoryLayerSource({i: v.kv for i, v in p.cache.items()})
    options = {"ratio": 0.15} if policy == "cacheblend" else {}  # its default budget needs more layers
    with torch.no_grad(), Dispatched() as spy:
        if seen is not None:
            seen["spy"] = spy
        if policy is None:
            engine.prefill(tokens, all_logits=False)
        else:
            blend_prefill(engine, segments, Policy(policy, **options), source, gate=TRUSTED, stats=False)
    return spy.ops


def per_layer(policy: str | None, **shape: int) -> int:
    return (_ops(policy, 8, **shape) - _ops(policy, 4, **shape)) // 4


def test_full_prefill_dispatches_the_same_per_layer_whatever_the_prompt():
    base = per_layer(None)
    assert base > 10  # the counter sees the engine's ops
    assert _ops(None, 12) - _ops(None, 8) == 4 * base  # a constant per layer
    assert _ops(None, 4, chunk_len=48) == _ops(None, 4)  # and per prompt length
    assert _ops(None, 4, chunks=6) == _ops(None, 4)


def _query_passes(layers: int, **shape: int) -> tuple[int, int]:
    """One prefill by `query`, split at its question pass: (the ops the question pass
    dispatched, all the others)."""
    seen: dict = {}
    inner = blend.run_pass

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if "spy" not in seen:  # the stored variants, made before the prefill counted
            return inner(*args, **kwargs)
        start = seen["spy"].ops
        try:
            return inner(*args, **kwargs)
        finally:
            seen.setdefault("question", seen["spy"].ops - start)  # the first pass

    with mock.patch.object(blend, "run_pass", counted):
        total = _ops("query", layers, seen=seen, **shape)
    return seen["question"], total - seen["question"]


# query: per pass, below; ape: its question rows' attention computed again, below
@pytest.mark.parametrize("policy", [p for p in POLICIES if p not in ("query", "ape")])
def test_each_policy_dispatches_no_more_than_full_prefill_per_layer_plus_a_constant(policy: str):
    full, mine = per_layer(None), per_layer(policy)
    assert mine <= full + OVERHEAD_PER_LAYER, f"{policy}: {mine} ops per layer, full prefill {full}"
    assert _ops(policy, 4, chunk_len=48) == _ops(policy, 4), f"{policy}: the count grows with rows"
    assert _ops(policy, 4, chunks=6) == _ops(policy, 4), f"{policy}: the count grows with chunks"


def test_ape_dispatches_naive_reuses_count_plus_its_attention_whatever_the_rows_and_chunks():
    # APE's attention (`attention.rescaled_attention`: plain torch, no kernel of its own) runs
    # for the question's rows beside the step's attention: a constant more a layer than naive
    # reuse, whatever the rows and chunks.
    naive, mine = per_layer("naive"), per_layer("ape")
    assert naive < mine <= naive + APE_ATTENTION_OPS, f"ape: {mine} ops per layer, naive reuse {naive}"
    assert _ops("ape", 4, chunk_len=48) == _ops("ape", 4), "ape: the count grows with rows"
    assert _ops("ape", 4, chunks=6) == _ops("ape", 4), "ape: the count grows with chunks"


def test_each_pass_of_the_default_policy_dispatches_no_more_than_full_prefill_per_layer_plus_a_constant():
    full = per_layer(None)
    (question8, picks8), (question4, picks4) = _query_passes(8), _query_passes(4)
    question, picks = (question8 - question4) // 4, (picks8 - picks4) // 4
    assert question <= full + OVERHEAD_PER_LAYER, f"query's question pass: {question} ops per layer, full {full}"
    assert picks <= full + OVERHEAD_PER_LAYER, f"query's second pass: {picks} ops per layer, full prefill {full}"
    assert question > full and picks >= full  # the split is where it should be: both passes run every layer's ops
    assert _query_passes(4, chunk_len=48) == _query_passes(4), "query: a pass's count grows with rows"
    assert _query_passes(4, chunks=6) == _query_passes(4), "query: a pass's count grows with chunks"


def test_the_default_policy_dispatches_no_more_than_two_full_prefills_plus_the_constant_twice():
    # Its two passes are two layer steps a layer (the question pass's reads of the question's
    # attention included): per layer, both counted, at most twice full prefill's plus the constant.
    full, mine = per_layer(None), per_layer("query")
    assert mine <= 2 * (full + OVERHEAD_PER_LAYER), f"query: {mine} ops per layer, full prefill {full}"
    assert _ops("query", 4, chunk_len=48) == _ops("query", 4), "query: the count grows with rows"
    assert _ops("query", 4, chunks=6) == _ops("query", 4), "query: the count grows with chunks"


# Dispatched ops that launch no device work: views, allocations (the caching allocator's), a
# tensor made from host values (its copy to the device is the launch).
NO_LAUNCH = {"lift_fresh", "empty", "empty_like", "permute", "view", "transpose", "split_with_sizes", "unsqueeze", "slice", "select",
             "_unsafe_view", "t", "expand", "alias", "as_strided", "detach", "narrow", "squeeze"}
TRITON_LAUNCHES_PER_LAYER = 12  # docs/gpu.md, naive reuse: norm, QKV, 2 concatenations, the stored K's
# rotation with the rows' rotate-and-write, attention (its output laid out as o-proj reads it), o-proj,
# add+RMSNorm, gate/up, SiLU-mul, down, the residual add (full prefill: 11, its SDPA output's reshape
# counted on the CPU)


class Launches(TorchDispatchMode):
    """Kernel launches of a prefill on the engine's Triton path, in the interpreter: each Triton
    kernel run is one (the torch ops the interpreter makes inside it are not counted), each
    dispatched op that computes is one (views and allocations launch nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.launches = 0
        self._inside = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if not self._inside and func.overloadpacket.__name__ not in NO_LAUNCH:
            self.launches += 1
        return func(*args, **(kwargs or {}))

    def kernel(self, run):  # noqa: ANN001, ANN201
        def counted(fn, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            self.launches += not self._inside
            self._inside += 1
            try:
                return run(fn, *args, **kwargs)
            finally:
                self._inside -= 1
        return counted


@functools.cache  # a count is a function of its arguments; the tests below share some
def _triton_launches(policy: str | None, layers: int, chunk_len: int = 12, graphs: bool = False,
                     ratio: float | None = None, warm: bool = False) -> int:
    """graphs: on the engine's static steps, each `StaticStep.run` counted as the one launch
    of the CUDA graph it replays there. warm: the second of two prefills counted (the first
    makes the buckets' buffers, once for the buckets' lifetime). ratio: CacheBlend's."""
    from triton.runtime.interpreter import InterpretedFunction

    cfg = dataclasses.replace(LlamaConfig.named("tiny"), num_layers=layers)
    torch_step = LlamaEngine.random(cfg, seed=0, std=0.1)
    p = make_prompt(torch_step, seed=1, behind="other", chunk_len=chunk_len, n_chunks=3)
    engine = LlamaEngine(cfg, torch_step.w, triton=True)
    # small buckets: launches do not depend on their size, the interpreter's time does
    steps = StepGraphs(engine, tokens_step=16, rows_step=8) if graphs else None
    source = InMemoryLayerSource({i: v.kv for i, v in p.cache.items()})
    options = {"ratio": ratio} if ratio is not None else {}
    segments = p.segments()  # (reads the stored chunks' statistics: not the prefill's launches)

    def prefill() -> None:
        if policy is None:
            engine.prefill(p.tokens, all_logits=False)
        else:
            blend_prefill(engine, segments, Policy(policy, **options), source, gate=TRUSTED, stats=False,
                          steps=steps)

    if warm:
        with torch.no_grad():
            prefill()
    spy = Launches()
    with (torch.no_grad(), spy, mock.patch.object(InterpretedFunction, "run", spy.kernel(InterpretedFunction.run)),
          mock.patch.object(StaticStep, "run", spy.kernel(StaticStep.run))):
        prefill()
    return spy.launches


def test_the_triton_path_launches_a_constant_few_kernels_per_layer():
    for policy in (None, "naive"):
        per = (_triton_launches(policy, 4) - _triton_launches(policy, 2)) // 2
        assert 8 <= per <= TRITON_LAUNCHES_PER_LAYER, f"{policy or 'full prefill'}: {per} launches a layer"
    assert _triton_launches("naive", 2, chunk_len=24) == _triton_launches("naive", 2), "the count grows with rows"


def test_on_static_steps_a_layer_launches_one_graph_and_two_copies_of_the_stored_kv():
    # What CUDA runs per layer of naive reuse on the static steps (engine_adapter.graphs): the
    # layer's stored K and V concatenated into the bucket's buffers, then the graph's replay
    per = (_triton_launches("naive", 4, graphs=True) - _triton_launches("naive", 2, graphs=True)) // 2
    assert per == 3, f"{per} launches a layer"
    assert _triton_launches("naive", 2, chunk_len=24, graphs=True) == _triton_launches("naive", 2, graphs=True)


def test_on_static_steps_the_default_policy_launches_a_naive_layer_per_phase():
    # its question phase (its reads added up in the bucket's buffer by the graph) and its
    # second phase (the stored KV merged again into the bucket's buffers, not written over
    # the question phase's caches) each as naive reuse: 3 a layer
    # (4 and 5 layers: 3 spend the budget on other rows, loaded into the buckets once more)
    mine = _triton_launches("query", 5, chunk_len=24, graphs=True) - _triton_launches("query", 4, chunk_len=24,
                                                                                        graphs=True)
    assert mine == 2 * 3, f"{mine} launches a layer"


def test_on_static_steps_cacheblends_filter_layers_choose_inside_the_graph():
    # A filter layer (CacheBlend §4.3's choice, a `step.Choice` over the bucket's slots; on 2
    # layers, layer 1): the
    # stored K and V concatenated (2), the rows and hidden states loaded (4: the rows' positions
    # and RoPE tables are derived inside the step), the candidates and the two counts (4), the
    # graph (1), the rows out and the kept candidates taken out of the step's buffers (2).
    # (warm: its buckets of rows differ with the layers, their buffers made once for their lifetime)
    static = (_triton_launches("cacheblend", 2, graphs=True, ratio=0.3, warm=True)
              - _triton_launches("cacheblend", 1, graphs=True, ratio=0.3, warm=True))
    eager = _triton_launches("cacheblend", 2, ratio=0.3) - _triton_launches("cacheblend", 1, ratio=0.3)
    assert static == 13 < eager, f"{static} launches a filter layer, eager {eager}"


def test_the_default_policy_on_the_triton_path_launches_two_full_prefill_layers_a_layer():
    """Its two phases are two layer steps a layer, and launch no more than two of full
    prefill's. The question phase's reads are added up inside its attention's launch
    (`kvkernels.KeyReads`, summed once after the phase), its stored K rotated inside the launch
    that writes its rows' K/V, and the second phase writes its rows over the question phase's
    merged caches (no concatenation or rotation of the stored KV again)."""
    full = (_triton_launches(None, 4) - _triton_launches(None, 2)) // 2  # as in the test above
    # 24-token chunks: the budget buys picks (the two phases run); from 3 layers on, each layer
    # more is one of the question pass's and one of pass 2's over its cache
    mine = _triton_launches("query", 4, chunk_len=24) - _triton_launches("query", 3, chunk_len=24)
    assert mine == 2 * full, f"{mine} launches a layer, full prefill {full}"
