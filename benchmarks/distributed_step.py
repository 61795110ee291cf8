"""Step time of the same work as 1 process and as N processes under torchrun (CPU, gloo).

    python benchmarks/distributed_step.py [--recipe R] [--steps 8] [--nproc 2] [--json out.json]

Runs RECIPE for --steps optimizer steps twice, with the same global generation batch:
  one      1 process,  per_device_train_batch_size = B,      OMP/torch threads = cores
  ranks    N processes, per_device_train_batch_size = B / N,  threads = cores / N each
and reports the mean step_time, generation_time and the rest (loss + optimizer), from metrics.jsonl,
over the steps after the first (warm-up). On a CPU the ranks share the machine's cores, so this
measures the cost of splitting the work (collectives, smaller GEMMs, per-rank Python), not a
speed-up; with one GPU per rank the split work runs in parallel.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(recipe: str, out: Path, nproc: int, batch: int, steps: int, threads: int) -> dict:
    args = ["-m", "lowmem_grpo", "train", recipe, f"output_dir={out}", f"max_steps={steps}", "save_steps=0",
            f"per_device_train_batch_size={batch // nproc}", "eval_on_start=false", "eval_on_end=false",
            "progress_bar=false", "device=cpu"]
    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
              if nproc > 1 else [sys.executable])
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    t0 = time.perf_counter()
    subprocess.run(launch + args, cwd=ROOT, env=env, check=True, capture_output=True)
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")][1:]  # the first step warms up
    step = statistics.mean(r["step_time"] for r in rows)
    gen = statistics.mean(r["generation_time"] for r in rows)
    return {"nproc": nproc, "threads_per_process": threads, "per_device_train_batch_size": batch // nproc,
            "mean_step_time_s": step, "mean_generation_time_s": gen, "mean_rest_s": step - gen,
            "mean_reward": statistics.mean(r["reward"] for r in rows), "wall_s": wall, "steps_timed": len(rows)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="recipes/smollm2-135m_arithmetic_cpu.yaml")
    p.add_argument("--batch", type=int, default=64, help="global per_device_train_batch_size x ranks")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        one = run(a.recipe, Path(tmp, "one"), 1, a.batch, a.steps, cores)
        ranks = run(a.recipe, Path(tmp, "ranks"), a.nproc, a.batch, a.steps, max(1, cores // a.nproc))
    result = {"recipe": a.recipe, "machine": f"{platform.processor() or platform.machine()}, {cores} cores (CPU)",
              "one_process": one, f"{a.nproc}_ranks": ranks,
              "step_time_ratio_ranks_over_one": ranks["mean_step_time_s"] / one["mean_step_time_s"]}
    print(json.dumps(result, indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
