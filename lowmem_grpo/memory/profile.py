"""Where the memory of a GRPO step goes: per phase and per category, host and device, over time.

`MemoryProfile` runs the PyTorch profiler with memory events (CPU activity only, on a GPU too) and gives each
allocation a category from where it was made: the `lowmem_grpo::` ops (loss head), `scope("optimizer")`,
`scope("activation offload")`, a parameter's `.grad` (gradients), or the trainer's phase (`phases.phase`).
Tensors alive at the start are counted by walking the model, the reference model and the optimizer. The
categories at any moment add up to the allocator's total (CUDA) or the tracked tensor bytes (CPU).
`profile_trainer` runs a trainer's steps under it.

Design notes: docs/planner.md ("The profiler")
"""

from __future__ import annotations

import bisect
import contextlib
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Iterable, Optional

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from ..phases import GRAD_MARK, PHASES, PREFIX, mark_gradient
from ..rewards.model import reward_models

CATEGORIES = ("weights", "gradients", "optimizer states", "activations", "KV cache", "loss head",
              "reference model", "reference buffers", "reward model", "reward buffers", "rollout batch",
              "weights copy", "gradient buffer", "activations (offloaded)", "other")
_PHASE_CATEGORY = {"rollout": "KV cache", "old log-probs": "activations", "reference log-probs": "reference buffers",
                   "rewards": "reward buffers", "forward": "activations", "backward": "activations",
                   "optimizer": "optimizer states"}
# e.g. optimizer steps taken inside backward; activation offload's host copies, whatever op saved them
_SCOPE_CATEGORY = {"optimizer": "optimizer states", "activation offload": "activations (offloaded)"}
_BATCH_PHASES = ("rollout", "old log-probs", "reference log-probs")  # their outputs live on as the batch
GiB = 2**30


def _storages(tensors: Iterable[torch.Tensor]) -> dict[tuple[str, int], int]:
    """(device, storage pointer) -> bytes, each storage once (tied weights, views)."""
    out = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            s = t.untyped_storage()
            out[(_device_kind(t.device), s.data_ptr())] = s.nbytes()
    return out


def _views(tensors: Iterable[torch.Tensor]) -> dict[tuple[str, int], int]:
    """(device, data pointer) -> bytes of each tensor itself: for views that share one storage with others
    (a HostArena's buffers), where `_storages` would count the whole block for each category."""
    return {(_device_kind(t.device), t.data_ptr()): t.numel() * t.element_size() for t in tensors
            if isinstance(t, torch.Tensor) and t.device.type != "meta"}


def _cuda_device(device, params: list[torch.Tensor]) -> Optional[torch.device]:
    """The CUDA device a profile reads: `device` (with its index made explicit, so no API call falls
    back to the current device), else the first CUDA parameter's; None for a CPU run."""
    if device is not None:
        device = torch.device(device)
        if device.type != "cuda":
            return None
        return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
    return next((p.device for p in params if isinstance(p, torch.Tensor) and p.is_cuda), None)


# The profiler's activities, on a CPU or a GPU alike (module docstring: CUDA allocations are recorded
# without the CUDA activity).
ACTIVITIES = (ProfilerActivity.CPU,)


def _device_kind(device) -> str:
    """'cuda' for GPU memory, 'host' for everything in CPU RAM (pinned included)."""
    return "cuda" if torch.device(device).type == "cuda" else "host"


@dataclass
class _Alloc:
    start: int  # ns
    end: Optional[int]  # ns, None while alive
    size: int
    device: str
    ptr: int
    category: str
    phase: Optional[tuple[int, int, str]]  # (start ns, end ns, name) of the phase it was made in


