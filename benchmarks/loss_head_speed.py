"""Wall time of one forward+backward of the GRPO loss head: fused `linear_grpo_loss` vs naive torch.

Same head, shapes and loss as loss_head_memory.py (see bench_utils): H = 1536, V = 151936, bf16
weight and hidden (both requiring grad), N tokens as (N // 512) x 512, loss_type "dapo", beta 0.
  naive          logits = hidden @ W.T (bf16), fp32 log_softmax, gather, the same loss in torch.
  naive-compile  torch.compile of the naive loss (CUDA only).
  ours           lowmem_grpo.kernels.linear_grpo_loss.

How: for each implementation, one warm-up step (compilation, autotuning, first-touch page faults),
then `--repeats` timed steps of `loss = f(...); loss.backward()`, gradients set to None between steps
(outside the timed region); on CUDA the device is synchronised before starting and stopping the
clock. The median is reported, with achieved TFLOP/s counting only the head's GEMMs, 2 N H V flops
each: 3 for the naive head (logits, dh, dW), 4 for ours (the backward recomputes the logits), 3 for ours
where it keeps the logits for the backward (on the CPU, within CPU_KEEP_LOGITS_BYTES).
Implementations run one after another in one process on the same device; the ratio is from that run.

Target (PASS/FAIL line): on CPU at N = 4096, ours within 1.5x of the naive time. CPU timings are
disturbed by anything else running on the machine: run it on a quiet one.

`--hidden`, `--vocab` and `--dtype` set another head (SmolLM2-135M's: 576, 49152); `--cpu-workspace-mib`
runs ours once per CPU logits-workspace bound (lowmem_grpo/kernels/_backend.py, CPU_WORKSPACE_BYTES), each
row named by its bound; `--cpu-keep-mib` once per bound on the logits kept for the backward
(CPU_KEEP_LOGITS_BYTES; 0 recomputes them), each row named keep<bound>.

    python benchmarks/loss_head_speed.py --tokens 4096 --repeats 3 --json runs/loss_head_speed.json
    python benchmarks/loss_head_speed.py --impl ours --hidden 576 --vocab 49152 --dtype fp32 --tokens 512 1024 2048 \
        --cpu-workspace-mib 256 8
    python benchmarks/loss_head_speed.py --impl ours --hidden 576 --vocab 49152 --tokens 256 512 1024 \
        --cpu-keep-mib 0 256
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Optional

import torch

from lowmem_grpo.kernels import _backend
from lowmem_grpo.kernels.linear import keep_logits_fits
from bench_utils import (HIDDEN, IMPLS, VOCAB, batch_shape, clear_grads, default_device, forward_backward,
                         machine_info, make_inputs, naive_loss, write_json)

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
TARGET_SLOWDOWN = 1.5  # ours / naive time at N = 4096 on CPU
GEMMS = {"ours": 4, "naive": 3, "naive-compile": 3}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_impl(impl: str, n_tokens: int, device: str, repeats: int, dtype: torch.dtype,
              workspace_mib: Optional[int] = None, keep_mib: Optional[int] = None) -> dict:
    fn = torch.compile(naive_loss) if impl == "naive-compile" else IMPLS[impl]
    if workspace_mib is not None:
        _backend.CPU_WORKSPACE_BYTES = workspace_mib * 2**20
    if keep_mib is not None:
        _backend.CPU_KEEP_LOGITS_BYTES = keep_mib * 2**20
    gemms = GEMMS[impl] - (impl == "ours" and keep_logits_fits(n_tokens, VOCAB, dtype.itemsize, device))
    inputs = make_inputs(n_tokens, device, hidden_size=HIDDEN, vocab=VOCAB, dtype=dtype)
    times = []
    for i in range(repeats + 1):  # the first step is the warm-up
        clear_grads(inputs)
        sync(device)
        start = time.perf_counter()
        forward_backward(fn, inputs)
        sync(device)
        if i > 0:
            times.append(time.perf_counter() - start)
    del inputs
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    seconds = statistics.median(times)
    tflops = gemms * 2 * n_tokens * HIDDEN * VOCAB / seconds / 1e12
    label = impl + ("" if workspace_mib is None else f"@{workspace_mib}MiB") + (
        "" if keep_mib is None else f"@keep{keep_mib}MiB")
    print(f"  {label:13s} N={n_tokens:5d}: median {seconds * 1e3:9.1f} ms of {repeats}  "
          f"({tflops:.3f} TFLOP/s in the GEMMs)", flush=True)
    return {"impl": label, "n_tokens": n_tokens, "seconds": seconds, "times": times, "gemm_tflops": tflops,
            "cpu_workspace_mib": workspace_mib, "cpu_keep_mib": keep_mib}


def last_ours(impls: list[str], t: dict, n: int) -> Optional[str]:
    """The last-run row of ours (one per --cpu-workspace-mib and --cpu-keep-mib bound) at n tokens, or None."""
    return next((i for i in reversed(impls) if i.startswith("ours") and (i, n) in t), None)


def report(records: list[dict], device: str) -> list[str]:
    t = {(r["impl"], r["n_tokens"]): r for r in records}
    impls = list(dict.fromkeys(r["impl"] for r in records))
    print()
    print("| N | B x T | " + " | ".join(f"{i} (ms)" for i in impls) + " | ours / naive | ours TFLOP/s |")
    print("|---:|---:|" + "---:|" * (len(impls) + 2))
    for n in sorted({k[1] for k in t}):
        B, T = batch_shape(n)
        cells = [f"{t[i, n]['seconds'] * 1e3:.1f}" if (i, n) in t else "-" for i in impls]
        ours = last_ours(impls, t, n)
        ratio = f"{t[ours, n]['seconds'] / t['naive', n]['seconds']:.2f}x" if ours and ("naive", n) in t else "-"
        tflops = f"{t[ours, n]['gemm_tflops']:.3f}" if ours else "-"
        print(f"| {n} | {B} x {T} | " + " | ".join(cells) + f" | {ratio} | {tflops} |")
    print()
    ours = last_ours(impls, t, 4096)
    if device == "cpu" and ours and ("naive", 4096) in t:
        ratio = t[ours, 4096]["seconds"] / t["naive", 4096]["seconds"]
        status = "PASS" if ratio <= TARGET_SLOWDOWN else "FAIL"
        checks = [f"{status}: at N=4096 on CPU ours takes {ratio:.2f}x the naive time (target <= {TARGET_SLOWDOWN}x)"]
    else:
        checks = ["SKIP: the 1.5x target is defined for both impls at N=4096 on CPU"]
    for line in checks:
        print(line)
    return checks


def main() -> None:
    global VOCAB, HIDDEN  # --vocab, --hidden: read by the measuring function and the report
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=None,
                        help="N values (default: 4096 on CPU, 2048 4096 8192 on CUDA)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=default_device())
    parser.add_argument("--impl", choices=["ours", "naive", "both"], default="both")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per implementation (median)")
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    parser.add_argument("--vocab", type=int, default=VOCAB, help="vocabulary size")
    parser.add_argument("--hidden", type=int, default=HIDDEN, help="hidden size")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="hidden states' and weight's dtype")
    parser.add_argument("--cpu-workspace-mib", type=int, nargs="+", default=None,
                        help="CPU only: run ours once per logits-workspace bound (MiB)")
    parser.add_argument("--cpu-keep-mib", type=int, nargs="+", default=None,
                        help="CPU only: run ours once per bound on the logits kept for the backward (MiB; 0: none)")
    args = parser.parse_args()
    VOCAB, HIDDEN = args.vocab, args.hidden
    if args.cpu_workspace_mib and (args.device != "cpu" or args.impl == "naive"):
        parser.error("--cpu-workspace-mib times ours on the CPU: use it with --device cpu and --impl ours or both")
    if args.cpu_keep_mib and (args.device != "cpu" or args.impl == "naive"):
        parser.error("--cpu-keep-mib times ours on the CPU: use it with --device cpu and --impl ours or both")
    tokens = args.tokens or ([4096] if args.device == "cpu" else [2048, 4096, 8192])
    impls = ["naive", "ours"] if args.impl == "both" else [args.impl]
    if args.device == "cuda" and "naive" in impls:
        impls.insert(1, "naive-compile")

    info = machine_info(args.device)
    print(f"loss head speed: H={HIDDEN} V={VOCAB} {args.dtype}, {info}")
    dtype = DTYPES[args.dtype]
    runs = [(impl, mib, keep) for impl in impls
            for mib in ((args.cpu_workspace_mib or [None]) if impl == "ours" else [None])
            for keep in ((args.cpu_keep_mib or [None]) if impl == "ours" else [None])]
    records = [time_impl(impl, n, args.device, args.repeats, dtype, mib, keep)
               for n in tokens for impl, mib, keep in runs]
    checks = report(records, args.device)
    if args.json:
        write_json(args.json, {"benchmark": "loss_head_speed", "hidden": HIDDEN, "vocab": VOCAB,
                               "dtype": str(dtype).removeprefix("torch."), "repeats": args.repeats, "machine": info,
                               "results": records, "checks": checks})


if __name__ == "__main__":
    main()
