"""Ahead-of-time compilation of every Triton kernel for NVIDIA targets, no GPU needed.

    python -m lowmem_grpo.kernels.aot [--cc 75 80 86 89 90]

Compiles each kernel in every configuration the launchers use (logits dtype, constexpr flags, block
size) down to a cubin for each compute capability, and fails on a compile error or when a kernel
needs more shared memory than the target has. Must run without TRITON_INTERPRET (the interpreter
replaces the kernels with Python functions that cannot be compiled).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

# Opt-in shared memory per block, bytes (CUDA programming guide, "Compute capabilities").
SHARED_MEMORY_LIMIT = {75: 65536, 80: 166912, 86: 101376, 89: 101376, 90: 232448}
GPU_NAMES = {75: "Turing (RTX 20xx)", 80: "A100", 86: "Ampere (RTX 30xx)", 89: "Ada (RTX 40xx)", 90: "Hopper (H100)"}

LOGITS_DTYPES = ("fp32", "bf16", "fp16")
FLAGS = (False, True)


@dataclass(frozen=True)
class Spec:
    kernel: str  # attribute name in its module
    module: str
    signature: tuple  # ((name, type), ...); constexprs have type "constexpr"
    constexprs: tuple  # ((name, value), ...)
    num_warps: int

    @property
    def label(self) -> str:
        dtype = dict(self.signature).get("logits_ptr") or dict(self.signature).get("logp_ptr")
        flags = ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in self.constexprs)
        return f"{self.kernel}[{dtype} {flags} w{self.num_warps}]"


def _spec(module, kernel, signature, constexprs, num_warps):
    sig = tuple(signature) + tuple((k, "constexpr") for k, _ in constexprs)
    return Spec(kernel, module, sig, tuple(constexprs), num_warps)


def kernel_specs() -> list[Spec]:
    """Every configuration the launchers in logprobs_triton / grpo_loss_triton can produce."""
    # (BLOCK_V, num_warps) from block_config: 4096/8 for vocab-sized rows, small blocks for narrow slices
    blocks = ((4096, 8), (256, 4))
    specs = []
    lp, gl = "lowmem_grpo.kernels.logprobs_triton", "lowmem_grpo.kernels.grpo_loss_triton"
    for dt, (block, warps) in itertools.product(LOGITS_DTYPES, blocks):
        for acc, ent in itertools.product(FLAGS, FLAGS):
            specs.append(_spec(lp, "logits_stats_kernel", [
                ("logits_ptr", f"*{dt}"), ("ids_ptr", "*i64"), ("m_ptr", "*fp32"), ("s_ptr", "*fp32"),
                ("t_ptr", "*fp32"), ("xy_ptr", "*fp32"), ("stride_row", "i32"), ("n_cols", "i32"),
                ("col_offset", "i32"), ("inv_temp", "fp32"),
            ], [("ACCUMULATE", acc), ("HAS_ENTROPY", ent), ("BLOCK_V", block)], warps))
        for ent in FLAGS:
            specs.append(_spec(lp, "logits_grad_kernel", [
                ("logits_ptr", f"*{dt}"), ("ids_ptr", "*i64"), ("lse_ptr", "*fp32"), ("grad_ptr", "*fp32"),
                ("ent_ptr", "*fp32"), ("grad_ent_ptr", "*fp32"), ("stride_row", "i32"), ("n_cols", "i32"),
                ("col_offset", "i32"), ("inv_temp", "fp32"),
            ], [("HAS_ENT_GRAD", ent), ("BLOCK_V", block)], warps))
        for has_mask, has_old, has_ref in itertools.product(FLAGS, FLAGS, FLAGS):
            specs.append(_spec(gl, "grpo_row_kernel", [
                ("logits_ptr", f"*{dt}"), ("ids_ptr", "*i64"), ("adv_ptr", "*fp32"), ("mask_ptr", "*u8"),
                ("old_ptr", "*fp32"), ("ref_ptr", "*fp32"), ("loss_ptr", "*fp32"), ("logp_ptr", "*fp32"),
                ("kl_ptr", "*fp32"), ("code_ptr", "*i8"), ("dloss_ptr", "*fp32"), ("dkl_ptr", "*fp32"),
                ("lse_ptr", "*fp32"), ("stride_row", "i32"), ("n_cols", "i32"), ("inv_temp", "fp32"),
                ("eps_low", "fp32"), ("eps_high", "fp32"), ("beta", "fp32"),
            ], [("HAS_MASK", has_mask), ("HAS_OLD", has_old), ("HAS_REF", has_ref), ("BLOCK_V", block)], warps))
    for has_mask, has_old, has_ref in itertools.product(FLAGS, FLAGS, FLAGS):
        specs.append(_spec(gl, "grpo_token_kernel", [
            ("logp_ptr", "*fp32"), ("adv_ptr", "*fp32"), ("mask_ptr", "*u8"), ("old_ptr", "*fp32"),
            ("ref_ptr", "*fp32"), ("loss_ptr", "*fp32"), ("kl_ptr", "*fp32"), ("code_ptr", "*i8"),
            ("dloss_ptr", "*fp32"), ("dkl_ptr", "*fp32"), ("n_tokens", "i32"), ("eps_low", "fp32"),
            ("eps_high", "fp32"), ("beta", "fp32"),
        ], [("HAS_MASK", has_mask), ("HAS_OLD", has_old), ("HAS_REF", has_ref), ("BLOCK", 1024)], 4))
    return specs


def compile_spec(spec: Spec, cc: int) -> tuple[str, int, int | None, str | None]:
    """-> (label, cc, shared bytes or None, error or None)."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(spec.module), spec.kernel)
    try:
        src = ASTSource(fn=fn, signature=dict(spec.signature), constexprs=dict(spec.constexprs))
        compiled = triton.compile(src, target=GPUTarget("cuda", cc, 32), options={"num_warps": spec.num_warps})
        shared = int(compiled.metadata.shared)
    except Exception as exc:  # report every failure, not just the first
        return spec.label, cc, None, f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    if shared > SHARED_MEMORY_LIMIT[cc]:
        return spec.label, cc, shared, f"needs {shared} B shared memory, sm_{cc} has {SHARED_MEMORY_LIMIT[cc]}"
    return spec.label, cc, shared, None


def _compile_args(args):
    return compile_spec(*args)


def compile_all(ccs=tuple(SHARED_MEMORY_LIMIT), workers: int = 2):
    jobs = [(spec, cc) for cc in ccs for spec in kernel_specs()]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(_compile_args, jobs, chunksize=4))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cc", type=int, nargs="+", default=list(SHARED_MEMORY_LIMIT), choices=list(SHARED_MEMORY_LIMIT))
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    import os

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: interpreted kernels cannot be compiled", file=sys.stderr)
        return 2
    results = compile_all(tuple(args.cc), args.workers)
    failures = [r for r in results if r[3] is not None]
    for cc in args.cc:
        mine = [r for r in results if r[1] == cc]
        worst = max((r[2] or 0) for r in mine)
        bad = sum(r[3] is not None for r in mine)
        print(f"sm_{cc} {GPU_NAMES[cc]:<18} {len(mine) - bad}/{len(mine)} kernels compiled, "
              f"max shared memory {worst} B of {SHARED_MEMORY_LIMIT[cc]} B")
    for label, cc, _, err in failures:
        print(f"FAILED sm_{cc} {label}: {err}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