@dataclass
class DeviceTimeline:
    """Bytes per category over time on one device kind ('cuda' or 'host')."""

    times: np.ndarray  # (n,) seconds since the profile started
    bytes: np.ndarray  # (n, len(CATEGORIES)) int64, after each event
    phase_at: list  # (n,) phase name or None
    reserved: Optional[np.ndarray] = None  # CUDA: the allocator's reserved bytes after each event

    def totals(self) -> np.ndarray:
        return self.bytes.sum(1)

    def summary(self, exclude: Iterable[str] = ()) -> dict:
        """Peak, its phase and categories; each phase's peak and categories; each category's own max.

        `exclude`: categories left out of the totals (e.g. host-only ones when a CPU run stands in for
        a GPU run)."""
        keep = [i for i, c in enumerate(CATEGORIES) if c not in set(exclude)]
        total = self.bytes[:, keep].sum(1)
        i = int(total.argmax())
        out = {"peak_bytes": int(total[i]), "peak_phase": self.phase_at[i] or "between phases",
               "peak_time_s": float(self.times[i]), "categories": self._at(i, keep),
               "category_max": {CATEGORIES[k]: int(self.bytes[:, k].max()) for k in keep}, "phases": {}}
        for name in PHASES:
            idx = [k for k, p in enumerate(self.phase_at) if p == name]
            if not idx:
                continue
            j = max(idx, key=lambda k: total[k])
            entry = {"peak_bytes": int(total[j]), "categories": self._at(j, keep)}
            if self.reserved is not None:
                entry["peak_reserved_bytes"] = int(self.reserved[idx].max())
            out["phases"][name] = entry
        if self.reserved is not None:
            out["peak_reserved_bytes"] = int(self.reserved.max())
        return out

    def _at(self, i: int, keep: list[int]) -> dict:
        return {CATEGORIES[k]: int(self.bytes[i, k]) for k in keep}


@dataclass
class ProfileResult:
    devices: dict[str, DeviceTimeline]
    phase_spans: list[tuple[str, float, float]]  # (phase, start s, end s)
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"devices": {d: tl.summary() for d, tl in self.devices.items()}, **self.extra}


