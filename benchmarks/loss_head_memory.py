"""Peak memory of one forward+backward of the GRPO loss head: fused `linear_grpo_loss` vs naive torch.

What runs (see bench_utils): Qwen2.5-1.5B's head, H = 1536, V = 151936, bf16 weight and bf16 hidden
states, both requiring grad; N tokens shaped as (N // 512) sequences x 512 tokens; GRPO loss with
token-level ratio, clip 0.2, beta 0, old_logp None, loss_type "dapo", one advantage per sequence.
  naive  logits = hidden @ W.T (bf16 [N, V]), fp32 log_softmax, gather, the same loss in torch.
  ours   lowmem_grpo.kernels.linear_grpo_loss (vocabulary slices, no [N, V] tensor; on the CPU, the logits kept
         for the backward where they fit 256 MiB).

What is measured: the peak of tensor bytes allocated during `loss = f(...); loss.backward()`, above
what was allocated before the call. The inputs (W, hidden, ids, advantages) are not counted; everything
allocated during the call is, including the gradients dW and dh that outlive it.
  cpu   the profiler's allocator hook (bench_utils.cpu_peak_bytes). It sees allocations inside
        custom ops (our [N, chunk] workspace, fp32 [N, H] accumulator), which MemTracker does not;
        the script checks that on small cases before measuring.
  cuda  torch.cuda.max_memory_allocated() minus memory_allocated() before the call, after one
        warm-up call (cuBLAS workspaces, Triton autotuning).

Targets, checked in the output as PASS/FAIL lines:
  1. at N = 8192 our peak is at least 10x lower than the naive peak;
  2. our peak does not grow with N beyond the O(N H) tensors alive at it, the fp32 dh accumulator
     and one slice's dlogits @ W product (6 bytes per N H element, see `nh_terms`): the column
     "ours - O(N·H)" must not grow by more than FLAT_TOL from the smallest N to any larger one.

What to expect: the naive peak is in log_softmax's backward, three fp32 [N, V] tensors (saved
output, incoming gradient, input gradient) = 12 N V bytes, ~14 GiB at N = 8192. Ours is dW (V H
bytes of the weight dtype) + the [N, chunk] workspace + the row kernel's bounded temporaries, none of
which depends on N, plus the O(N H) terms above. Implementations run one at a time, inputs and
gradients freed in between.

    python benchmarks/loss_head_memory.py --tokens 2048 4096 8192 --json runs/loss_head_memory.json
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from bench_utils import (GiB, HIDDEN, IMPLS, VOCAB, batch_shape, check_tracker, clear_grads, default_device,
                         forward_backward, machine_info, make_inputs, peak_bytes, write_json)

TARGET_RATIO = 10.0  # naive peak / our peak at N = 8192
FLAT_TOL = 0.05  # allowed growth of (our peak - O(N H) terms) from the smallest N, as a fraction


def nh_terms(n_tokens: int, hidden_bytes: int = 2) -> int:
    """Bytes of the O(N H) tensors alive at our peak, which is in the backward's vocabulary loop: the
    fp32 dh accumulator and one slice's product dlogits_s @ W_s in the hidden dtype (the batch has no
    padding mask, so the hidden states are not gathered into a copy)."""
    return n_tokens * HIDDEN * (hidden_bytes + 4)


def measure(impl: str, n_tokens: int, device: str) -> dict:
    inputs = make_inputs(n_tokens, device, vocab=VOCAB)
    fn = IMPLS[impl]
    if device == "cuda":  # first-call allocations (cuBLAS workspace) are not the head's
        forward_backward(fn, inputs)
        clear_grads(inputs)
    start = time.perf_counter()
    peak = peak_bytes(lambda: forward_backward(fn, inputs), device)
    seconds = time.perf_counter() - start
    B, T = batch_shape(n_tokens)
    del inputs
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    print(f"  {impl:5s} N={n_tokens:5d} (B={B} x T={T}): peak {peak / GiB:7.3f} GiB  [{seconds:.0f} s]", flush=True)
    return {"impl": impl, "n_tokens": n_tokens, "batch": B, "seq_len": T, "peak_bytes": peak}


def report(records: list[dict]) -> list[str]:
    """Print the table and the target checks; return the check lines."""
    peak = {(r["impl"], r["n_tokens"]): r["peak_bytes"] for r in records}
    tokens = sorted({r["n_tokens"] for r in records})

    def gib(key):
        return f"{peak[key] / GiB:.3f}" if key in peak else "-"

    print()
    print("| N | B x T | naive peak (GiB) | ours peak (GiB) | naive / ours | ours - O(N·H) (GiB) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n in tokens:
        B, T = batch_shape(n)
        ratio = f"{peak['naive', n] / peak['ours', n]:.1f}x" if ("naive", n) in peak and ("ours", n) in peak else "-"
        flat = f"{(peak['ours', n] - nh_terms(n)) / GiB:.3f}" if ("ours", n) in peak else "-"
        print(f"| {n} | {B} x {T} | {gib(('naive', n))} | {gib(('ours', n))} | {ratio} | {flat} |")
    print()

    checks = []
    if ("naive", 8192) in peak and ("ours", 8192) in peak:
        ratio = peak["naive", 8192] / peak["ours", 8192]
        status = "PASS" if ratio >= TARGET_RATIO else "FAIL"
        checks.append(f"{status}: at N=8192 our peak is {ratio:.1f}x lower than naive (target >= {TARGET_RATIO:.0f}x)")
    else:
        checks.append("SKIP: the 10x target needs both impls at N=8192")
    ours_n = [n for n in tokens if ("ours", n) in peak]
    if len(ours_n) >= 2:
        flat = {n: peak["ours", n] - nh_terms(n) for n in ours_n}
        growth = max(flat.values()) / flat[ours_n[0]] - 1.0
        status = "PASS" if growth <= FLAT_TOL else "FAIL"
        checks.append(f"{status}: our peak minus the O(N·H) terms grows by {growth:+.1%} from N={ours_n[0]} "
                      f"to N={ours_n[-1]} (target <= {FLAT_TOL:.0%})")
    else:
        checks.append("SKIP: the flatness target needs ours at two or more N")
    for line in checks:
        print(line)
    return checks


def main() -> None:
    global VOCAB  # --vocab: read by the measuring function and the report
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096, 8192], help="N values")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=default_device())
    parser.add_argument("--impl", choices=["ours", "naive", "both"], default="both")
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    parser.add_argument("--vocab", type=int, default=VOCAB, help="vocabulary size (smaller only for rehearsals)")
    args = parser.parse_args()
    VOCAB = args.vocab
    impls = ["ours", "naive"] if args.impl == "both" else [args.impl]

    info = machine_info(args.device)
    print(f"loss head memory: H={HIDDEN} V={VOCAB} bf16, {info}")
    tracker_ok = None
    if args.device == "cpu":
        print("tracker self-check:")
        tracker_ok = check_tracker()
    records = [measure(impl, n, args.device) for n in args.tokens for impl in impls]
    checks = report(records)
    if args.json:
        write_json(args.json, {"benchmark": "loss_head_memory", "hidden": HIDDEN, "vocab": VOCAB, "dtype": "bfloat16",
                               "machine": info, "tracker_self_check": tracker_ok, "nh_terms_bytes_per_token":
                               nh_terms(1), "results": records, "checks": checks})


if __name__ == "__main__":
    main()
