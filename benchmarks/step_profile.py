"""Where a trainer step's time goes on the GPU: a summary of one profiled step (not the trace).

    from step_profile import profile_call
    result, summary = profile_call(trainer.run_step, device)   # summary: a JSON-able dict
    print(format_summary(summary))

`profile_call` runs the callable once under the torch profiler (CPU activity, and CUDA's on a CUDA
device), exports the trace to a temporary file, reads it back and returns `summarise(...)` of its events:

- `phases`: for each trainer phase (the `lowmem::phase:NAME` ranges the trainer marks, lowmem_grpo/phases.py;
  an instant belongs to the innermost range open on the host then), its host wall time, and the device
  time of what was launched in it: `gpu_busy_ms` (the union over streams of its kernels, copies and memsets)
  and `gpu_idle_ms` (wall less busy, at least 0). A launch belongs to the phase its runtime call (matched by
  correlation id) was made in, on any thread; `(outside phases)` holds the rest of the profiled call.
- `kinds`: device time by kind of work: GEMM, attention, the fused loss head (this package's Triton kernels),
  Inductor's generated kernels, other torch kernels, and copies host->device, device->host and
  device->device with their bytes and GB/s (bytes over the copies' summed time), memsets.
- `syncs`: the host's waits on the device (runtime calls named *Synchronize* and the blocking cudaMemcpy):
  count and host milliseconds, by call.
- `top_kernels`: the ten kernels with the most device time in all (name, launches, total, longest).
- `host`: for each phase, where its host time went: `launches` (the device work launched in it), `op_ms`
  (the self time of the host's ops and runtime calls in it, summed over threads: autograd's backward runs
  on a thread of its own) and `top_ops` (the HOST_TOP ops with the most self time: name, calls, ms). A
  phase whose wall time exceeds its op time spent the rest in Python or waiting between ops.
- `wall_ms`, `gpu_busy_ms`: the profiled call's span and the union of all its device work.

Times are as the profiler records them (its own overhead included: each launch costs more host time
under the profiler, so the host wall and the idle times are upper bounds).
"""

from __future__ import annotations

import bisect
import json
import re
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch

from lowmem_grpo.phases import PREFIX

ROOT = Path(__file__).resolve().parents[1]
PHASE_PREFIX = PREFIX + "phase:"  # as lowmem_grpo.phases.phase names its ranges
CALL_MARK = PREFIX + "profiled call"
OUTSIDE = "(outside phases)"
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATEGORIES = ("cpu_op", "cuda_runtime", "cuda_driver")  # host events with a self time (not ranges)
HOST_TOP = 6  # host ops listed per phase
GEMM = re.compile(r"gemm|gemv|cutlass|xmma|nvjet|cublas|wgmma|matmul|triton_tem_", re.I)
ATTENTION = re.compile(r"flash|fmha|attention|attn|sdpa", re.I)


def package_triton_kernels(root: Path = ROOT / "lowmem_grpo") -> frozenset[str]:
    """The names of this package's Triton kernels (every function under `@triton.jit`), read from its source."""
    names = set()
    for path in root.rglob("*.py"):
        names.update(re.findall(r"@triton\.jit[^\n]*\n(?:\s*@[^\n]*\n)*\s*def\s+(\w+)", path.read_text()))
    return frozenset(names)


def kind_of(event: dict, head_kernels: frozenset[str]) -> str:
    """The kind of one device event of the trace (its `cat` one of DEVICE_CATEGORIES)."""
    name = event["name"]
    if event["cat"] == "gpu_memcpy":
        for direction in ("HtoD", "DtoH", "DtoD"):
            if direction in name:
                return f"copy {direction}"
        return "copy other"
    if event["cat"] == "gpu_memset":
        return "memset"
    if name in head_kernels:
        return "fused loss head"
    if ATTENTION.search(name):  # first: cuDNN's attention kernels name the wgmma instructions they use
        return "attention"
    if GEMM.search(name):
        return "GEMM"
    if name.startswith("triton_"):
        return "Inductor-generated"
    return "other kernels"


def union_ms(intervals: Iterable[tuple[float, float]]) -> float:
    """The length (ms) of the union of [start, end) intervals given in microseconds."""
    total, end_so_far = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > end_so_far:
            total += end - max(start, end_so_far)
            end_so_far = end
    return total / 1e3


