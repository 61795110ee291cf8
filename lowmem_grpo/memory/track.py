"""Measure peak memory around any code (your own trainer loop, one op, a step):

    from lowmem_grpo import memory
    with memory.track() as t:
        loss = linear_grpo_loss(hidden, weight, ids, adv)
        loss.backward()
    print(t.report())          # or t.as_dict()

CUDA (the default when a GPU is present): the caching allocator's statistics, peak allocated and
peak reserved bytes during the block above what was allocated at entry. CPU: the PyTorch profiler's
memory events, which come from c10's CPU allocator below the dispatcher, so they include tensors
allocated inside custom ops (our fused head's vocabulary-slice workspace) that dispatch-level
trackers such as MemTracker cannot see. Python objects and library-internal mallocs are not counted.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import tempfile
from dataclasses import asdict, dataclass
from typing import Iterator, Optional

import torch

MiB = 2**20


@dataclass
class Tracked:
    device: str
    peak_bytes: int = 0  # most bytes allocated at once during the block, above the level at entry
    end_bytes: int = 0  # bytes still allocated at exit, above the level at entry (e.g. gradients)
    peak_reserved_bytes: Optional[int] = None  # CUDA: the allocator's reserved peak (what nvidia-smi sees, ~)

    def report(self) -> str:
        parts = [f"{self.device}: peak {self.peak_bytes / MiB:,.1f} MiB above entry",
                 f"{self.end_bytes / MiB:,.1f} MiB still allocated at exit"]
        if self.peak_reserved_bytes is not None:
            parts.append(f"peak reserved {self.peak_reserved_bytes / MiB:,.1f} MiB")
        return ", ".join(parts)

    def as_dict(self) -> dict:
        return asdict(self)


@contextlib.contextmanager
def track(device: Optional[str | torch.device] = None) -> Iterator[Tracked]:
    """Track the block's peak memory on `device` (default: the current CUDA device if any, else CPU)."""
    dev = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    result = Tracked(str(dev))
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        start = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        yield result
        torch.cuda.synchronize(dev)
        result.peak_bytes = torch.cuda.max_memory_allocated(dev) - start
        result.end_bytes = torch.cuda.memory_allocated(dev) - start
        result.peak_reserved_bytes = torch.cuda.max_memory_reserved(dev)
        return
    from torch.profiler import ProfilerActivity, profile
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield result
    totals = cpu_running_totals(prof)
    if totals:
        baseline = totals[0][1] - totals[0][0]  # the allocator's total before the first event
        result.peak_bytes = max(0, max(total for _, total in totals) - baseline)
        result.end_bytes = totals[-1][1] - baseline


def cpu_running_totals(prof) -> list[tuple[int, int]]:
    """(bytes, allocator running total) of every CPU allocation/free the profiler saw, in order."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    mem = [e["args"] for e in events if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0]
    mem.sort(key=lambda a: a["Ev Idx"])
    return [(a["Bytes"], a["Total Allocated"]) for a in mem]
