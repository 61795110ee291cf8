"""Ahead-of-time compilation of every Triton kernel for NVIDIA targets, no GPU needed.

    python -m lowmem_grpo.kernels.aot [--cc 75 80 86 89 90] [--block-v 1 4096]

Compiles each kernel in every configuration the launchers can produce (logits dtype, constexpr flags,
block size and warps) down to a cubin for each compute capability, and fails on a compile error or
when a kernel needs more shared memory than the target has. The configurations come from the
launchers' own rules (logprobs_triton.block_configs, grpo_loss_triton.TOKEN_BLOCK / TOKEN_WARPS, the
ops' accepted dtypes _checks.FLOAT_DTYPES), so this list and the launchers cannot drift apart.
`--block-v` compiles a subset of the block sizes (the default test suite does; the full list is a
`slow` test). Must run without TRITON_INTERPRET (the interpreter replaces the kernels with Python
functions that cannot be compiled).

Design notes: docs/kernels.md ("Ahead-of-time compilation")
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

FLAGS = (False, True)


def logits_dtypes() -> tuple[str, ...]:
    """Triton names of the logits dtypes the ops accept (a dtype added there without a name here fails)."""
    import torch

    from ._checks import FLOAT_DTYPES

    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    return tuple(names[dt] for dt in FLOAT_DTYPES)


@dataclass(frozen=True)
class KernelConfig:
    """One kernel in one configuration: what Triton compiles to one binary per target."""

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


def _kernel_config(module, kernel, signature, constexprs, num_warps):
    sig = tuple(signature) + tuple((k, "constexpr") for k, _ in constexprs)
    return KernelConfig(kernel, module, sig, tuple(constexprs), num_warps)


def kernel_configs(block_v: tuple[int, ...] | None = None) -> list[KernelConfig]:
    """Every configuration the launchers in logprobs_triton / grpo_loss_triton can produce; with
    `block_v`, only the row kernels' configurations with those BLOCK_V (and every token kernel)."""
    from .grpo_loss_triton import TOKEN_BLOCK, TOKEN_WARPS
    from .logprobs_triton import block_configs

    blocks = [(b, w) for b, w in block_configs() if block_v is None or b in block_v]
    if block_v is not None and len(blocks) != len(set(block_v)):
        known = [b for b, _ in block_configs()]
        raise ValueError(f"--block-v {sorted(set(block_v) - set(known))} is not a block size the launchers use; "
                         f"choose from {known}")
    configs = []
    lp, gl = "lowmem_grpo.kernels.logprobs_triton", "lowmem_grpo.kernels.grpo_loss_triton"
    for dt, (block, warps) in itertools.product(logits_dtypes(), blocks):
        for acc, ent in itertools.product(FLAGS, FLAGS):
            configs.append(_kernel_config(lp, "logits_stats_kernel", [
                ("logits_ptr", f"*{dt}"), ("ids_ptr", "*i64"), ("bias_ptr", "*fp32"), ("m_ptr", "*fp32"),
                ("s_ptr", "*fp32"), ("t_ptr", "*fp32"), ("xy_ptr", "*fp32"), ("stride_row", "i32"), ("n_cols", "i32"),
                ("col_offset", "i32"), ("has_bias", "i32"), ("softcap", "fp32"), ("inv_temp", "fp32"),
            ], [("ACCUMULATE", acc), ("HAS_ENTROPY", ent), ("BLOCK_V", block)], warps))
        for ent in FLAGS:
            configs.append(_kernel_config(lp, "logits_grad_kernel", [
                ("logits_ptr", f"*{dt}"), ("ids_ptr", "*i64"), ("bias_ptr", "*fp32"), ("lse_ptr", "*fp32"),
                ("grad_ptr", "*fp32"), ("ent_ptr", "*fp32"), ("grad_ent_ptr", "*fp32"), ("stride_row", "i32"),
                ("n_cols", "i32"), ("col_offset", "i32"), ("has_bias", "i32"), ("softcap", "fp32"),
                ("inv_temp", "fp32"),
            ], [("HAS_ENT_GRAD", ent), ("BLOCK_V", block)], warps))
        for has_mask, has_old, has_ref, has_weight in itertools.product(FLAGS, FLAGS, FLAGS, FLAGS):
            configs.append(_kernel_config(gl, "grpo_row_kernel", [
                ("logits_ptr", f"*{dt}"), ("ids_ptr", "*i64"), ("adv_ptr", "*fp32"), ("mask_ptr", "*u8"),
                ("old_ptr", "*fp32"), ("ref_ptr", "*fp32"), ("weight_ptr", "*fp32"), ("loss_ptr", "*fp32"),
                ("logp_ptr", "*fp32"), ("kl_ptr", "*fp32"), ("code_ptr", "*i8"), ("dloss_ptr", "*fp32"),
                ("dkl_ptr", "*fp32"), ("lse_ptr", "*fp32"), ("stride_row", "i32"), ("n_cols", "i32"),
                ("inv_temp", "fp32"), ("variant", "i32"), ("eps_low", "fp32"), ("eps_high", "fp32"),
                ("delta", "fp32"), ("beta", "fp32"), ("bias_kl", "i32"), ("sapo_pos", "fp32"), ("sapo_neg", "fp32"),
            ], [("HAS_MASK", has_mask), ("HAS_OLD", has_old), ("HAS_REF", has_ref), ("HAS_WEIGHT", has_weight),
                ("BLOCK_V", block)], warps))
    for has_mask, has_old, has_ref, has_weight, has_coef in itertools.product(FLAGS, FLAGS, FLAGS, FLAGS, FLAGS):
        configs.append(_kernel_config(gl, "grpo_token_kernel", [
            ("logp_ptr", "*fp32"), ("adv_ptr", "*fp32"), ("mask_ptr", "*u8"), ("old_ptr", "*fp32"),
            ("ref_ptr", "*fp32"), ("weight_ptr", "*fp32"), ("coef_ptr", "*fp32"), ("loss_ptr", "*fp32"),
            ("kl_ptr", "*fp32"), ("code_ptr", "*i8"), ("dloss_ptr", "*fp32"), ("dkl_ptr", "*fp32"),
            ("n_tokens", "i32"), ("variant", "i32"), ("eps_low", "fp32"), ("eps_high", "fp32"), ("delta", "fp32"),
            ("beta", "fp32"), ("bias_kl", "i32"), ("sapo_pos", "fp32"), ("sapo_neg", "fp32"),
        ], [("HAS_MASK", has_mask), ("HAS_OLD", has_old), ("HAS_REF", has_ref), ("HAS_WEIGHT", has_weight),
            ("HAS_COEF", has_coef), ("BLOCK", TOKEN_BLOCK)], TOKEN_WARPS))
    return configs


