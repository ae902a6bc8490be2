"""kvcraft's own threads run torch's CPU operations on one OpenMP thread.

torch's CPU operations run on OpenMP (GNU libgomp, which torch bundles). Every thread that
starts a parallel region keeps a team of its own, and once a process has more of those threads
than CPUs, libgomp cuts how long they spin for the next region from ~300,000 spins to 100
(`gomp_throttled_spin_count_var`): every region after that wakes its team through the kernel.
On the 2-core VM a thread of ours that had run one parallel operation and gone idle made a small
operation (x [4, 1312, 64] fp32 times 2) on another thread take 65 us instead of 20, and inside
vLLM the same operation on the blend's thread took 51-96 us against 21-32 with our threads on one
OpenMP thread each.

So the thread that owns the compute (the engine's step thread) keeps its team, and kvcraft's
threads (loads, saves, store-backs, fidelity shadows) run theirs on themselves alone.
`omp_set_num_threads` sets the calling thread's count only: `torch.set_num_threads` also sets
MKL's for the whole process, and vLLM's CPU worker replaces it with a no-op. A blend needs every
core: inside vLLM on a CPU it runs on the step thread (`vllm.worker`).
"""

from __future__ import annotations

import ctypes

import torch


def _omp_set_num_threads():  # noqa: ANN202 - a ctypes function, or None
    try:
        return ctypes.CDLL(None).omp_set_num_threads  # torch's libgomp, loaded with global symbols
    except (OSError, AttributeError):  # a torch without OpenMP
        return None


_SET = _omp_set_num_threads()


def one_omp_thread() -> None:
    """The calling thread's torch CPU operations on one OpenMP thread (a pool's `initializer`)."""
    torch.get_num_threads()  # torch's first call on a thread sets its count from the process's: first
    if _SET is not None:
        _SET(1)


__all__ = ["one_omp_thread"]