class MemoryProfile:
    """Profile the memory of the code run inside `with MemoryProfile(...)`, attributing it to categories.

    `params`: the model's parameters (and buffers, if they should count as weights): their storages
    are weights, and the .grad of those that require grad are gradients; `optimizer`: whose state
    tensors are optimizer states; `reference`: the reference model's tensors; `reward_models`: the reward
    models' tensors (their streamed layers' device copies count as reward buffers); `batch`: tensors of a
    generation batch already in hand. `cuda_snapshot`: a path for the CUDA allocator's history.
    `device`: the CUDA device whose allocator is read (peaks reset on entry, so the allocator's peak
    is the block's own, not model loading's); default the device of the first CUDA parameter, and
    none (a CPU profile) when no parameter is on CUDA.
    After the block, `.result` holds a ProfileResult (None if the block raised).
    """

    def __init__(self, params: list[torch.Tensor], optimizer=None, reference: Iterable[torch.Tensor] = (),
                 batch: Iterable[torch.Tensor] = (), cuda_snapshot: Optional[str] = None, device=None,
                 reward_models: Iterable[torch.Tensor] = ()):
        self.params = list(params)
        self.reward_models = list(reward_models)
        self.cuda_device = _cuda_device(device, self.params)
        self.optimizer = optimizer
        self.reference = list(reference)
        self.batch = list(batch)
        self.cuda_snapshot = cuda_snapshot
        self.result: Optional[ProfileResult] = None
        self._hooks = []

    def __enter__(self) -> "MemoryProfile":
        dev = self.cuda_device
        if dev is not None:
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)  # the block's peak, not model loading's
            self._cuda_start = torch.cuda.memory_allocated(dev)
            if self.cuda_snapshot:  # PyTorch's memory visualiser reads this (pytorch.org/memory_viz)
                torch.cuda.memory._record_memory_history(max_entries=1_000_000, device=dev)
        self._baseline = self._known_tensors()
        # Gradients: mark every .grad once accumulated (an optimizer-in-backward hook marks its own
        # before freeing it; hooks run in registration order, so these then see .grad == None).
        self._hooks = [p.register_post_accumulate_grad_hook(lambda p: mark_gradient(p.grad))
                       for p in self.params if p.requires_grad]
        self._prof = profile(activities=list(ACTIVITIES), profile_memory=True)
        with _quiet_profiler_lines():
            self._prof.__enter__()
        with record_function(PREFIX + "start"):
            pass
        return self

    def __exit__(self, *exc) -> None:
        dev = self.cuda_device
        if dev is not None:
            torch.cuda.synchronize(dev)
        with _quiet_profiler_lines():
            self._prof.__exit__(*exc)
        for h in self._hooks:
            h.remove()
        extra = {}
        if dev is not None:
            extra["cuda_allocator"] = {"device": str(dev), "max_allocated_bytes": torch.cuda.max_memory_allocated(dev),
                                       "max_reserved_bytes": torch.cuda.max_memory_reserved(dev)}
            if self.cuda_snapshot:
                torch.cuda.memory._dump_snapshot(self.cuda_snapshot)
                torch.cuda.memory._record_memory_history(enabled=None, device=dev)
                extra["cuda_snapshot"] = self.cuda_snapshot
        if exc[0] is None:
            self.result = self._analyse(extra)

    # ----- what was there before -----------------------------------------------------------------
    def _known_tensors(self) -> dict[str, dict]:
        states = []
        if self.optimizer is not None:
            inner = getattr(self.optimizer, "inner", None)  # OptimizerInBackward: one optimizer per parameter
            for opt in (inner.values() if isinstance(inner, dict) else [self.optimizer]):
                states += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        known = {"weights": _storages(self.params), "optimizer states": _storages(states),
                 "reference model": _storages(self.reference), "reward model": _storages(self.reward_models),
                 "rollout batch": _storages(self.batch)}
        # optim.offload_optimizer (optim/offload.py): the host weight copies and gradient buffers,
        # views of one block (host_arena.py), so counted view by view, not by storage
        for category, attr in (("weights copy", "host"), ("gradient buffer", "host_grad")):
            held = getattr(self.optimizer, attr, None)
            if isinstance(held, dict):
                known[category] = _views(held.values())
        for attr in ("head_host", "_staging"):  # the tied head's contribution, the accumulation's staging ring
            held = getattr(self.optimizer, attr, None)
            if isinstance(held, torch.Tensor):
                known["gradient buffer"] = {**known.get("gradient buffer", {}), **_views([held])}
        return known

    # ----- attribution ---------------------------------------------------------------------------
    def _analyse(self, extra: dict) -> ProfileResult:
        tree = self._prof.profiler.kineto_results.experimental_event_tree()
        allocs_raw, spans, grad_marks, start_ns = [], [], [], None
        stack = [(root, None) for root in reversed(tree)]
        while stack:  # depth-first, carrying the innermost label on the path
            node, label = stack.pop()
            name = node.name
            if node.tag == torch._C._profiler._EventType.Allocation:
                f = node.extra_fields
                allocs_raw.append((node.start_time_ns, f.alloc_size, str(f.device), f.ptr, label,
                                   f.total_reserved))
                continue
            if name.startswith(PREFIX):
                key = name[len(PREFIX):]
                if key == "start":
                    start_ns = node.start_time_ns
                elif key.startswith("phase:"):
                    spans.append((node.start_time_ns, node.end_time_ns, key[6:]))
                elif name.startswith(GRAD_MARK):
                    grad_marks.append((node.start_time_ns, int(name[len(GRAD_MARK):])))
                elif key in _SCOPE_CATEGORY:
                    label = _SCOPE_CATEGORY[key]
            elif name.startswith("lowmem_grpo::"):
                label = "loss head"
            stack += [(c, label) for c in reversed(node.children)]
        allocs_raw.sort(key=lambda a: a[0])
        spans.sort()
        start_ns = start_ns if start_ns is not None else (allocs_raw[0][0] if allocs_raw else 0)
        allocs = self._pair(allocs_raw, spans)
        self._apply_grad_marks(allocs, grad_marks)
        for a in allocs:  # a rollout/log-prob output that outlives its phase is part of the batch
            if a.phase and a.phase[2] in _BATCH_PHASES and a.category != "loss head":
                if a.end is None or a.end > a.phase[1]:
                    a.category = "rollout batch"
        devices = self._timelines(allocs, allocs_raw, spans, start_ns)
        phase_spans = [(n, (s - start_ns) / 1e9, (e - start_ns) / 1e9) for s, e, n in spans]
        return ProfileResult(devices, phase_spans, extra)

    def _pair(self, raw: list, spans: list) -> list[_Alloc]:
        """Allocation records (alloc with its free) with a category from label, then phase."""
        starts = [s for s, _, _ in spans]
        live: dict[tuple[str, int], _Alloc] = {}
        out = []
        self._unmatched_frees = []
        for t, size, dev, ptr, label, _ in raw:
            kind = _device_kind(dev)
            if size > 0:
                k = bisect.bisect_right(starts, t) - 1
                ph = spans[k] if k >= 0 and spans[k][0] <= t <= spans[k][1] else None
                cat = label or (_PHASE_CATEGORY[ph[2]] if ph else "other")
                a = _Alloc(t, None, size, kind, ptr, cat, ph)
                live[(kind, ptr)] = a
                out.append(a)
            elif size < 0:
                a = live.pop((kind, ptr), None)
                if a is not None:
                    a.end = t
                else:  # made before profiling started (e.g. the previous batch): leaves its category
                    self._unmatched_frees.append((t, -size, kind, ptr))
        return out

    @staticmethod
    def _apply_grad_marks(allocs: list[_Alloc], marks: list[tuple[int, int]]) -> None:
        by_ptr: dict[int, list[_Alloc]] = {}
        for a in allocs:
            by_ptr.setdefault(a.ptr, []).append(a)
        for t, ptr in marks:
            for a in by_ptr.get(ptr, ()):
                if a.start <= t and (a.end is None or t <= a.end):
                    a.category = "gradients"

    def _timelines(self, allocs: list[_Alloc], raw: list, spans: list, start_ns: int) -> dict[str, DeviceTimeline]:
        cat_index = {c: i for i, c in enumerate(CATEGORIES)}
        baseline: dict[str, np.ndarray] = {}
        for cat, storages in self._baseline.items():
            for (kind, _), nbytes in storages.items():
                baseline.setdefault(kind, np.zeros(len(CATEGORIES), np.int64))[cat_index[cat]] += nbytes
        if self.cuda_device is not None:  # what the allocator held at the start that we could not name
            b = baseline.setdefault("cuda", np.zeros(len(CATEGORIES), np.int64))
            b[cat_index["other"]] += max(0, self._cuda_start - int(b.sum()))
        # Which baseline storages a free belongs to (e.g. optimizer states replaced): by pointer.
        known = {key: cat for cat, storages in self._baseline.items() for key in storages}
        events = []  # (t, kind, category index, delta)
        for a in allocs:
            events.append((a.start, a.device, cat_index[a.category], a.size))
            if a.end is not None:
                events.append((a.end, a.device, cat_index[a.category], -a.size))
        for t, size, kind, ptr in self._unmatched_frees:
            cat = known.get((kind, ptr))
            if cat is not None or kind == "cuda":  # a CPU free we know nothing of was never counted
                events.append((t, kind, cat_index[cat or "other"], -size))
        events.sort(key=lambda e: e[0])
        reserved_by_t = {t: r for t, size, dev, ptr, label, r in raw if _device_kind(dev) == "cuda"}
        starts = [s for s, _, _ in spans]
        out = {}
        for kind in sorted(set(baseline) | {e[1] for e in events}):
            evs = [e for e in events if e[1] == kind]
            deltas = np.zeros((len(evs) + 1, len(CATEGORIES)), np.int64)
            deltas[0] = baseline.get(kind, np.zeros(len(CATEGORIES), np.int64))
            for i, (_, _, c, d) in enumerate(evs, 1):
                deltas[i, c] = d
            times = [start_ns] + [e[0] for e in evs]  # ns, as ints (float64 cannot hold them exactly)
            phase_at = []
            for t in times:
                k = bisect.bisect_right(starts, t) - 1
                phase_at.append(spans[k][2] if k >= 0 and spans[k][0] <= t <= spans[k][1] else None)
            reserved = None
            if kind == "cuda":
                last, values = 0, []
                for t in times:
                    last = reserved_by_t.get(t, last)
                    values.append(last)
                reserved = np.array(values, np.int64)
            seconds = (np.array(times, np.int64) - start_ns) / 1e9
            out[kind] = DeviceTimeline(seconds, np.cumsum(deltas, 0), phase_at, reserved)
        return out


