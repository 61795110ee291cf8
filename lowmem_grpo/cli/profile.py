"""`lowmem-grpo profile RECIPE [key=value ...] [--steps N] [--out DIR]`

Runs N real trainer steps of the recipe under the memory profiler (lowmem_grpo.memory.profile) and reports
peak memory per phase and per category, host and device: a table on the terminal, profile.json, and
timeline.png (memory by category over the steps); on CUDA also cuda_snapshot.pickle for PyTorch's
memory visualiser (https://pytorch.org/memory_viz). Beside the measurement it prints the planner's
prediction for the same settings (lowmem_grpo.memory.plan), so the two can be compared. Nothing is saved but
these files: no checkpoints, no metrics.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Optional

from ..config import Config, ConfigError
from ..memory.plan import Arch, plan
from ..memory.profile import device_equivalent, format_bytes, format_table, plot_timeline, profile_trainer


def run(recipe: str, cfg: Config, overrides: list[str], steps: int, out_dir: Optional[str]) -> int:
    """Profile `cfg` (the recipe loaded with `overrides`, as the command line gave them)."""
    from ..training.checkpoint import resolve_resume
    from ..training.trainer import Trainer  # torch/transformers only when profiling
    if steps < 1:
        raise ConfigError(f"--steps {steps}: profile at least one step")
    out = Path(out_dir or Path(cfg.output.output_dir) / "profile")
    out.mkdir(parents=True, exist_ok=True)
    # The profiled trainer writes no run files: it owns the profile folder, not output_dir, which may hold a
    # run (a resume_from=latest there still names that run's newest checkpoint).
    if cfg.output.resume_from == "latest":
        cfg.output.resume_from = str(resolve_resume("latest", cfg.output.output_dir))
    cfg.output.output_dir = str(out)
    trainer = Trainer(cfg, recipe_dir=Path(recipe).resolve().parent)
    snapshot = str(out / "cuda_snapshot.pickle") if trainer.device.type == "cuda" else None
    print(f"[lowmem-grpo] profiling {steps} step(s) of {recipe} on {trainer.device}")
    prof, times, (prompt_len, completion_len) = profile_trainer(trainer, steps, snapshot)
    result = prof.result
    # The planner's worst case (every sequence at its maximum length), and at this run's lengths.
    arch = Arch.from_config(trainer.policy.config)
    predicted = plan(cfg, arch, autocast=trainer.autocast, device=trainer.device.type)
    observed = copy.deepcopy(cfg)
    observed.generation.max_prompt_length, observed.generation.max_completion_length = prompt_len, completion_len
    predicted_observed = plan(observed, arch, autocast=trainer.autocast, device=trainer.device.type)
    kind, equivalent = device_equivalent(prof, trainer)
    measured = equivalent["peak_bytes"]
    summary = result.as_dict()
    summary.update(recipe=recipe, overrides=overrides, device=str(trainer.device), steps=steps, step_times_s=times,
                   training_device=kind, measured_peak_bytes=measured, device_equivalent=equivalent,
                   plan={k: getattr(predicted, k)
                         for k in ("peak_bytes", "peak_phase", "phases", "categories", "phase_categories")},
                   observed_lengths={"prompt": prompt_len, "completion": completion_len},
                   plan_at_observed_lengths={k: getattr(predicted_observed, k)
                                             for k in ("peak_bytes", "peak_phase", "phases")})
    main = summary["devices"][kind]  # the plan command's keys, for the training device
    summary.update(peak_bytes=main["peak_bytes"], phases={p: v["peak_bytes"] for p, v in main["phases"].items()},
                   categories=main["categories"])
    (out / "profile.json").write_text(json.dumps(summary, indent=2))
    for name, dev in summary["devices"].items():
        label = "GPU (allocator)" if name == "cuda" else ("host (CPU training device)" if trainer.device.type == "cpu"
                                                         else "host")
        print(f"\n== {label}")
        print(format_table(dev, name))
    print(f"\nsteps: {', '.join(f'{t:.1f}' for t in times)} s")
    g = cfg.generation
    print(f"measured peak{' (device-equivalent: no host-only reference)' if kind == 'host' else ''}: "
          f"{format_bytes(measured)} in {equivalent['peak_phase']}")
    for label, pred in ((f"at the recipe's maximum lengths ({g.max_prompt_length} + {g.max_completion_length})",
                         predicted),
                        (f"at this run's lengths ({prompt_len} + {completion_len} tokens)", predicted_observed)):
        diff = (pred.peak_bytes - measured) / max(measured, 1)
        print(f"planner {label}: {format_bytes(pred.peak_bytes)} in {pred.peak_phase} ({diff:+.1%})")
    try:
        plot_timeline(result, str(out / "timeline.png"),
                      title=f"{Path(recipe).name}: {steps} step(s) on {trainer.device}")
        print(f"wrote {out / 'profile.json'}, {out / 'timeline.png'}" + (f", {snapshot}" if snapshot else ""))
    except ImportError:
        print(f"wrote {out / 'profile.json'}; no timeline.png: matplotlib is not installed (pip install matplotlib)")
    return 0
