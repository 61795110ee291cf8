"""Memory tools: measure, attribute and predict the memory of a GRPO step.

    track.py          memory.track(): peak memory around any code (CUDA allocator / CPU profiler events)
    profile.py        MemoryProfile: per-phase, per-category memory of real trainer steps over time
    plan.py           plan(): the predicted peak of each phase from a model config and settings alone
                      (a MemoryPlan; arch.py: Arch; host_plan.py: host RAM; suggest.py: changes that fit)
    fit.py            the card's free memory against plan()'s peak, checked before weights load
    layer_probe.py    the per-token activation costs plan() uses, measured on a one-layer model
    presets.py        architectures (config dicts) of the models people train, for plan() and benchmarks
    parallel_plan.py  per-rank memory under torchrun (DDP, FSDP)

May import the settings (lowmem_grpo.config), the phase markers (lowmem_grpo.phases), the kernels and
the training loop's pieces; never the CLI. `track` is importable from here (`memory.track()`); the
other tools load on first use of their module, so `from lowmem_grpo import memory` stays light.
Design notes: docs/planner.md
"""

from .track import Tracked, cpu_running_totals, track

__all__ = ["track", "Tracked", "cpu_running_totals"]
