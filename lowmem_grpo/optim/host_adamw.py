"""Fused CPU kernels for the offloaded optimizer's host step, loaded with ctypes (sources: host_adamw.cpp,
host_adamw_fp32.cpp, host_grad_norm.cpp, host_pool.cpp; compiled on first use by torch.utils.cpp_extension).

`host_adamw8bit_class()`: bitsandbytes' AdamW8bit (via sr_adamw.py) whose CPU tensors with 8-bit states step
in one pass per 256-element block; states equal bitsandbytes' bitwise, state_dicts load either way.
`HostAdamW`: torch's fused CPU AdamW on fp32 masters; `step_fused(master, grad, lr=, grad_scale=,
round_into=)` is the offloaded optimizer's one-pass entry (False where it cannot run). Both read
`group["grad_scale"]` (the clip factor, applied inside the kernel; reset to 1.0 after the step).
`grad_sum_squares`: a gradient's squared norm, the same bits for any thread count; `grad_norm` its norm.
Where the kernel cannot build or LOWMEM_GRPO_HOST_KERNEL=0, the torch path runs after one warning;
`kernel_status()` says which. LOWMEM_GRPO_HOST_KERNEL_MARCH picks the -march (and so the SIMD path).

Design notes: docs/memory-modes.md ("The host AdamW kernels")
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..native_build import build_library

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("host_adamw.cpp")
SOURCES = [SOURCE, SOURCE.with_name("host_adamw_fp32.cpp"), SOURCE.with_name("host_grad_norm.cpp"),
           SOURCE.with_name("host_pool.cpp")]  # kernels; threads
HEADERS = [SOURCE.with_name("host_pool.h")]
CFLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-pthread", "-ffp-contract=off", "-fno-math-errno",
          "-std=c++17"]
_FP32, _BF16 = 0, 1  # dtype codes of the C ABI
_KIND = {torch.float32: _FP32, torch.bfloat16: _BF16}

_library: ctypes.CDLL | None = None
_load_error: str | None = None  # why the kernel is unavailable (logged once), None while untried or loaded
_luts: dict[bytes, torch.Tensor] = {}
_march: str | None = None  # the -march of the loaded build
SIMD = True  # False: the kernel's scalar loops only (what a CPU without AVX2 runs; the tests run every path)


def _build(march: str = "native") -> ctypes.CDLL:
    """Compile (or find in torch's extension cache) and load the kernels for `-march=<march>`."""
    flags = [f if f != "-march=native" else f"-march={march}" for f in CFLAGS]
    lib = build_library("lowmem_grpo_host_adamw", SOURCES, flags, HEADERS,
                        target=None if march == "native" else march.replace("-", "_"))
    p, i64, i32, u32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_uint32, ctypes.c_float
    lib.build_quantize_lut.argtypes = [p, p]
    lib.build_quantize_lut.restype = None
    lib.quantize_table_bytes.argtypes = []
    lib.quantize_table_bytes.restype = i64
    lib.adamw8bit_step.argtypes = [i64, p, i32, p, i32, p, p, p, p, p, p, p, p,  # sizes and data pointers
                                   f32, f32, f32, f32, f32, f32, f32, f32, i32, f32,  # Adam constants
                                   i32, u32, u32, i32, i32]  # rounding, seed, SIMD, threads
    lib.adamw8bit_step.restype = i32
    lib.quantize_blockwise.argtypes = [i64, p, p, p, p, i32]
    lib.quantize_blockwise.restype = None
    lib.adamw_step.argtypes = [i64, p, p, i32, p, p, p,  # sizes and data pointers
                               f32, f32, f32, f32, f32, f32, f32, i32, f32,  # AdamW constants, gradient scale
                               i32, i32]  # SIMD, threads
    lib.adamw_step.restype = i32
    lib.grad_sum_squares.argtypes = [i64, p, i32, i32]
    lib.grad_sum_squares.restype = ctypes.c_double
    lib.simd_lanes.argtypes = []
    lib.simd_lanes.restype = i32
    return lib


def library() -> ctypes.CDLL | None:
    """The compiled kernels, built on first use; None (after one warning) where they cannot be had."""
    global _library, _load_error, _march
    if _library is not None or _load_error is not None:
        return _library
    if os.environ.get("LOWMEM_GRPO_HOST_KERNEL", "1") == "0":
        _load_error = "LOWMEM_GRPO_HOST_KERNEL=0"
        logger.warning("host optimizer kernel off (LOWMEM_GRPO_HOST_KERNEL=0): the host optimizer step (the "
                       "offloaded optimizer's, or a CPU model's) takes bitsandbytes' or torch's CPU path, several "
                       "times slower; unset it to use the kernel")
        return None
    march = os.environ.get("LOWMEM_GRPO_HOST_KERNEL_MARCH", "native")
    try:
        _library, _march = _build(march), march
    except Exception as e:  # noqa: BLE001  (a failed build of any kind means: fall back)
        lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
        detail = next((line for line in lines if "error:" in line.lower()), lines[-1] if lines else "")
        _load_error = f"{type(e).__name__}: {detail}"[:300]  # the compiler's first error, else the last line
        logger.warning("the fused host optimizer kernel (optim/host_adamw.cpp) did not build (%s); the host "
                       "optimizer step (the offloaded optimizer's, or a CPU model's) takes bitsandbytes' or torch's "
                       "CPU path, several times slower. Fix: install a C++ compiler (g++) and ninja (pip install "
                       "ninja), then restart",
                       _load_error)
    return _library


class HostKernelUnavailable(RuntimeError):
    """The host optimizer kernel is not loaded: the offloaded optimizer's host step falls back to
    bitsandbytes' CPU path (8-bit AdamW) or torch's AdamW (fp32), several times slower."""


@dataclass(frozen=True)
class KernelStatus:
    """Which host optimizer step this process runs (`kernel_status`)."""

    native: bool      # True: the compiled kernel is loaded and the offloaded optimizer's host step runs in it
    reason: str       # why it is not ("" when native): the build's error or LOWMEM_GRPO_HOST_KERNEL=0
    path: str | None  # the loaded library file
    march: str | None  # the -march it was built for ("native" unless LOWMEM_GRPO_HOST_KERNEL_MARCH says)
    simd_lanes: int   # lanes of its loops: 16 (AVX-512), 8 (AVX2), 1 (scalar); 0 when not native
    threads: int      # threads per call (torch.get_num_threads())

    def __str__(self) -> str:
        if not self.native:
            return f"host optimizer kernel: FALLBACK (bitsandbytes' / torch's CPU step): {self.reason}"
        return (f"host optimizer kernel: native, {self.simd_lanes}-lane loops, -march={self.march}, "
                f"{self.threads} threads ({self.path})")


def kernel_status(require: bool = False) -> KernelStatus:
    """Load the host optimizer kernel (building it on first use: seconds, once per process and CPU type) and
    say whether the offloaded optimizer's host step runs in it (`native`) or in the fallback, with the reason
    and the fix. Returns the same answer for the rest of the process (a failed build is not retried; its
    warning is logged once). Never raises unless `require=True`: then a fallback raises
    HostKernelUnavailable, its message the status's text, for an environment check that must fail loudly."""
    lib = library()
    if lib is None:
        reason = _load_error or "not loaded"
        if reason == "LOWMEM_GRPO_HOST_KERNEL=0":
            reason += " (the kernel is switched off; unset it to use the kernel)"
        else:
            reason += ". Fix: a C++ compiler (g++) and ninja (pip install ninja), then restart"
        status = KernelStatus(False, reason, None, None, 0, _threads())
        if require:
            raise HostKernelUnavailable(str(status))
        return status
    return KernelStatus(True, "", getattr(lib, "_name", None), _march, int(lib.simd_lanes()), _threads())


def _lut(qmap: torch.Tensor) -> torch.Tensor:
    """bitsandbytes' CPU quantisation table for a 256-entry code (65536 codes) and the forms of the code the
    kernel's vector loops read (host_adamw.cpp, build_quantize_lut), built once per code."""
    key = qmap.detach().float().cpu().contiguous().numpy().tobytes()
    table = _luts.get(key)
    if table is None:
        code = torch.frombuffer(bytearray(key), dtype=torch.float32)
        table = torch.empty(library().quantize_table_bytes(), dtype=torch.uint8)
        library().build_quantize_lut(code.data_ptr(), table.data_ptr())
        _luts[key] = table
    return table


def quantize_blockwise(x: torch.Tensor, qmap: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8, absmax fp32 per 256-block) of fp32 CPU tensor `x` by the kernel's quantizer, which
    the optimizer step applies to its states; for comparing with bitsandbytes' quantize_blockwise."""
    if library() is None:
        raise RuntimeError(f"host_adamw.quantize_blockwise needs the compiled kernel ({_load_error})")
    x = x.detach().float().contiguous()
    codes = torch.empty(x.shape, dtype=torch.uint8)
    absmax = torch.empty((x.numel() + 255) // 256, dtype=torch.float32)
    library().quantize_blockwise(x.numel(), x.data_ptr(), _lut(qmap).data_ptr(), codes.data_ptr(), absmax.data_ptr(),
                                 int(SIMD))
    return codes, absmax


def _threads() -> int:
    """Threads per kernel call (the caller included): torch's intra-op thread count."""
    return torch.get_num_threads()


def grad_sum_squares(grad: torch.Tensor) -> float | None:
    """Sum of squares of a contiguous fp32 or bf16 CPU tensor (fp32 partial sums per 64Ki elements, added in
    fp64: independent of the thread count), or None where the kernel is unavailable."""
    if grad.device.type != "cpu" or grad.dtype not in _KIND or not grad.is_contiguous():
        return None
    lib = library()
    if lib is None:
        return None
    return lib.grad_sum_squares(grad.numel(), grad.data_ptr(), _KIND[grad.dtype], _threads())


def grad_norm(grad: torch.Tensor) -> torch.Tensor:
    """The L2 norm of a gradient as a 0-dim fp32 tensor on its device, for the offloaded optimizer's global
    norm. Up to one chunk of `fp32_norm_tensor` (NORM_CHUNK elements), that function: torch's vector_norm,
    the plain path's bits. Above it, where the chunks already round otherwise than the plain path, the
    kernel's one pass (`grad_sum_squares`) for a contiguous fp32 or bf16 CPU tensor: about 2.5x faster than
    the chunks on an Intel Xeon, 5x on an AMD EPYC (benchmarks/RESULTS.md), and nearer the exact norm (partial
    sums added in fp64). Elsewhere (a device tensor, no kernel) the chunks."""
    from .optimizer_in_backward import NORM_CHUNK, fp32_norm_tensor
    total = grad_sum_squares(grad) if grad.numel() > NORM_CHUNK else None
    if total is None:
        return fp32_norm_tensor(grad)
    return torch.tensor(math.sqrt(total), dtype=torch.float32)


def _seed_keys(generator: torch.Generator | None = None) -> tuple[int, int]:
    """64 random bits from `generator` (default: torch's default CPU generator), as the two 32-bit keys of
    the rounding noise."""
    seed = int(torch.randint(-(2 ** 63), 2 ** 63 - 1, (), dtype=torch.int64, generator=generator)) & (2 ** 64 - 1)
    return seed & 0xFFFFFFFF, seed >> 32


def adamw8bit_step(p: torch.Tensor, grad: torch.Tensor, state: dict, *, lr: float, beta1: float, beta2: float,
                   eps: float, weight_decay: float, step: int, grad_scale: float = 1.0,
                   stochastic_rounding: bool = True, generator: torch.Generator | None = None) -> bool:
    """One bitsandbytes 8-bit AdamW update of CPU tensor `p` in place, with its 8-bit `state` (bitsandbytes'
    keys; `step` already counted); the rounding seed from `generator` (default the global one). Returns
    False, touching nothing, where the kernel cannot take it."""
    lib = library()
    tensors = (p, grad, state["state1"], state["state2"], state["absmax1"], state["absmax2"])
    if (lib is None or p.dtype not in _KIND or grad.dtype not in _KIND or grad.numel() != p.numel()
            or state["state1"].dtype != torch.uint8 or state["state2"].dtype != torch.uint8
            or any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors)):
        return False
    lut1, lut2 = _lut(state["qmap1"]), _lut(state["qmap2"])
    qmap1, qmap2 = (state[k].detach().float().cpu().contiguous() for k in ("qmap1", "qmap2"))
    key0, key1 = _seed_keys(generator) if p.dtype == torch.bfloat16 and stochastic_rounding else (0, 0)
    correction1 = 1.0 - beta1 ** step  # bitsandbytes' CPU path, in Python floats as there
    correction2 = math.sqrt(1.0 - beta2 ** step)
    rc = lib.adamw8bit_step(
        p.numel(), p.data_ptr(), _KIND[p.dtype], grad.data_ptr(), _KIND[grad.dtype],
        state["state1"].data_ptr(), state["state2"].data_ptr(), state["absmax1"].data_ptr(),
        state["absmax2"].data_ptr(), qmap1.data_ptr(), qmap2.data_ptr(), lut1.data_ptr(), lut2.data_ptr(),
        beta1, 1.0 - beta1, beta2, 1.0 - beta2, correction2, eps, -lr / correction1, 1.0 - lr * weight_decay,
        int(weight_decay > 0.0), grad_scale, int(stochastic_rounding), key0, key1, int(SIMD), _threads())
    return rc == 0


def host_adamw8bit_class(paged: bool = False, stochastic_rounding: bool = True):
    """bitsandbytes' AdamW8bit (PagedAdamW8bit) whose CPU 8-bit updates run in the fused kernel; bf16 weights
    get stochastic rounding unless `stochastic_rounding=False` (then round to nearest, as bitsandbytes' own
    step). Takes `group["grad_scale"]` (docs/memory-modes.md, "Gradient scale")."""
    from .sr_adamw import _bnb, sr_adamw8bit_class
    bnb = _bnb()
    if stochastic_rounding:
        base = sr_adamw8bit_class(paged)
    else:
        base = bnb.optim.PagedAdamW8bit if paged else bnb.optim.AdamW8bit

    class HostAdamW8bit(base):
        """8-bit AdamW; CPU tensors with 8-bit states take host_adamw's fused kernel."""

        takes_grad_scale = True  # offload.py hands it the clip factor instead of clipping the gradient

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if library() is not None:  # bitsandbytes' two maps (fill_qmap): their tables exist before any step,
                for signed in (True, False):  # built once per process, not inside a profiled or timed step
                    _lut(bnb.functional.create_dynamic_map(signed=signed))

        @torch.no_grad()
        def update_step(self, group, p, gindex, pindex):
            scale = float(group.get("grad_scale", 1.0))
            try:
                if not self._fused_step(group, p, gindex, pindex, scale):
                    if scale != 1.0:  # the fallback path: clip the gradient itself in place
                        p.grad.mul_(scale)
                    super().update_step(group, p, gindex, pindex)
            finally:
                if p is group["params"][-1]:  # the group's last parameter: the scale was for this step
                    group["grad_scale"] = 1.0

        def _fused_step(self, group, p, gindex, pindex, scale) -> bool:
            state = self.state[p]
            config = self.get_config(gindex, pindex, group)
            betas = config["betas"]
            if (p.device.type != "cpu" or state["state1"].dtype != torch.uint8 or self.optimizer_name != "adam"
                    or config["max_unorm"] > 0.0 or config["skip_zeros"] or (len(betas) > 2 and betas[2] != 0)
                    or config.get("alpha", 0.0) != 0.0 or not p.is_contiguous() or library() is None):
                return False
            grad = p.grad.contiguous()
            ok = adamw8bit_step(p.data, grad, state, lr=config["lr"], beta1=betas[0], beta2=betas[1],
                                eps=config["eps"], weight_decay=config["weight_decay"], step=state["step"] + 1,
                                grad_scale=scale, stochastic_rounding=stochastic_rounding,
                                generator=getattr(self, "rounding_generator", None))  # offload.py's, per step
            if ok:
                state["step"] += 1
            return ok

        @torch.no_grad()
        def step(self, closure=None):
            try:
                return super().step(closure)
            finally:
                for group in self.param_groups:
                    group["grad_scale"] = 1.0

    return HostAdamW8bit


# ----- fp32 AdamW (optim.optimizer=adamw with offload_optimizer) -------------------------------------------

def _adamw_takes(p, grad, exp_avg, exp_avg_sq, round_into) -> bool:
    """Whether adamw_step's kernel takes these tensors: contiguous CPU tensors of one size, fp32 weight and
    states, an fp32 or bf16 gradient, a bf16 upload buffer (or none)."""
    tensors = (p, grad, exp_avg, exp_avg_sq) + (() if round_into is None else (round_into,))
    return (p.dtype == exp_avg.dtype == exp_avg_sq.dtype == torch.float32 and grad.dtype in _KIND
            and (round_into is None or round_into.dtype == torch.bfloat16)
            and all(t.numel() == p.numel() and t.device.type == "cpu" and t.layout == torch.strided
                    and t.is_contiguous() for t in tensors))


def adamw_step(p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *, lr: float,
               beta1: float, beta2: float, eps: float, weight_decay: float, step: int, grad_scale: float = 1.0,
               round_into: torch.Tensor | None = None) -> bool:
    """One torch.optim.AdamW update (fused=True's CPU arithmetic, bitwise) of fp32 CPU tensor `p` in place, with
    its fp32 states (`step` already counted), reading `grad` as it is (fp32 or bf16; a bf16 gradient times
    `grad_scale` is rounded to bf16 first, as the in-place clip of a bf16 buffer leaves it) and writing the new
    `p` rounded to nearest even into bf16 `round_into` (may be `grad` itself) in the same pass. Returns False,
    touching nothing, where the kernel cannot take it."""
    lib = library()
    if lib is None or not _adamw_takes(p, grad, exp_avg, exp_avg_sq, round_into):
        return False
    # torch's kernel: these in double (Python floats), each rounded to fp32 where it is used (ctypes' c_float)
    correction1 = 1.0 - beta1 ** step
    correction2 = math.sqrt(1.0 - beta2 ** step)
    rc = lib.adamw_step(p.numel(), p.data_ptr(), grad.data_ptr(), _KIND[grad.dtype], exp_avg.data_ptr(),
                        exp_avg_sq.data_ptr(), None if round_into is None else round_into.data_ptr(),
                        beta2, 1.0 - beta2, 1.0 - beta1, correction2, eps, -(lr / correction1),
                        1.0 - lr * weight_decay, int(weight_decay != 0.0), grad_scale, int(SIMD), _threads())
    return rc == 0


class HostAdamW(torch.optim.AdamW):
    """torch.optim.AdamW whose CPU fp32 updates run in host_adamw.cpp's fused kernel: torch's fused CPU AdamW
    arithmetic op for op (bitwise equal to fused=True), one pass, the GIL released. The state_dict is torch
    AdamW's own (state['step'] a float32 tensor, 'exp_avg', 'exp_avg_sq'): checkpoints load either way.

    Takes `group["grad_scale"]` as HostAdamW8bit does (the clip coefficient, applied inside the pass; back to
    1.0 after the step). Parameters the kernel cannot take (CUDA, fp64, non-contiguous, sparse gradients, a
    group with amsgrad, maximize or differentiable, or no compiled kernel) step in torch's own AdamW (the
    `fused`/`foreach` given here), their gradient multiplied by the scale first.

    `step_fused(param, grad, ...)`: the offloaded optimizer's entry (offload.py `_update`): one parameter
    from a gradient buffer of its own dtype (bf16 for an fp32 master), clip and rounding into the upload
    buffer in the same pass; no `.grad` (a bf16 gradient cannot be an fp32 parameter's `.grad`)."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        rest = []  # parameters for torch's own step
        for group in self.param_groups:
            scale, group["grad_scale"] = float(group.get("grad_scale", 1.0)), 1.0
            for p in group["params"]:
                if p.grad is not None and not self._fused(group, p, p.grad, scale, None):
                    if scale != 1.0:  # the fallback: clip the gradient itself
                        p.grad.mul_(scale)
                    rest.append(p)
        if rest:  # torch's step skips parameters without .grad: hide those the kernel has stepped
            keep = {id(p) for p in rest}
            hidden = [(p, p.grad) for g in self.param_groups for p in g["params"]
                      if p.grad is not None and id(p) not in keep]
            for p, _ in hidden:
                p.grad = None
            try:
                super().step()
            finally:
                for p, grad in hidden:
                    p.grad = grad
        return loss

    @torch.no_grad()
    def step_fused(self, param: torch.Tensor, grad: torch.Tensor, *, lr: float | None = None,
                   grad_scale: float = 1.0, round_into: torch.Tensor | None = None) -> bool:
        """Update `param` (one of this optimizer's) from `grad`, read in its own dtype (fp32 or bf16), as if
        multiplied by `grad_scale` in that dtype first; write the new weight rounded to nearest even into bf16
        `round_into` (may be `grad` itself: each element is read before it is written). `lr`: the group's rate
        for this step (stored in the group, as the offloaded optimizer's inner steps do). Returns False,
        touching nothing, where the kernel cannot take it (then the caller clips, widens, steps and copies)."""
        group = next(g for g in self.param_groups if any(q is param for q in g["params"]))
        if lr is not None:
            group["lr"] = lr
        return self._fused(group, param, grad, grad_scale, round_into)

    def _fused(self, group: dict, p: torch.Tensor, grad: torch.Tensor, scale: float,
               round_into: torch.Tensor | None) -> bool:
        if (library() is None or group["amsgrad"] or group["maximize"] or group.get("differentiable")
                or p.device.type != "cpu" or p.dtype != torch.float32):
            return False
        state = self.state[p]
        if not state:  # torch AdamW's state, as its _init_group makes it (fused: a float32 step on the device),
            if not _adamw_takes(p, grad, p, p, round_into):  # made only if the kernel will take it
                return False
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        beta1, beta2 = group["betas"]
        step = int(state["step"]) + 1
        ok = adamw_step(p.data, grad, state["exp_avg"], state["exp_avg_sq"], lr=float(group["lr"]), beta1=beta1,
                        beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"], step=step,
                        grad_scale=scale, round_into=round_into)
        if ok:
            state["step"] += 1
        return ok
