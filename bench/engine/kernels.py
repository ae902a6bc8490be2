"""Benchmark of the kvkernels Triton kernels beside the best torch alternative, on one GPU.

One Llama-3-8B attention layer (32 query heads, 8 KV heads, head dim 128), a 2.5k-token
prompt of which 15% of the rows are computed (new chunks, question, recompute set), as
in blended prefill. Every kernel is timed in the same run as its torch alternative and
checked against its reference first, so a fast wrong kernel cannot show up as a win.

    kvcraft bench kernels [--tokens 2500] [--ratio 0.15] [--dtype bf16] [--json kernels-bench.json]

Needs CUDA; on a machine without it, says so and exits 0. The roofline fraction is
achieved / peak for the resource that bounds the kernel: bytes moved at least once
(HBM) for RoPE and deviation, dense FLOPs for attention. Peaks default to
an H200 (about 4.8 TB/s HBM3e, about 990 TFLOP/s dense bf16/fp16).
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from kvbench import results
from kvbench.common.args import count

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Row:
    """One timed implementation of one kernel."""

    kernel: str
    impl: str
    ms: float
    bytes_moved: float
    flops: float
    bound: str  # "memory" or "compute": which peak the roofline fraction uses
    roofline_fraction: float
    max_abs_err: float | None  # vs the torch reference, None for the reference itself


def _time_ms(fn: Callable[[], object]) -> float:
    import triton.testing

    # do_bench flushes L2 between runs and returns the median here, so a kernel that
    # re-reads an L2-resident tensor is not flattered.
    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def _row(kernel: str, impl: str, ms: float, nbytes: float, flops: float, bound: str,
         peak_bps: float, peak_flops: float, err: float | None) -> Row:
    seconds = ms / 1e3
    frac = (nbytes / seconds / peak_bps) if bound == "memory" else (flops / seconds / peak_flops)
    return Row(kernel, impl, ms, nbytes, flops, bound, frac, err)


def _err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref.float()).abs().max())


@dataclass
class _Layer:
    """One attention layer's inputs, drawn once: every kernel's rows read the same ones."""

    dev: torch.device
    g: torch.Generator
    dtype: torch.dtype
    esize: int
    Hq: int
    Hkv: int
    D: int
    T: int
    R: int
    q_all: torch.Tensor  # [Hq, T, D]
    k: torch.Tensor  # [Hkv, T, D]
    v: torch.Tensor
    pos: torch.Tensor  # [T]
    sel: torch.Tensor  # [R]: the computed rows
    q: torch.Tensor  # [Hq, R, D]
    segments: torch.Tensor  # chunk boundaries

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=self.dev, generator=self.g).to(self.dtype)


def _layer(tokens: int, ratio: float, dtype: torch.dtype, device: str) -> _Layer:
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(0)
    Hq, Hkv, D, T = 32, 8, 128, tokens
    R = max(1, math.ceil(ratio * T))
    esize = torch.tensor([], dtype=dtype).element_size()

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=dev, generator=g).to(dtype)

    q_all, k, v = randn(Hq, T, D), randn(Hkv, T, D), randn(Hkv, T, D)
    pos = torch.arange(T, device=dev)
    # Distinct rows in random order; the last prompt token is always computed.
    last = torch.tensor([T - 1], device=dev)
    sel = torch.cat((last, torch.randperm(T - 1, device=dev, generator=g)[: R - 1]))
    q = q_all[:, sel].contiguous()  # [Hq, R, D]
    chunk = T // 5
    segments = torch.tensor([0, chunk, 2 * chunk, 3 * chunk, 4 * chunk, T], device=dev)
    return _Layer(dev, g, dtype, esize, Hq, Hkv, D, T, R, q_all, k, v, pos, sel, q, segments)


def _rope_rows(L: _Layer, peak_bps: float, peak_flops: float, timer: Callable[[Callable[[], object]], float]) -> list[Row]:
    """RoPE: move every cached K of the layer to new positions (Cache-Craft §3.4.3)."""
    import kvkernels as K

    k, D = L.k, L.D
    cfg = K.RopeConfig(head_dim=D, theta=500000.0, factor=8.0)
    new_pos = L.pos + 4096
    rope_bytes = 2 * L.Hkv * L.T * D * L.esize + L.T * 8
    ref = K.apply_rope_reference(k, new_pos, cfg)
    out = torch.empty_like(k)
    tri_err = _err(K.apply_rope_triton(k, new_pos, cfg, out=out), ref)
    # Best torch alternative: HF-style rotate-half with cos/sin already tabulated per
    # position (what an engine caches), in the input dtype.
    freqs = new_pos.float()[:, None] * K.inv_freq(cfg, L.dev)[None, :]
    cos = torch.cat((freqs, freqs), dim=-1).cos().to(L.dtype)
    sin = torch.cat((freqs, freqs), dim=-1).sin().to(L.dtype)

    def rope_torch() -> torch.Tensor:
        x1, x2 = k[..., : D // 2], k[..., D // 2:]
        return k * cos + torch.cat((-x2, x1), dim=-1) * sin

    return [_row("rope", impl, timer(fn), rope_bytes, 0.0, "memory", peak_bps, peak_flops, err)
            for impl, fn, err in (
                ("triton", lambda: K.apply_rope_triton(k, new_pos, cfg, out=out), tri_err),
                ("torch reference (fp32 math)", lambda: K.apply_rope_reference(k, new_pos, cfg), None),
                ("torch HF-style (cos/sin cached)", rope_torch, _err(rope_torch(), ref)),
            )]


def _attention_rows(L: _Layer, peak_bps: float, peak_flops: float,
                    timer: Callable[[Callable[[], object]], float]) -> list[Row]:
    """Selective attention: R rows over the merged cache, + per-chunk mass."""
    import torch.nn.functional as F

    import kvkernels as K

    q_all, q, k, v, pos, sel, segments = L.q_all, L.q, L.k, L.v, L.pos, L.sel, L.segments
    Hq, Hkv, D, T = L.Hq, L.Hkv, L.D, L.T
    visible = int((pos[None, :] <= sel[:, None]).sum())  # (row, key) pairs under the mask
    attn_flops = 4.0 * Hq * D * visible  # QK^T and PV, 2 FLOPs per multiply-add
    mass_flops = 2.0 * Hq * D * visible  # the second QK^T pass that normalises the mass
    attn_bytes = (2 * Hq * L.R * D + 2 * Hkv * T * D) * L.esize
    ref_out, ref_mass = K.selective_attention_reference(q, sel, k, v, pos, segments=segments)
    tri_out, tri_mass = K.selective_attention_triton(q, sel, k, v, pos, segments=segments)
    attn_err = max(_err(tri_out, ref_out), _err(tri_mass, ref_mass))
    full_flops = 4.0 * Hq * D * (T * (T + 1) // 2)
    mask = pos[None, :] <= sel[:, None]  # [R, T]

    def sdpa_full() -> torch.Tensor:
        return F.scaled_dot_product_attention(q_all[None], k[None], v[None], is_causal=True, enable_gqa=True)

    # With a mask SDPA has no GQA-aware fast kernel, so KV is expanded to Hq heads once,
    # outside the timed call (a memory cost the Triton kernel does not pay).
    k_rep, v_rep = k.repeat_interleave(Hq // Hkv, dim=0), v.repeat_interleave(Hq // Hkv, dim=0)

    def sdpa_rows_masked() -> torch.Tensor:
        return F.scaled_dot_product_attention(q[None], k_rep[None], v_rep[None], attn_mask=mask)

    sdpa_full_err = _err(sdpa_full()[0][:, sel], ref_out)
    rows = []
    for impl, fn, flops, err in (
        ("triton + mass", lambda: K.selective_attention_triton(q, sel, k, v, pos, segments=segments),
         attn_flops + mass_flops, attn_err),
        ("triton, no mass", lambda: K.selective_attention_triton(q, sel, k, v, pos), attn_flops,
         _err(K.selective_attention_triton(q, sel, k, v, pos)[0], ref_out)),
        ("torch SDPA, all rows causal", sdpa_full, full_flops, sdpa_full_err),
        ("torch SDPA, rows + bool mask", sdpa_rows_masked, attn_flops, _err(sdpa_rows_masked()[0], ref_out)),
    ):
        rows.append(_row("selective_attention", impl, timer(fn), attn_bytes, flops, "compute",
                         peak_bps, peak_flops, err))
    return rows


def _deviation_rows(L: _Layer, ratio: float, peak_bps: float, peak_flops: float,
                    timer: Callable[[Callable[[], object]], float]) -> list[Row]:
    """KV deviation + HKVD top-k over every token (CacheBlend §4.3, first layer)."""
    import kvkernels as K

    k, v = L.k, L.v
    k2, v2 = L.randn(L.Hkv, L.T, L.D), L.randn(L.Hkv, L.T, L.D)
    dev_bytes = 4 * L.Hkv * L.T * L.D * L.esize
    ref_dev, _ = K.kv_deviation_topk_reference(k, v, k2, v2, ratio)
    tri_dev, _ = K.kv_deviation_topk_triton(k, v, k2, v2, ratio)
    return [_row("kv_deviation_topk", impl, timer(fn), dev_bytes, 0.0, "memory", peak_bps, peak_flops, err)
            for impl, fn, err in (
                ("triton", lambda: K.kv_deviation_topk_triton(k, v, k2, v2, ratio), _err(tri_dev, ref_dev)),
                ("torch reference", lambda: K.kv_deviation_topk_reference(k, v, k2, v2, ratio), None),
            )]


def run(
    tokens: int,
    ratio: float,
    dtype: torch.dtype,
    peak_bps: float,
    peak_flops: float,
    *,
    device: str = "cuda",
    timer: Callable[[Callable[[], object]], float] = _time_ms,
) -> list[Row]:
    """Time every kernel and its torch alternatives; ``device``/``timer`` exist so the
    tests can smoke-run this on CPU under the Triton interpreter."""
    layer = _layer(tokens, ratio, dtype, device)
    return (_rope_rows(layer, peak_bps, peak_flops, timer) + _attention_rows(layer, peak_bps, peak_flops, timer)
            + _deviation_rows(layer, ratio, peak_bps, peak_flops, timer))

def _print_table(rows: list[Row]) -> None:
    header = f"{'kernel':<20} {'impl':<32} {'ms':>9} {'GB/s':>8} {'TFLOP/s':>8} {'roofline':>9} {'max err':>9}"
    print(header)
    print("-" * len(header))
    for r in rows:
        gbps = r.bytes_moved / (r.ms / 1e3) / 1e9
        tflops = r.flops / (r.ms / 1e3) / 1e12
        err = "ref" if r.max_abs_err is None else f"{r.max_abs_err:.1e}"
        print(f"{r.kernel:<20} {r.impl:<32} {r.ms:9.4f} {gbps:8.1f} {tflops:8.1f} "
              f"{100 * r.roofline_fraction:8.1f}% {err:>9} ({r.bound})")


def main(argv: list[str] | None = None) -> int:
    argv = list(argv if argv is not None else sys.argv[1:])
    parser = argparse.ArgumentParser(prog="kvcraft bench kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=count(), default=2500, help="prompt length T (keys in the merged cache)")
    parser.add_argument("--ratio", type=float, default=0.15, help="fraction of rows computed")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--peak-tbps", type=float, default=4.8, help="HBM bandwidth peak, TB/s (H200)")
    parser.add_argument("--peak-tflops", type=float, default=990.0, help="dense bf16 peak, TFLOP/s (H200)")
    results.add_argument(parser, "kernels")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print("bench/engine/kernels.py needs a CUDA GPU (none found); nothing measured.")
        return 0

    rows = run(args.tokens, args.ratio, DTYPES[args.dtype], args.peak_tbps * 1e12, args.peak_tflops * 1e12)
    _print_table(rows)
    import triton

    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "shape": {"q_heads": 32, "kv_heads": 8, "head_dim": 128, "tokens": args.tokens, "ratio": args.ratio,
                  "dtype": args.dtype},
        "peaks": {"hbm_tbps": args.peak_tbps, "dense_tflops": args.peak_tflops},
        "rows": [asdict(r) for r in rows],
    }
    results.save("kernels", argv, report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
