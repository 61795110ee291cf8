"""Which implementation an op runs: Triton for CUDA tensors, chunked plain torch elsewhere.

Triton is optional: without it every op runs its torch path. Tests force the Triton path on CPU
tensors by setting ``TRITON_INTERPRET=1`` before import and selecting the ``"triton"`` backend.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch

try:  # Triton is a Linux-only dependency; the package must import and work without it.
    import triton  # noqa: F401

    HAS_TRITON = True
except Exception:  # ImportError, or a broken install raising at import
    HAS_TRITON = False

BACKENDS = ("auto", "triton", "torch")

# Bound on the bytes of one logits workspace (a row chunk or a vocabulary slice, counted as fp32).
# The torch path copies a chunk to fp32, the linear ops hold one [N, chunk] slice: this is what
# keeps the loss head's memory flat in the vocabulary size. 256 MiB on an 8 GiB card is the price
# of GEMMs large enough to run near peak.
DEFAULT_WORKSPACE_BYTES = 256 * 2**20
# On the CPU a workspace over glibc's mmap threshold (32 MiB at most) is mapped afresh at every call and
# each of its pages faults in again, and a slice this size is reread from cache: SmolLM2-135M's head
# ran 1.13-1.39x faster with it than with 256 MiB, its GEMMs still near the cores' peak
# (benchmarks/RESULTS.md, "The loss head's workspace on the CPU").
CPU_WORKSPACE_BYTES = 8 * 2**20
# Bound on the logits the fused head keeps from its forward for its backward (which then skips the
# recompute, a quarter of the head's GEMM work) on the CPU, where RAM is plentiful and GEMMs are slow;
# 0 elsewhere: a GPU's memory is the scarce thing. See `keep_logits_fits` in lowmem_grpo/kernels/linear.py.
CPU_KEEP_LOGITS_BYTES = 256 * 2**20

_backend = os.environ.get("LOWMEM_GRPO_BACKEND", "auto")


def _check_name(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"unknown kernels backend {name!r}; valid: {', '.join(BACKENDS)}")
    return name


_check_name(_backend)


def workspace_bytes(device_type: str) -> int:
    """The logits workspace bound for tensors on a device of this type ("cpu", "cuda", ...)."""
    return CPU_WORKSPACE_BYTES if device_type == "cpu" else DEFAULT_WORKSPACE_BYTES


def keep_logits_bytes(device_type: str) -> int:
    """The bound on the logits the fused head may keep for its backward on a device of this type."""
    return CPU_KEEP_LOGITS_BYTES if device_type == "cpu" else 0


def get_backend() -> str:
    return _backend


def set_backend(name: str) -> None:
    """Select ``"auto"`` (Triton on CUDA, torch elsewhere), ``"triton"`` or ``"torch"``."""
    global _backend
    _backend = _check_name(name)


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Temporarily select a backend (see :func:`set_backend`)."""
    previous = _backend
    set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(t: torch.Tensor) -> bool:
    """Whether an op on tensor ``t`` should run its Triton kernels."""
    if _backend == "torch":
        return False
    if _backend == "triton":
        if not HAS_TRITON:
            raise RuntimeError("kernels backend 'triton' selected but triton is not installed")
        if not t.is_cuda and not interpreter_enabled():
            raise RuntimeError(
                "kernels backend 'triton' on CPU tensors needs the Triton interpreter: "
                "set TRITON_INTERPRET=1 before importing lowmem_grpo.kernels"
            )
        return True
    return t.is_cuda and HAS_TRITON


def launch_guard(t: torch.Tensor):
    """Triton launches on the *current* CUDA device: a tensor on cuda:1 while cuda:0 is current would
    be read by a kernel running on the wrong device. Enter the tensor's device around every launch."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def debug_checks() -> bool:
    """Extra checks that cost a device sync (ids range on CUDA): ``LOWMEM_GRPO_DEBUG=1``."""
    return os.environ.get("LOWMEM_GRPO_DEBUG", "0") not in ("", "0")