def compile_config(config: KernelConfig, cc: int) -> tuple[str, int, int | None, str | None]:
    """-> (label, cc, shared bytes or None, error or None)."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(config.module), config.kernel)
    try:
        src = ASTSource(fn=fn, signature=dict(config.signature), constexprs=dict(config.constexprs))
        compiled = triton.compile(src, target=GPUTarget("cuda", cc, 32), options={"num_warps": config.num_warps})
        shared = int(compiled.metadata.shared)
    except Exception as exc:  # report every failure, not just the first
        return config.label, cc, None, f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    if shared > SHARED_MEMORY_LIMIT[cc]:
        return config.label, cc, shared, f"needs {shared} B shared memory, sm_{cc} has {SHARED_MEMORY_LIMIT[cc]}"
    return config.label, cc, shared, None


def _compile_args(args):
    return compile_config(*args)


def compile_all(ccs=tuple(SHARED_MEMORY_LIMIT), workers: int = 2, block_v: tuple[int, ...] | None = None):
    jobs = [(config, cc) for cc in ccs for config in kernel_configs(block_v)]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(_compile_args, jobs, chunksize=4))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cc", type=int, nargs="+", default=list(SHARED_MEMORY_LIMIT),
                        choices=list(SHARED_MEMORY_LIMIT))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--block-v", type=int, nargs="+", default=None,
                        help="compile only the row kernels with these BLOCK_V (default: every one the launchers use)")
    args = parser.parse_args(argv)
    import os

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: interpreted kernels cannot be compiled", file=sys.stderr)
        return 2
    block_v = None if args.block_v is None else tuple(args.block_v)
    try:
        kernel_configs(block_v)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    results = compile_all(tuple(args.cc), args.workers, block_v)
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
