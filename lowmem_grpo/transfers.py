"""Bytes copied between host and device, by what they were, and the device synchronisations: a counter
the copying code calls at each copy site, read and reset once per optimizer step into metrics.jsonl.

    count(kind, direction, nbytes)    one copy: direction "h2d" or "d2h", kind one of KINDS
    count_sync(n=1)                   the host waited for the device (event or stream synchronize, a read)
    TRANSFERS.take() -> dict          the counts since the last take, as metrics, and a reset

A copy between two CPU tensors that stands for a transfer (the offload's host copies, a streamed layer
on a CPU-only machine) is counted where a GPU run would copy, so the CPU tests see the GPU's figures.
The planner predicts the same numbers (memory/step_time.py, `transfers`). Counting is a few integer
additions per copy: always on. Threads (the offloaded optimizer's update thread) count under a lock.
"""

from __future__ import annotations

import threading
from collections import defaultdict

DIRECTIONS = ("h2d", "d2h")
KINDS = ("weights", "gradients", "lookup gradients", "policy layers", "embedding rows", "rollout copy",
         "reference layers", "reference head", "reward model layers", "reward model head", "activations", "batches",
         "log-probs")


class TransferCounter:
    """Running byte counts per (direction, kind) and a count of device synchronisations."""

    def __init__(self):
        self._lock = threading.Lock()
        self._bytes: dict[tuple[str, str], int] = defaultdict(int)
        self._syncs = 0

    def count(self, kind: str, direction: str, nbytes: int) -> None:
        if direction not in DIRECTIONS or kind not in KINDS:
            raise ValueError(f"unknown transfer {direction!r} {kind!r}: directions {DIRECTIONS}, kinds {KINDS}")
        with self._lock:
            self._bytes[direction, kind] += int(nbytes)

    def count_sync(self, n: int = 1) -> None:
        with self._lock:
            self._syncs += n

    def take(self) -> dict[str, int]:
        """The counts since the last take as metrics, then a reset: `transfer/<direction>` (all kinds),
        `transfer/<direction>/<kind>` (kinds with bytes) and `device_syncs`."""
        with self._lock:
            counts, syncs = dict(self._bytes), self._syncs
            self._bytes.clear()
            self._syncs = 0
        out = {f"transfer/{d}": sum(n for (dd, _), n in counts.items() if dd == d) for d in DIRECTIONS}
        out.update({f"transfer/{d}/{k}": n for (d, k), n in sorted(counts.items())})
        out["device_syncs"] = syncs
        return out


TRANSFERS = TransferCounter()


def count(kind: str, direction: str, nbytes: int) -> None:
    """Count one host<->device copy of `nbytes` (module docstring)."""
    TRANSFERS.count(kind, direction, nbytes)


def count_sync(n: int = 1) -> None:
    """Count `n` waits of the host for the device."""
    TRANSFERS.count_sync(n)