class Timeline:
    """The host's timeline cut where a phase range opens or closes; each piece named by the innermost
    range open over it (the ranges nest: the one that opened last)."""

    def __init__(self, windows: list[tuple[float, float, str]], start: float, end: float):
        cuts = sorted({start, end, *(t for w in windows for t in w[:2] if start <= t <= end)})
        self.starts, self.names = cuts[:-1], []
        for a, b in zip(cuts, cuts[1:]):
            mid = (a + b) / 2
            open_ = [w for w in windows if w[0] <= mid < w[1]]
            self.names.append(max(open_, key=lambda w: w[0])[2] if open_ else OUTSIDE)
        self.lengths = [b - a for a, b in zip(cuts, cuts[1:])]
        self.start, self.end = start, end

    def name_at(self, t: float) -> str:
        if not self.start <= t < self.end:
            return OUTSIDE
        return self.names[bisect.bisect_right(self.starts, t) - 1]

    def wall_ms(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, length in zip(self.names, self.lengths):
            out[name] = out.get(name, 0.0) + length / 1e3
        return out


def host_self_times(events: list[dict], timeline: Timeline) -> dict[str, dict[str, dict]]:
    """Per phase (of the op's start), per host op name: calls and self milliseconds, its time less that of
    the ops nested in it on the same thread."""
    out: dict[str, dict[str, dict]] = {}

    def close(item: list) -> None:
        end, e, children = item
        op = out.setdefault(timeline.name_at(e["ts"]), {}).setdefault(e["name"], {"count": 0, "self_ms": 0.0})
        op["count"] += 1
        op["self_ms"] += max(0.0, e["dur"] - children) / 1e3
    by_thread: dict[tuple, list[dict]] = {}
    for e in events:
        if e.get("cat") in HOST_CATEGORIES:
            by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    for thread in by_thread.values():
        stack: list[list] = []  # [end, event, its direct children's time]
        for e in sorted(thread, key=lambda e: (e["ts"], -e["dur"])):
            while stack and stack[-1][0] <= e["ts"]:
                close(stack.pop())
            if stack:
                stack[-1][2] += e["dur"]
            stack.append([e["ts"] + e["dur"], e, 0.0])
        while stack:
            close(stack.pop())
    return out


def summarise(events: list[dict], head_kernels: Optional[frozenset[str]] = None) -> dict:
    """The summary (module docstring) of a chrome-trace event list of one profiled call: the call's span is
    the CALL_MARK range if there is one, else every host event's."""
    head_kernels = package_triton_kernels() if head_kernels is None else head_kernels
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    device = [e for e in spans if e.get("cat") in DEVICE_CATEGORIES]
    host = [e for e in spans if e.get("cat") not in DEVICE_CATEGORIES]
    marks = [e for e in host if e["name"] == CALL_MARK]
    if marks:
        start, end = marks[0]["ts"], marks[0]["ts"] + marks[0]["dur"]
    elif host:
        start, end = min(e["ts"] for e in host), max(e["ts"] + e["dur"] for e in host)
    else:
        start = end = 0.0
    windows = [(e["ts"], e["ts"] + e["dur"], e["name"][len(PHASE_PREFIX):]) for e in host
               if e["name"].startswith(PHASE_PREFIX)]
    timeline = Timeline(windows, start, end)
    launched_at = {e["args"]["correlation"]: e["ts"] for e in host
                   if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}

    phase_work: dict[str, list[tuple[float, float]]] = {}
    kinds: dict[str, dict] = {}
    kernels: dict[str, dict] = {}
    for e in device:
        t = launched_at.get(e.get("args", {}).get("correlation"), e["ts"])
        phase_work.setdefault(timeline.name_at(t), []).append((e["ts"], e["ts"] + e["dur"]))
        kind = kinds.setdefault(kind_of(e, head_kernels), {"count": 0, "ms": 0.0})
        kind["count"] += 1
        kind["ms"] += e["dur"] / 1e3
        if e["cat"] == "gpu_memcpy":
            kind["bytes"] = kind.get("bytes", 0) + int(e.get("args", {}).get("bytes", 0))
        if e["cat"] == "kernel":
            k = kernels.setdefault(e["name"], {"count": 0, "ms": 0.0, "longest_ms": 0.0})
            k["count"] += 1
            k["ms"] += e["dur"] / 1e3
            k["longest_ms"] = max(k["longest_ms"], e["dur"] / 1e3)
    for kind in kinds.values():
        if "bytes" in kind and kind["ms"] > 0:
            kind["GB_per_s"] = kind["bytes"] / 1e9 / (kind["ms"] / 1e3)

    phases = {}
    for name, wall in sorted(timeline.wall_ms().items(), key=lambda kv: -kv[1]):
        busy = union_ms(phase_work.get(name, []))
        phases[name] = {"wall_ms": wall, "gpu_busy_ms": busy, "gpu_idle_ms": max(0.0, wall - busy)}
    syncs: dict[str, dict] = {}
    for e in host:
        if e.get("cat") == "cuda_runtime" and ("Synchronize" in e["name"] or e["name"] == "cudaMemcpy"):
            s = syncs.setdefault(e["name"], {"count": 0, "host_ms": 0.0})
            s["count"] += 1
            s["host_ms"] += e["dur"] / 1e3
    top = sorted(kernels.items(), key=lambda kv: -kv[1]["ms"])[:10]
    self_times = host_self_times(host, timeline)
    host_summary = {}
    for name in phases:
        ops = self_times.get(name, {})
        ranked = sorted(ops.items(), key=lambda kv: -kv[1]["self_ms"])[:HOST_TOP]
        host_summary[name] = {"launches": len(phase_work.get(name, [])),
                              "op_ms": sum(op["self_ms"] for op in ops.values()),
                              "top_ops": [{"name": n, **op} for n, op in ranked]}
    return {"wall_ms": (end - start) / 1e3, "gpu_busy_ms": union_ms((e["ts"], e["ts"] + e["dur"]) for e in device),
            "phases": phases, "kinds": dict(sorted(kinds.items(), key=lambda kv: -kv[1]["ms"])),
            "syncs": syncs, "top_kernels": [{"name": n, **k} for n, k in top], "host": host_summary}


def profile_call(fn: Callable, device: torch.device):
    """Run `fn()` once under the profiler; return its result and `summarise` of the trace, with `call_s`:
    the seconds from the call's start to the device's last work (reading the trace back not included)."""
    from torch.profiler import ProfilerActivity, profile, record_function
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        with record_function(CALL_MARK):
            result = fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t0
    path = Path(tempfile.mkdtemp(prefix="step_profile_")) / "trace.json"
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    path.unlink()
    return result, {"call_s": seconds, **summarise(events)}


def format_summary(s: dict) -> str:
    """The summary as the text tables a person reads."""
    lines = [f"profiled call: {s['wall_ms']:.1f} ms on the host, GPU busy {s['gpu_busy_ms']:.1f} ms",
             f"{'phase':<22}{'wall ms':>10}{'GPU busy':>10}{'GPU idle':>10}"]
    lines += [f"{n:<22}{p['wall_ms']:>10.1f}{p['gpu_busy_ms']:>10.1f}{p['gpu_idle_ms']:>10.1f}"
              for n, p in s["phases"].items()]
    lines.append(f"{'device work by kind':<22}{'count':>8}{'ms':>10}{'GiB':>9}{'GB/s':>8}")
    for n, k in s["kinds"].items():
        gib = f"{k['bytes'] / 2**30:9.2f}" if "bytes" in k else " " * 9
        rate = f"{k['GB_per_s']:8.1f}" if "GB_per_s" in k else ""
        lines.append(f"{n:<22}{k['count']:>8}{k['ms']:>10.1f}{gib}{rate}")
    lines += [f"sync {n}: {v['count']} calls, {v['host_ms']:.1f} ms on the host" for n, v in s["syncs"].items()]
    lines += ["top kernels (device time):"] + [
        f"  {k['ms']:9.1f} ms {k['count']:6d}x (longest {k['longest_ms']:.2f} ms)  {k['name'][:90]}"
        for k in s["top_kernels"]]
    lines.append("host time by phase (self time of its ops and runtime calls, all threads):")
    for n, h in s.get("host", {}).items():
        lines.append(f"  {n}: {h['launches']} device launches, {h['op_ms']:.1f} ms in host ops; "
                     + "; ".join(f"{o['name'][:40]} {o['count']}x {o['self_ms']:.1f} ms" for o in h["top_ops"]))
    return "\n".join(lines)
