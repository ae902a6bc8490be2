"""What every launcher checks before it starts a Triton kernel.

Triton picks its backend when a kernel is *defined*: with ``TRITON_INTERPRET=1`` set
before import, ``@triton.jit`` builds an interpreted function that runs on CPU
tensors; without it, a compiled function that needs a GPU driver. A launcher handed
CPU tensors by a process that imported us without the variable would otherwise fail
deep inside Triton with "0 active drivers"; this says what to do instead.
"""

from __future__ import annotations

import torch
from triton.runtime.interpreter import InterpretedFunction


def is_interpreted(kernel: object) -> bool:
    """True when ``kernel`` was defined under ``TRITON_INTERPRET=1`` (runs on CPU)."""
    return isinstance(kernel, InterpretedFunction)


def check_launchable(kernel: object, *tensors: torch.Tensor) -> None:
    """Raise if ``kernel`` cannot run on the device of ``tensors``.

    All tensors must share one device; CUDA tensors need a compiled kernel, CPU
    tensors an interpreted one.
    """
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    device = devices.pop()
    interpreted = is_interpreted(kernel)
    if device.type == "cuda" and interpreted:
        raise RuntimeError(
            "kvkernels was imported with TRITON_INTERPRET=1; unset it to run Triton on CUDA"
        )
    if device.type != "cuda" and not interpreted:
        raise RuntimeError(
            f"Triton kernels need CUDA tensors, got {device}; to run them on CPU set "
            "TRITON_INTERPRET=1 before kvkernels is first imported"
        )


def dot_in_fp32(kernel: object, dtype: torch.dtype) -> bool:
    """Whether a kernel's tl.dot should upcast its operands to fp32.

    fp32 inputs always (with IEEE precision, so the GPU does not silently use TF32).
    In the interpreter always, because bf16 arithmetic is broken there (docs/kernels.md).
    On the GPU fp16/bf16 operands go to the tensor cores as they are, accumulating
    in fp32, like the Triton fused-attention tutorial.
    """
    return dtype == torch.float32 or is_interpreted(kernel)
