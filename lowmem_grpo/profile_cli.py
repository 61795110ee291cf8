"""`lowmem-grpo profile RECIPE [key=value ...] [--steps N] [--out DIR]`

Runs N real trainer steps of the recipe under the memory profiler (memory_profile.py) and reports
peak memory per phase and per category, host and device: a table on the terminal, profile.json, and
timeline.png (memory by category over the steps); on CUDA also cuda_snapshot.pickle for PyTorch's
memory visualiser (https://pytorch.org/memory_viz). Beside the measurement it prints the planner's
prediction for the same settings (memory_plan.py), so the two can be compared. Nothing is saved but
these files: no checkpoints, no metrics.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Optional

import torch

from .config import Config, ConfigError
from .memory_plan import Arch, plan
from .memory_profile import MemoryProfile, format_bytes, format_table, plot_timeline


def profile_trainer(trainer, steps: int, cuda_snapshot: Optional[str] = None) -> tuple[MemoryProfile, list[float], tuple]:
    """Run `steps` trainer steps under a MemoryProfile; returns it, the step times (seconds) and the
    longest (prompt, completion) widths of the batches the steps used (padded, in tokens)."""
    reference = []
    if trainer.ref is not None:
        reference = list(trainer.ref.model.parameters()) + list(trainer.ref.model.buffers())
    batch = trainer.generation.batch.state_dict().values() if trainer.generation is not None else ()
    weights = list(trainer.policy.parameters()) + list(trainer.policy.buffers())
    times, widths = [], (0, 0)
    with MemoryProfile(weights, trainer.optimizer, reference, batch, cuda_snapshot=cuda_snapshot) as prof:
        for _ in range(steps):
            t0 = time.perf_counter()
            gb, _, _ = trainer.run_step()
            if trainer.device.type == "cuda":
                torch.cuda.synchronize(trainer.device)
            times.append(time.perf_counter() - t0)
            widths = (max(widths[0], gb.batch.prompt_ids.shape[1]), max(widths[1], gb.batch.completion_ids.shape[1]))
    return prof, times, widths


def device_equivalent(prof: MemoryProfile, trainer) -> tuple[str, dict]:
    """The training device's summary as the planner predicts it: without host-only categories.

    On CUDA that is the GPU timeline as it is. On a CPU run everything shares the host, so the
    reference model (host RAM on any device) and, when the reference computes on the CPU, its
    buffers are left out, as they would be on a GPU.
    """
    result = prof.result
    if "cuda" in result.devices and trainer.device.type == "cuda":
        return "cuda", result.devices["cuda"].summary()
    excluded = ["reference model"]
    if trainer.ref is not None and trainer.ref.device.type == "cpu":
        excluded.append("reference buffers")
    return "host", result.devices["host"].summary(exclude=excluded)


def run(recipe: str, cfg: Config, overrides: list[str], steps: int, out_dir: Optional[str]) -> int:
    """Profile `cfg` (the recipe loaded with `overrides`, as the command line gave them)."""
    from .trainer import Trainer  # torch/transformers only when profiling
    if steps < 1:
        raise ConfigError(f"--steps {steps}: profile at least one step")
    out = Path(out_dir or Path(cfg.output.output_dir) / "profile")
    out.mkdir(parents=True, exist_ok=True)
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
                   plan={k: predicted[k] for k in ("peak_bytes", "peak_phase", "phases", "categories", "phase_categories")},
                   observed_lengths={"prompt": prompt_len, "completion": completion_len},
                   plan_at_observed_lengths={k: predicted_observed[k] for k in ("peak_bytes", "peak_phase", "phases")})
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
        diff = (pred["peak_bytes"] - measured) / max(measured, 1)
        print(f"planner {label}: {format_bytes(pred['peak_bytes'])} in {pred['peak_phase']} ({diff:+.1%})")
    try:
        plot_timeline(result, str(out / "timeline.png"), title=f"{Path(recipe).name}: {steps} step(s) on {trainer.device}")
        print(f"wrote {out / 'profile.json'}, {out / 'timeline.png'}" + (f", {snapshot}" if snapshot else ""))
    except ImportError:
        print(f"wrote {out / 'profile.json'}; no timeline.png: matplotlib is not installed (pip install matplotlib)")
    return 0
