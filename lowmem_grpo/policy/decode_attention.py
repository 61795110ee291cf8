"""The CPU attention of one decode step, compiled on first use (source: decode_attention.cpp).

`cpu_decode_attention(query, key, value, mask, scale)` computes what sdpa computes for one query token
per row, the query heads grouped under their K/V head: query (B, kv_heads, group, D), key and value
(B, kv_heads, L, D) (views of a cache: any strides but the last), mask None or bool broadcasting as
(B, 1, 1, L) (True: attend; a row with nothing to attend gets zeros, as from sdpa), scale the scores'
factor. Operands fp32 or bf16 of one dtype; under bf16 autocast also fp32 queries and keys with bf16
values, rounded to bf16 as autocast rounds sdpa's. It returns (B, kv_heads, group, D) in the values'
dtype, or None where it does not apply (`problem` says why): then the caller runs sdpa. Scores, softmax
and the weighted sum are fp32, each K/V head read once for its group, masked positions not at all; the
result differs from sdpa's by rounding. Vector loops for AVX-512 and for AVX2 + FMA CPUs (elsewhere sdpa
runs); on torch's OpenMP threads (else, or with LOWMEM_GRPO_DECODE_ATTENTION_OPENMP=0, host_pool.cpp's).
LOWMEM_GRPO_DECODE_ATTENTION=0 turns it off, LOWMEM_GRPO_DECODE_ATTENTION_MARCH picks the -march (and so the
loops). Speed: benchmarks/RESULTS.md; design notes: docs/rollouts.md
"""
from __future__ import annotations

import ctypes
import logging
import os
import re
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from ..native_build import build_library

logger = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name("decode_attention.cpp"),
           Path(__file__).parents[1] / "optim" / "host_pool.cpp"]  # the kernel; its threads without OpenMP
HEADERS = [Path(__file__).parents[1] / "optim" / "host_pool.h"]
CFLAGS = ["-O3", "-march=native", "-pthread", "-ffp-contract=off", "-fno-math-errno", "-std=c++17"]
# The work items on OpenMP's threads: the runtime torch has loaded (libgomp in torch's wheels) serves this
# library too, so a step's GEMMs and elementwise ops and its attention share one team of threads, where a pool
# of its own would wake its helpers while torch's threads still spin for the next op
OPENMP = ["-fopenmp"]
_KIND = {torch.float32: 0, torch.bfloat16: 1}
_AUTOCAST_KEYS = 2  # bf16 queries and values, fp32 keys read as bf16 (the kernel's third kind)
MAX_HEAD_DIM = 256

_library: Optional[ctypes.CDLL] = None
_load_error: Optional[str] = None
SIMD = True  # False: the scalar loops only (the tests compare both)


def openmp_runtimes() -> set[str]:
    """The files of the OpenMP runtimes (GNU, Intel, LLVM) mapped into this process (empty where there is no
    /proc/self/maps to read)."""
    try:
        with open("/proc/self/maps") as f:
            files = {line.split()[-1] for line in f if len(line.split()) >= 6}
    except OSError:
        return set()
    return {path for path in files if re.search(r"lib(gomp|iomp5|omp)[-.]", os.path.basename(path))}


def build(march: str = "native", openmp: Optional[bool] = None) -> ctypes.CDLL:
    """Compile (or find in torch's extension cache) and load the kernel for `-march=<march>`; `openmp`: on
    OpenMP's threads, else on host_pool.cpp's. None: OpenMP unless LOWMEM_GRPO_DECODE_ATTENTION_OPENMP=0,
    where the compiler can (not clang without libomp) and where the library shares torch's runtime (a torch
    whose wheel renamed its libgomp would leave two runtimes, each with its threads: then host_pool.cpp)."""
    flags = [f if f != "-march=native" else f"-march={march}" for f in CFLAGS]
    target = None if march == "native" else march.replace("-", "_")
    wanted = os.environ.get("LOWMEM_GRPO_DECODE_ATTENTION_OPENMP", "1") != "0" if openmp is None else openmp
    lib = None
    if wanted:
        try:
            lib = build_library("lowmem_grpo_decode_attention", SOURCES, flags + OPENMP, HEADERS, target, OPENMP)
        except Exception as e:  # noqa: BLE001  (any failure: the build without OpenMP)
            if openmp:
                raise
            logger.info("the CPU decode attention did not build with OpenMP (%s); it runs on threads of its own",
                        str(e).strip().splitlines()[-1][:200] if str(e).strip() else type(e).__name__)
        if lib is not None and openmp is None and len(openmp_runtimes()) > 1:
            logger.info("the CPU decode attention runs on threads of its own: its OpenMP runtime is not torch's "
                        "(%s)", ", ".join(sorted(openmp_runtimes())))
            lib = None
    if lib is None:
        lib = build_library("lowmem_grpo_decode_attention", SOURCES, flags, HEADERS, target)
    p, i32, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.decode_attention.argtypes = [i32, p, p, p, p, p, p, f32, p, i32, i32]  # kind, sizes, q, k, v, mask,
    # strides, scale, out, SIMD, threads
    lib.decode_attention.restype = i32
    lib.decode_attention_lanes.argtypes = []
    lib.decode_attention_lanes.restype = i32
    lib.decode_attention_openmp.argtypes = []
    lib.decode_attention_openmp.restype = i32
    return lib


