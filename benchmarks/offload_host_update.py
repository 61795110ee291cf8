"""The host side of optim.offload_optimizer: CPU time of one optimizer step against the memory bandwidth.

    python benchmarks/offload_host_update.py --models Qwen2.5-0.5B Qwen2.5-1.5B --json runs/offload.json

For each architecture (random weights of its exact tensor shapes; the time does not depend on the
values), the whole host step of one offloaded optimizer step, tensor by tensor, once every gradient is on
the host: the gradient's fp32 norm, the clip to the tensor's share of max_grad_norm, and the update of
the host copy. Two paths (`--paths`):

  today   what optim/offload.py did before host_adamw.py: fp32_norm_tensor, grad.mul_(coef),
          then sr_adamw.py's AdamW8bitSR (bitsandbytes' CPU 8-bit path, chunked, stochastic rounding);
          for `--optimizer adamw`: fp32_norm_tensor, grad.mul_(coef), the bf16 gradient widened to fp32,
          torch.optim.AdamW(fused=True) on the fp32 master, the master rounded into the bf16 upload buffer.
  fused   host_adamw.py: the norm as offload.py's global norm takes it (grad_norm: the kernel's one pass,
          grad_sum_squares, above one fp32_norm_tensor chunk), the clip coefficient handed to the
          kernel as grad_scale, the 8-bit AdamW with stochastic rounding in one pass per 256-block;
          for `adamw`: the same norm, then HostAdamW.step_fused: the bf16 gradient read as it is, the clip,
          torch's fused AdamW arithmetic and the master rounded into the upload buffer in one pass.

The 8-bit optimizer runs on bf16 weights and gradients (the 8 GB recipes' setting), `adamw` on fp32
masters with bf16 gradients (offload.py's master_fp32). One warm-up step (states are created), then the
median of `--repeats` steps. The same run measures the machine's memory bandwidth with the same thread
count (a 256 MiB fp32 copy_, read + write bytes) and prints, per path, ns per parameter, the bytes the
step must touch per parameter, and time / (bytes / bandwidth): how far the step is from the memory bound.

`--busy 0 1`: each path quiet, then with one competing process spinning on a core (the cores shared, as
with the trainer's main thread, its data and reward work, or another job), in the same run; the `x quiet`
column is the step's time over its quiet time in this run (memory-bound times use the quiet bandwidth).

`--norm-pass`: instead, the host's pass for the global norm (median of `--repeats`) over every bf16
gradient, as before `device_norms`, and over those a layer-major recipe still sums on the host (its
`device_norms` on CUDA take the others on the GPU as they leave): the input embedding's, whose gradient
arrives as the rows each micro-batch's lookup read (with a tied head, its part too). Two ways per tensor:
fp32_norm_tensor (what optim/offload.py's `_global_norm` took until the kernel's pass), and host_adamw's
grad_norm (what it takes now: the kernel's pass above one chunk).

The copies across PCIe are not timed here (they run on the GPU's copy engines, beside the host update);
their bytes are computed: every gradient down and every weight up per step. Host RAM needed for the run:
weight copy + gradient buffer + states (host_ram.host_bytes_per_param).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from lowmem_grpo.memory.plan import Arch
from lowmem_grpo.memory.presets import preset
from lowmem_grpo.optim.host_ram import host_bytes_per_param, pcie_bytes_per_step
from lowmem_grpo.optim.optimizer_in_backward import fp32_norm_tensor

# Bytes one host step must read and write per parameter (the memory-bound floor):
#   adamw_8bit  norm: read grad (2); update: read grad, weight (2 + 2), two codes (2), write weight (2),
#               two codes (2); absmax 2 x 2 x 4 B per 256-block
#   adamw       norm: read grad (2); update: read grad (2), master, m, v (12), write them (12), write the
#               bf16 upload copy (2). (`today` touches 12 more: the fp32 widened copy written and read, the
#               master read again for the copy; and allocates that fp32 gradient each step.)
BYTES_PER_PARAM = {"adamw_8bit": 2 + 10 + 16 / 256, "adamw": 2 + 28}


def memory_bandwidth(repeats: int = 5) -> float:
    """Bytes per second of a 256 MiB fp32 copy_ (read + write), the best of `repeats`, torch's threads."""
    n = 64 << 20
    src, dst = torch.ones(n), torch.empty(n)
    dst.copy_(src)  # touch the pages
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(repeats))
    return 2 * 4 * n / best


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def host_tensors(arch: Arch, dtype: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One host weight per parameter tensor of the architecture, and its bf16 gradient buffer."""
    weights = [torch.empty(n, dtype=dtype).normal_(0, 0.02) for n in arch.tensor_sizes]
    grads = [torch.empty(n, dtype=torch.bfloat16).normal_(0, 1e-3) for n in arch.tensor_sizes]
    return weights, grads


class EightBitStep:
    """The 8-bit AdamW with stochastic rounding, per tensor: norm, clip, update (module docstring)."""

    def __init__(self, params, grads, fused: bool):
        from lowmem_grpo.optim import host_adamw
        from lowmem_grpo.optim.sr_adamw import sr_adamw8bit_class
        for p, g in zip(params, grads):
            p.grad = g
        if fused and host_adamw.library() is None:
            raise RuntimeError(f"the host kernel did not build: {host_adamw._load_error}")
        cls = host_adamw.host_adamw8bit_class() if fused else sr_adamw8bit_class()
        self.fused, self.params, self.host_adamw = fused, params, host_adamw
        self.optimizers = [cls([p], lr=1e-6, betas=(0.9, 0.99)) for p in params]

    def __call__(self, caps) -> None:
        for p, opt, cap in zip(self.params, self.optimizers, caps):
            norm = float(self.host_adamw.grad_norm(p.grad) if self.fused else fp32_norm_tensor(p.grad))
            coef = cap / (norm + 1e-6) if norm > cap else 1.0
            if self.fused:
                opt.param_groups[0]["grad_scale"] = coef
            elif coef != 1.0:
                p.grad.mul_(coef)
            opt.step()


class AdamWStep:
    """fp32 AdamW on an fp32 master with a bf16 gradient, as offload.py's master_fp32 path: `today` widens the
    gradient and steps torch's fused AdamW, `fused` steps host_adamw.HostAdamW in one pass (module docstring)."""

    def __init__(self, params, grads, fused: bool):
        from lowmem_grpo.optim import host_adamw
        if fused and host_adamw.library() is None:
            raise RuntimeError(f"the host kernel did not build: {host_adamw._load_error}")
        self.fused, self.params, self.grads, self.host_adamw = fused, params, grads, host_adamw
        self.upload = [torch.empty(p.shape, dtype=torch.bfloat16) for p in params]
        cls = host_adamw.HostAdamW if fused else torch.optim.AdamW
        self.optimizers = [cls([p], lr=1e-6, fused=True) for p in params]

    def __call__(self, caps) -> None:
        for p, g16, opt, cap, up in zip(self.params, self.grads, self.optimizers, caps, self.upload):
            if self.fused:  # the norm in one pass, then clip, update and the rounded copy in one more
                norm = float(self.host_adamw.grad_norm(g16))
                scale = cap / (norm + 1e-6) if norm > cap else 1.0
                assert opt.step_fused(p, g16, grad_scale=scale, round_into=up)
                continue
            norm = float(fp32_norm_tensor(g16))
            if norm > cap:
                g16.mul_(cap / (norm + 1e-6))
            p.grad = g16.float()  # offload.py's _update: exact widening for the fp32 master
            opt.step()
            p.grad = None
            up.copy_(p.detach())  # the master rounded to nearest into the upload buffer


@contextmanager
def busy_processes(count: int):
    """`count` processes that each keep one core busy (a Python spin loop) until the block ends."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        if procs:
            time.sleep(0.5)  # started and spinning
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def measure(name: str, optimizer: str, path: str, repeats: int, busy: list[int]) -> list[dict]:
    """One row per entry of `busy`: the median host step over `repeats` with that many busy processes."""
    arch = Arch.from_config(preset(name))
    dtype = torch.float32 if optimizer == "adamw" else torch.bfloat16
    params, grads = host_tensors(arch, dtype)
    total = sum(p.numel() for p in params)
    caps = [1.0 * (p.numel() / total) ** 0.5 for p in params]
    step = (AdamWStep if optimizer == "adamw" else EightBitStep)(params, grads, fused=path == "fused")
    step(caps)  # warm-up: the states are allocated (and the kernel built)
    rows = []
    for count in busy:
        times, cpu = [], []
        with busy_processes(count):
            for _ in range(repeats):
                c0 = time.process_time()
                times.append(_timed(lambda: step(caps)))
                cpu.append(time.process_time() - c0)
        seconds = statistics.median(times)
        rows.append({"model": name, "params": arch.params, "optimizer": optimizer, "path": path,
                     "dtype": str(dtype), "busy_processes": count,
                     "host_update_s": seconds, "host_update_ns_per_param": seconds / arch.params * 1e9,
                     "bytes_per_param": BYTES_PER_PARAM[optimizer],
                     "host_ram_gib": host_bytes_per_param(2, optimizer) * arch.params / 2**30,
                     "pcie_gib_per_step": pcie_bytes_per_step(arch.params, 2) / 2**30, "times_s": times,
                     # CPU seconds of this process's threads (spin-waits included): on an idle machine about
                     # threads x the wall time
                     "cpu_ns_per_param": statistics.median(cpu) / arch.params * 1e9})
    del step, params, grads
    gc.collect()
    return rows


def norm_pass(name: str, repeats: int) -> dict:
    """Seconds of the host's global-norm pass over every gradient and over the host-summed ones, each way."""
    from lowmem_grpo.optim.host_adamw import grad_norm
    arch = Arch.from_config(preset(name))
    grads = [torch.empty(n, dtype=torch.bfloat16).normal_(0, 1e-3) for n in arch.tensor_sizes]
    host_summed = grads[:1]  # the input embedding: the first tensor (lookup_rows.py's rows, summed on the host)
    row = {"model": name, "params": arch.params, "host_summed_params": sum(g.numel() for g in host_summed)}
    for way, norm in (("chunks", fp32_norm_tensor), ("kernel", grad_norm)):
        def seconds(tensors):
            return statistics.median(_timed(lambda: [norm(g) for g in tensors]) for _ in range(repeats))
        seconds(grads)  # warm-up
        row[f"every_gradient_s_{way}"], row[f"host_summed_s_{way}"] = seconds(grads), seconds(host_summed)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["Qwen2.5-0.5B", "Qwen2.5-1.5B"])
    ap.add_argument("--optimizer", choices=["adamw_8bit", "adamw"], default="adamw_8bit")
    ap.add_argument("--paths", nargs="+", choices=["today", "fused"], default=["today", "fused"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--busy", nargs="+", type=int, default=[0],
                    help="competing busy processes (one core each) per measurement; 0 1: quiet, then one")
    ap.add_argument("--norm-pass", action="store_true", help="time the host's global-norm pass instead")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_utils import machine_info
    if args.norm_pass:
        print(f"machine: {machine_info('cpu')}")
        print("| model | norm | host norm pass, every gradient (s) | ns / parameter | host-summed tensors' (s) | "
              "their parameters |")
        print("|---|---|---:|---:|---:|---:|")
        rows = [norm_pass(name, args.repeats) for name in args.models]
        for r in rows:
            for way, label in (("chunks", "fp32_norm_tensor"), ("kernel", "grad_norm")):
                every = r[f"every_gradient_s_{way}"]
                print(f"| {r['model']} | {label} | {every:.3f} | {every / r['params'] * 1e9:.3f} | "
                      f"{r[f'host_summed_s_{way}']:.3f} | {r['host_summed_params'] / 1e6:.0f}M of "
                      f"{r['params'] / 1e6:.0f}M |")
        if args.json:
            Path(args.json).write_text(json.dumps({"machine": machine_info("cpu"), "rows": rows}, indent=2))
        return 0
    bandwidth = memory_bandwidth()
    rows = []
    print(f"machine: {machine_info('cpu')}")
    print(f"memory bandwidth (fp32 copy_, read + write, {torch.get_num_threads()} threads): {bandwidth / 1e9:.1f} GB/s")
    print("| model | optimizer | path | busy processes | host step (s) | ns / parameter | x quiet | "
          "bytes / parameter | memory-bound ns | x memory bound | CPU ns / parameter (all threads) | "
          "host RAM (GiB) | PCIe per step (GiB) |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.models:
        for path in args.paths:
            quiet = None
            for r in measure(name, args.optimizer, path, args.repeats, args.busy):
                bound_ns = r["bytes_per_param"] / bandwidth * 1e9
                quiet = r["host_update_s"] if r["busy_processes"] == 0 else quiet
                r.update(bandwidth_gb_s=bandwidth / 1e9, memory_bound_ns_per_param=bound_ns,
                         x_memory_bound=r["host_update_ns_per_param"] / bound_ns,
                         x_quiet=None if quiet is None else r["host_update_s"] / quiet)
                rows.append(r)
                x_quiet = "" if r["x_quiet"] is None else f"{r['x_quiet']:.2f}"
                print(f"| {name} | {args.optimizer} | {path} | {r['busy_processes']} | "
                      f"{r['host_update_s']:.2f} | {r['host_update_ns_per_param']:.2f} | {x_quiet} | "
                      f"{r['bytes_per_param']:.1f} | "
                      f"{bound_ns:.2f} | {r['x_memory_bound']:.1f} | {r['cpu_ns_per_param']:.2f} | "
                      f"{r['host_ram_gib']:.1f} | {r['pcie_gib_per_step']:.2f} |", flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps({"machine": machine_info("cpu"), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