def format_bytes(n: int) -> str:
    return f"{n / GiB:.3f} GiB" if abs(n) >= GiB else f"{n / 2**20:.1f} MiB"


def format_table(summary: dict, device: str) -> str:
    """Categories (rows) at the peak of each phase (columns) and at the overall peak; GiB (MiB if small)."""
    phases = list(summary["phases"])
    short = {"old log-probs": "old-lp", "reference log-probs": "ref-lp"}
    unit, scale = ("GiB", GiB) if summary["peak_bytes"] >= GiB else ("MiB", 2**20)
    head = f"{unit + ' on ' + device:<20}" + "".join(f"{short.get(p, p):>10}" for p in phases) + f"{'PEAK':>10}"
    lines = [head]
    row = lambda name, vals: f"{name:<20}" + "".join(f"{v / scale:>10.3f}" for v in vals)  # noqa: E731
    for c in summary["categories"]:
        vals = [summary["phases"][p]["categories"][c] for p in phases] + [summary["categories"][c]]
        if any(vals):
            lines.append(row(c, vals))
    lines.append(row("total", [summary["phases"][p]["peak_bytes"] for p in phases] + [summary["peak_bytes"]]))
    if "peak_reserved_bytes" in summary:
        lines.append(row("reserved (allocator)", [summary["phases"][p].get("peak_reserved_bytes", 0) for p in phases]
                         + [summary["peak_reserved_bytes"]]))
    lines.append(f"peak {format_bytes(summary['peak_bytes'])} in {summary['peak_phase']} "
                 f"at {summary['peak_time_s']:.2f} s")
    return "\n".join(lines)


