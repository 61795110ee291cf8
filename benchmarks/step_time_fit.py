"""Fit the step-time model's efficiencies (lowmem_grpo/memory/step_time.py) to the measured H100 phases,
and print measured against estimated per phase.

    PYTHONPATH=. python benchmarks/step_time_fit.py          # the table with the shipped EFFICIENCY
    PYTHONPATH=. python benchmarks/step_time_fit.py --fit    # refit, print the new values and their table

The measurements (RESULTS.md, "Second GPU run", the second step of each: compiled decode, warm) come from
`benchmarks/trainer_step.py --arch A --recipe R --steps 2 --prompt-len 256 --completion-len C
--memory-cap-gib 8` on an H100 80GB HBM3 (SXM, PCIe gen5 x16). What trainer_step.py calls generation
holds the rollout and the reference log-probs (training/generation.py runs both), training the rest of
the step, and host update the offloaded optimizer's `_update_all` (waited for after the step's time).
So the estimate's generation + reference (+ the reference's copies) is compared with the first, its
training (+ its copies' stalls) with the second, its host update with the third.
The fit minimises the sum of squared log ratios (estimate / measured) over the six phases, one
efficiency at a time (golden-section search in log space), sweeping until nothing moves; `compute`
stays as shipped (the runs' training is mostly gradient copies and host adds, so they do not pin it).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lowmem_grpo.config import load_config  # noqa: E402
from lowmem_grpo.memory.cards import card  # noqa: E402
from lowmem_grpo.memory.plan import Arch  # noqa: E402
from lowmem_grpo.memory.presets import preset  # noqa: E402
from lowmem_grpo.memory.step_time import EFFICIENCY, Efficiency, estimate  # noqa: E402

# (name, arch, recipe, completion length, measured seconds per phase)
RUNS = (
    ("1.5B", "Qwen2.5-1.5B", "recipes/qwen2.5-1.5b_gsm8k_8gb.yaml", 512,
     {"generation": 2.34, "training": 4.73, "host_update": 0.41}),
    ("3B", "Qwen2.5-3B", "recipes/qwen2.5-3b_gsm8k_8gb.yaml", 384,
     {"generation": 1.98, "training": 13.5, "host_update": 0.80}),
)
# Held out of the fit: the 1.5B recipe with 4096-token completions (one step: its training phase; its
# generation holds the decode step's compilation), `--completion-len 4096 --steps 1`, the same run
HELD_OUT = (
    ("1.5B-4096", "Qwen2.5-1.5B", "recipes/qwen2.5-1.5b_gsm8k-4096_8gb.yaml", 4096, {"training": 8.9}),
)
CARD = "H100 SXM"
# The settings of the measured runs where the recipes have changed since: every micro-batch's gradients went
# down (no layer-major backward), the 3B recipe kept its layer inputs on the GPU, the 4096-token one ran
# four-row micro-batches; the reference was streamed once per micro-batch (`reference_per_micro_batch` below).
AS_RUN_ALL = ["layer_major_backward=false", "head_gradient_once_per_step=false", "layers_per_checkpoint=1"]
AS_RUN = {"recipes/qwen2.5-3b_gsm8k_8gb.yaml": ["offload_activations=false"],
          "recipes/qwen2.5-1.5b_gsm8k-4096_8gb.yaml": ["per_device_train_batch_size=4", "gradient_accumulation_steps=8",
                                                       "steps_per_generation=8"]}
FITTED = ("decode", "pcie", "host_update_gbps", "host_add_gbps")


@functools.lru_cache(maxsize=None)
def _setup(run_name: str) -> tuple:
    """(config, architecture) of a run: built once (an Arch builds a meta model)."""
    _, arch, recipe, completion, _ = next(r for r in RUNS + HELD_OUT if r[0] == run_name)
    cfg = load_config(str(ROOT / recipe), ["max_prompt_length=256", f"max_completion_length={completion}",
                                           *AS_RUN_ALL, *AS_RUN.get(recipe, [])], check=False)
    return cfg, Arch.from_config(preset(arch))


def as_measured(run: tuple, efficiency: Efficiency) -> dict[str, float]:
    """The estimate of `run` split as trainer_step.py splits the measured step (module docstring)."""
    s = estimate(*_setup(run[0]), card(CARD), efficiency, reference_per_micro_batch=True)  # as the runs streamed it
    return {"generation": s.generation + (s.reference or 0.0) + s.exposed.get("reference", 0.0),
            "training": s.training + s.exposed.get("training", 0.0), "host_update": s.host_update}


def errors(efficiency: Efficiency, runs: tuple = RUNS) -> list[tuple[str, str, float, float]]:
    """(run, phase, measured s, estimated s) for every measured phase of `runs`."""
    out = []
    for run in runs:
        estimated = as_measured(run, efficiency)
        out += [(run[0], phase, seconds, estimated[phase]) for phase, seconds in run[4].items()]
    return out


def loss(efficiency: Efficiency) -> float:
    return sum(math.log(e / m) ** 2 for _, _, m, e in errors(efficiency))


def fit(start: Efficiency = EFFICIENCY, sweeps: int = 6) -> Efficiency:
    """Coordinate descent over FITTED (module docstring); deterministic."""
    current = start
    for _ in range(sweeps):
        for name in FITTED:
            lo, hi = math.log(getattr(current, name) / 4), math.log(getattr(current, name) * 4)
            at = lambda x: loss(dataclasses.replace(current, **{name: math.exp(x)}))  # noqa: E731
            for _ in range(40):  # golden section on the log of the value
                a, b = hi - 0.618 * (hi - lo), lo + 0.618 * (hi - lo)
                lo, hi = (lo, b) if at(a) < at(b) else (a, hi)
            current = dataclasses.replace(current, **{name: math.exp((lo + hi) / 2)})
    return current


def table(efficiency: Efficiency) -> str:
    lines = [f"{'run':<10}{'phase':<13}{'measured s':>11}{'estimated s':>13}{'error':>9}"]
    rows = [(*row, "") for row in errors(efficiency)]
    for run in RUNS:  # the measured step (trainer_step.py's step_s) + its host update, against the estimate's total
        measured, estimated = (sum(r[i] for r in rows if r[0] == run[0]) for i in (2, 3))
        rows.append((run[0], "total", measured, estimated, ""))
    rows += [(*row, " (held out)") for row in errors(efficiency, HELD_OUT)]
    for run, phase, measured, estimated, mark in rows:
        lines.append(f"{run:<10}{phase:<13}{measured:>11.2f}{estimated:>13.2f}{estimated / measured - 1:>+9.1%}"
                     + mark)
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fit", action="store_true", help="refit the efficiencies before printing the table")
    args = ap.parse_args(argv)
    efficiency = fit() if args.fit else EFFICIENCY
    print(("fitted: " if args.fit else "shipped: ") + ", ".join(
        f"{f.name}={getattr(efficiency, f.name):.4g}" for f in dataclasses.fields(efficiency)))
    print(table(efficiency))
    return 0


if __name__ == "__main__":
    sys.exit(main())
