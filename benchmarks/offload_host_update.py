"""The host side of optim.offload_optimizer: CPU time of one optimizer step, and bytes across PCIe.

    python benchmarks/offload_host_update.py --models Qwen2.5-0.5B Qwen2.5-1.5B Qwen2.5-3B --json runs/offload.json

For each architecture (random weights of its exact tensor shapes; the time does not depend on the
values), the host work of one offloaded step, tensor by tensor, exactly as
memory_modes/offload.py does it once a gradient has arrived: the fp32 norm, the per-tensor clip,
and the inner optimizer's step on the host copy (bitsandbytes 8-bit AdamW with stochastic rounding
on bf16 weights, the 8 GB recipes' setting; `--optimizer adamw` for torch AdamW on fp32). One
warm-up step (states are created), then the median of `--repeats` steps. The copies across PCIe
are not timed here (they run on the GPU's copy engines, beside the host update); their bytes are
computed: every gradient down and every weight up per step. A user's step time on their card is
about max(GPU backward, host update) + the last tensors' update, with the host update below.

Host RAM needed for the run: weight copy + gradient buffer + states (offload.host_bytes_per_param).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from lowmem_grpo.memory.plan import Arch
from lowmem_grpo.memory.presets import preset
from lowmem_grpo.memory_modes.offload import host_bytes_per_param, pcie_bytes_per_step
from lowmem_grpo.memory_modes.optimizer_in_backward import fp32_norm_tensor


def host_tensors(arch: Arch, dtype: torch.dtype) -> list[torch.Tensor]:
    """One host weight per parameter tensor of the architecture, with a gradient."""
    out = []
    for n in arch.tensor_sizes:
        w = torch.empty(n, dtype=dtype).normal_(0, 0.02)
        w.grad = torch.empty(n, dtype=dtype).normal_(0, 1e-3)
        out.append(w)
    return out


def make_optimizers(params: list[torch.Tensor], optimizer: str) -> list[torch.optim.Optimizer]:
    if optimizer == "adamw":
        return [torch.optim.AdamW([p], lr=1e-6) for p in params]
    from lowmem_grpo.memory_modes.sr_adamw import sr_adamw8bit_class
    cls = sr_adamw8bit_class()
    return [cls([p], lr=1e-6, betas=(0.9, 0.99)) for p in params]


def host_step(params, optimizers, caps) -> None:
    """What OffloadedOptimizerInBackward does on the host per tensor (norm, clip, update)."""
    for p, opt, cap in zip(params, optimizers, caps):
        norm = float(fp32_norm_tensor(p.grad))
        if norm > cap:
            p.grad.mul_(cap / (norm + 1e-6))
        opt.step()


def measure(name: str, optimizer: str, repeats: int) -> dict:
    arch = Arch.from_config(preset(name))
    dtype = torch.float32 if optimizer == "adamw" else torch.bfloat16
    wb = 4 if dtype == torch.float32 else 2
    params = host_tensors(arch, dtype)
    total = sum(p.numel() for p in params)
    caps = [1.0 * (p.numel() / total) ** 0.5 for p in params]
    optimizers = make_optimizers(params, optimizer)
    host_step(params, optimizers, caps)  # warm-up: the states are allocated
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        host_step(params, optimizers, caps)
        times.append(time.perf_counter() - t0)
    step = statistics.median(times)
    return {"model": name, "params": arch.params, "optimizer": optimizer, "dtype": str(dtype),
            "host_update_s": step, "host_update_ns_per_param": step / arch.params * 1e9,
            "host_ram_gib": host_bytes_per_param(wb, optimizer) * arch.params / 2**30,
            "pcie_gib_per_step": pcie_bytes_per_step(arch.params, wb) / 2**30, "times_s": times}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["Qwen2.5-0.5B", "Qwen2.5-1.5B", "Qwen2.5-3B"])
    ap.add_argument("--optimizer", choices=["adamw_8bit", "adamw"], default="adamw_8bit")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_utils import machine_info
    rows = []
    print(f"machine: {machine_info('cpu')}")
    print("| model | parameters | host update per step (s) | ns / parameter | host RAM (GiB) | PCIe per step (GiB) |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in args.models:
        r = measure(name, args.optimizer, args.repeats)
        rows.append(r)
        print(f"| {name} | {r['params'] / 1e9:.3f} B | {r['host_update_s']:.2f} | {r['host_update_ns_per_param']:.2f} | "
              f"{r['host_ram_gib']:.1f} | {r['pcie_gib_per_step']:.2f} |", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"machine": machine_info("cpu"), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