def library() -> Optional[ctypes.CDLL]:
    """The compiled kernel, built on first use; None (after one warning) where it cannot be had."""
    global _library, _load_error
    if _library is not None or _load_error is not None:
        return _library
    if os.environ.get("LOWMEM_GRPO_DECODE_ATTENTION", "1") == "0":
        _load_error = "LOWMEM_GRPO_DECODE_ATTENTION=0"
        return None
    try:
        _library = build(os.environ.get("LOWMEM_GRPO_DECODE_ATTENTION_MARCH", "native"))
    except Exception as e:  # noqa: BLE001  (a failed build of any kind means: sdpa)
        _load_error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"[:300]
        logger.warning("the CPU decode attention (policy/decode_attention.cpp) did not build (%s); decoding "
                       "runs sdpa, slower. Fix: a C++ compiler (g++) and ninja (pip install ninja)", _load_error)
    return _library


def problem(query: Tensor, key: Tensor, value: Tensor, mask: Optional[Tensor]) -> Optional[str]:
    """Why cpu_decode_attention does not take these operands (None: it does)."""
    return _problem(query, key, value, mask, _kind(query, key, value))


def _problem(query: Tensor, key: Tensor, value: Tensor, mask: Optional[Tensor], kind: Optional[int]) -> Optional[str]:
    """problem() for operands whose kernel kind (_kind) is already known."""
    if query.device.type != "cpu":
        return f"a CPU kernel ({query.device.type} tensors)"
    if kind is None:
        return (f"fp32 or bf16 operands of one dtype, or under bf16 autocast fp32 queries and keys with bf16 "
                f"values (got {query.dtype}, {key.dtype}, {value.dtype})")
    if query.dim() != 4 or key.dim() != 4 or value.shape != key.shape or query.shape[:2] != key.shape[:2] \
            or query.shape[3] != key.shape[3]:
        return f"shapes (B, kv_heads, group, D) and (B, kv_heads, L, D) (got {tuple(query.shape)}, " \
               f"{tuple(key.shape)}, {tuple(value.shape)})"
    if query.shape[3] % 16 or query.shape[3] > MAX_HEAD_DIM:
        return f"a head dim that is a multiple of 16, up to {MAX_HEAD_DIM} (got {query.shape[3]})"
    if any(t.stride(-1) != 1 for t in (query, key, value)):
        return "a contiguous last dimension"
    if mask is not None and (mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1:3] != (1, 1)
                             or mask.shape[3] != key.shape[2] or mask.shape[0] not in (1, key.shape[0])):
        return f"a bool mask (B, 1, 1, L) (got {mask.dtype} {tuple(mask.shape)})"
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        return "no autograd (a decode step)"
    if torch.compiler.is_compiling():
        return "eager mode (a compiled step traces sdpa)"
    lib = library()
    if lib is None:
        return f"the compiled kernel ({_load_error})"
    if lib.decode_attention_lanes() < 8:
        return "AVX2 or AVX-512 (without them the kernel's scalar loops are slower than sdpa)"
    return None


def _kind(query: Tensor, key: Tensor, value: Tensor) -> Optional[int]:
    """The kernel's kind for these dtypes, None where it has none. Under CPU autocast, sdpa computes in the
    autocast dtype: bf16 autocast takes bf16 operands as they are and fp32 queries and keys (what the
    rotary embedding returns beside bf16 values) rounded to bf16."""
    dtypes = (query.dtype, key.dtype, value.dtype)
    if torch.is_autocast_enabled("cpu"):
        if torch.get_autocast_dtype("cpu") != torch.bfloat16:
            return None
        if dtypes == (torch.float32, torch.float32, torch.bfloat16):
            return _AUTOCAST_KEYS
        return _KIND[torch.bfloat16] if dtypes == (torch.bfloat16,) * 3 else None
    return _KIND.get(query.dtype) if len(set(dtypes)) == 1 else None


def cpu_decode_attention(query: Tensor, key: Tensor, value: Tensor, mask: Optional[Tensor],
                         scale: float) -> Optional[Tensor]:
    """softmax(query key^T x scale, masked) value per (row, K/V head), or None where it does not apply."""
    kind = _kind(query, key, value)
    if _problem(query, key, value, mask, kind) is not None:
        return None
    if kind == _AUTOCAST_KEYS:
        query = query.to(torch.bfloat16)  # as autocast casts sdpa's operands (the keys: in the kernel)
    B, heads, group, D = query.shape
    L = key.shape[2]
    out = torch.empty((B, heads, group, D), dtype=value.dtype)
    if L == 0:
        return out.zero_()
    if mask is not None:
        rows = mask[:, 0, 0, :].expand(B, L)
        if rows.stride(1) != 1:
            rows = rows.contiguous()
        mask_ptr, mask_strides = rows.data_ptr(), (rows.stride(0), 1)
    else:
        mask_ptr, mask_strides = None, (0, 0)
    sizes = (ctypes.c_int64 * 5)(B, heads, group, L, D)
    strides = (ctypes.c_int64 * 11)(*query.stride()[:3], *key.stride()[:3], *value.stride()[:3], *mask_strides)
    rc = library().decode_attention(kind, sizes, query.data_ptr(), key.data_ptr(), value.data_ptr(), mask_ptr, strides,
                                    float(scale), out.data_ptr(), int(SIMD), torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"decode_attention returned {rc}")
    return out
