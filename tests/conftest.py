"""Suite-wide setup.

Triton reads TRITON_INTERPRET when a kernel is defined (at import of kvkernels), so it
must be set before any test module imports kernel code: here, first. With no CUDA the
kernels run in Triton's interpreter on CPU tensors — the same kernels the GPU runs.
"""

import os

try:
    import torch

    _has_cuda = torch.cuda.is_available()
except ImportError:  # pragma: no cover - torch is a hard dependency
    _has_cuda = False

if not _has_cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")