def plot_timeline(result: ProfileResult, path: str, title: str = "") -> None:
    """Stacked memory by category over the profiled steps, one panel per device, phases shaded."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    kinds = list(result.devices)
    fig, axes = plt.subplots(len(kinds), 1, figsize=(13, 3.8 * len(kinds)), squeeze=False, sharex=True)
    colors = plt.get_cmap("tab10").colors
    shade = {p: plt.get_cmap("Pastel2").colors[i] for i, p in enumerate(PHASES)}
    for ax, kind in zip(axes[:, 0], kinds):
        tl = result.devices[kind]
        keep = _thin(tl.totals(), 4000)
        used = [i for i, c in enumerate(CATEGORIES) if tl.bytes[:, i].any()]
        ax.stackplot(tl.times[keep], *(tl.bytes[keep, i] / GiB for i in used), step="post",
                     labels=[CATEGORIES[i] for i in used], colors=[colors[i % 10] for i in used], alpha=0.9)
        seen = set()
        for name, s, e in result.phase_spans:
            ax.axvspan(s, e, color=shade[name], alpha=0.35, zorder=0, label=None if name in seen else f"[{name}]")
            seen.add(name)
        ax.set_ylabel(f"{'GPU' if kind == 'cuda' else 'host'} GiB")
        ax.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=7, frameon=False)  # beside the plot
    axes[-1, 0].set_xlabel("seconds")
    if title:
        axes[0, 0].set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _thin(total: np.ndarray, points: int) -> np.ndarray:
    """Indices to plot: every event if few, else the highest and lowest point of each time bucket."""
    n = len(total)
    if n <= points:
        return np.arange(n)
    edges = np.linspace(0, n, points // 2 + 1, dtype=int)
    keep = set()
    for a, b in zip(edges[:-1], edges[1:]):
        if b > a:
            seg = total[a:b]
            keep.update((a + int(seg.argmax()), a + int(seg.argmin())))
    return np.array(sorted(keep))


# ----- a Trainer's steps under the profiler (lowmem-grpo profile, benchmarks) -------------------------
def profile_trainer(trainer, steps: int,
                    cuda_snapshot: Optional[str] = None) -> tuple[MemoryProfile, list[float], tuple]:
    """Run `steps` trainer steps under a MemoryProfile; returns it, the step times (seconds) and the
    longest (prompt, completion) widths of the batches the steps used (padded, in tokens)."""
    reference = []
    if trainer.ref is not None:
        reference = list(trainer.ref.model.parameters()) + list(trainer.ref.model.buffers())
    rewards = [t for m in reward_models(trainer.reward_funcs) for t in (*m.model.parameters(), *m.model.buffers())]
    batch = trainer.generation.batch.state_dict().values() if trainer.generation is not None else ()
    weights = list(trainer.policy.parameters()) + list(trainer.policy.buffers())
    times, widths = [], (0, 0)
    # The offloaded optimizer's host update runs on a worker thread (optim/offload.py), where the
    # host tracker (a dispatch mode: per thread) would not see the states it makes: updated inline here,
    # the same bytes at the same point of the step.
    update_thread = getattr(trainer.optimizer, "update_thread", None)
    if update_thread:
        trainer.optimizer.synchronize()
        trainer.optimizer.update_thread = False
    # model.offload_activations on the CPU: copies made for real (a no-op outside profiling), so the layer
    # inputs move to "activations (offloaded)" and the device-equivalent figure is a GPU's (loss.py).
    policy_loss = getattr(trainer.loss_module, "module", trainer.loss_module)  # DDP wraps it
    copy_on_cpu = trainer.device.type == "cpu" and trainer.cfg.model.offload_activations
    if copy_on_cpu:
        policy_loss.offload_copy_on_cpu = True
    try:
        with MemoryProfile(weights, trainer.optimizer, reference, batch, cuda_snapshot=cuda_snapshot,
                           device=trainer.device, reward_models=rewards) as prof:
            for _ in range(steps):
                t0 = time.perf_counter()
                gb, _, _ = trainer.run_step()
                if trainer.device.type == "cuda":
                    torch.cuda.synchronize(trainer.device)
                times.append(time.perf_counter() - t0)
                widths = (max(widths[0], gb.batch.prompt_ids.shape[1]),
                          max(widths[1], gb.batch.completion_ids.shape[1]))
    finally:
        if update_thread:
            trainer.optimizer.update_thread = True
        if copy_on_cpu:
            policy_loss.offload_copy_on_cpu = False
    return prof, times, widths


def device_equivalent(prof: MemoryProfile, trainer) -> tuple[str, dict]:
    """The training device's summary as the planner predicts it: without host-only categories.

    On CUDA that is the GPU timeline as it is. On a CPU run everything shares the host, so the
    reference model (host RAM on any device) and, when the reference computes on the CPU, its
    buffers are left out, as they would be on a GPU; so are the offloaded optimizer's host buffers and
    activation offload's host copies of the layer inputs (profile_trainer makes them on the CPU).
    """
    result = prof.result
    if "cuda" in result.devices and trainer.device.type == "cuda":
        return "cuda", result.devices["cuda"].summary()
    excluded = ["reference model"]
    if trainer.ref is not None and trainer.ref.device.type == "cpu":
        excluded.append("reference buffers")
    placements = {m.placement for m in reward_models(trainer.reward_funcs)}
    if placements - {"gpu"}:  # streamed or CPU reward models live in host RAM (the planner's host categories)
        excluded.append("reward model")
    if "cpu" in placements:
        excluded.append("reward buffers")
    if trainer.cfg.optim.offload_optimizer:  # host RAM on any device (the planner's host categories)
        excluded += ["optimizer states", "weights copy", "gradient buffer"]
    excluded.append("activations (offloaded)")  # host RAM on any device (the planner's host categories)
    return "host", result.devices["host"].summary(exclude=excluded)


# The profiler's own C++ lines on stderr ("STAGE:... Completed Stage: Warm Up", "USDT:... profiler_start"),
# printed whatever KINETO_LOG_LEVEL says: `lowmem-grpo profile`'s output is the report, not them.
_PROFILER_LINE = re.compile(rb"^(STAGE|USDT|INFO|WARNING|ERROR):\d{4}-\d\d-\d\d [\d:]+ \d+:\d+ \w+\.cpp:\d+\] ")


@contextlib.contextmanager
def _quiet_profiler_lines():
    """Inside, what is written to file descriptor 2 is held back, then passed on to stderr without the
    profiler's own lines (only the profiler's start and stop run inside: nothing else is delayed)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [line for line in held.read().splitlines(keepends=True) if not _PROFILER_LINE.match(line)]
            if kept:
                os.write(2, b"".join(kept))
