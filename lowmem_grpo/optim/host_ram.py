"""Host RAM arithmetic and checks for the offloaded optimizer (offload.py).

`host_bytes_per_param` and `pcie_bytes_per_step` are the planner's per-parameter figures (memory/plan.py);
`available_host_ram` and `process_ram` read Linux's /proc (None where they cannot); `check_host_ram`
raises MemoryError, with the numbers, before the optimizer takes more host memory than is available.

Design notes: docs/memory-modes.md
"""

from __future__ import annotations

from ..host_arena import PAGE


def host_bytes_per_param(weight_bytes: int, optimizer: str) -> float:
    """Host RAM per parameter with the optimizer offloaded: weight copy (an fp32 master for torch AdamW),
    gradient buffer (the weight dtype), states (8-bit: 2 bytes plus two fp32 absmax per 256-block)."""
    if optimizer == "adamw":
        return 4 + weight_bytes + 8.0
    return 2 * weight_bytes + 2.0 + 8.0 / 256


def pcie_bytes_per_step(num_params: int, weight_bytes: int, micro_batches: int = 1) -> int:
    """Bytes crossing PCIe per optimizer step: each micro-batch's gradients to the host, each weight back."""
    return (micro_batches + 1) * weight_bytes * num_params


MEMINFO, STATM = "/proc/meminfo", "/proc/self/statm"  # Linux's view of the machine's and this process's RAM


def available_host_ram() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), or None where it cannot be read."""
    try:
        with open(MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def process_ram() -> int | None:
    """This process's resident memory (RSS, from /proc/self/statm), or None where it cannot be read."""
    try:
        with open(STATM) as f:
            return int(f.read().split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return None


def check_host_ram(pinned: int, unpinned: int = 0) -> None:
    """Refuse, with the numbers, before taking more host memory than the machine has available: `pinned`
    bytes of page-locked buffers (they cannot be swapped, and running out of them ends in the kernel's
    OOM killer, not in an exception) and `unpinned` bytes of optimizer states and fp32 masters. Both
    come on top of what the process holds now, which MemAvailable already leaves out: the message
    gives it, and the process's total, but it is not counted twice."""
    free = available_host_ram()
    needed = pinned + unpinned
    if free is None or needed <= free:
        return
    rss = process_ram() or 0
    gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
    raise MemoryError(
        f"optim.offload_optimizer needs {gib(pinned)} of pinned host memory (weight copy and gradient buffers, "
        f"which cannot swap) + {gib(unpinned)} of optimizer states and fp32 masters = {gib(needed)} more host "
        f"RAM, but {gib(free)} is available (MemAvailable; this process holds {gib(rss)} already, so it would "
        f"reach {gib(rss + needed)} of the {gib(rss + free)} it can have): use a lower-memory setting "
        "(optim.optimizer=adamw_8bit instead of adamw: 6 bytes per parameter instead of 14-16), a smaller "
        "model, or close other programs; `lowmem-grpo plan` shows the breakdown")
