"""The phases of a GRPO step and the profiler markers the loop emits (free when no profiler runs).

The trainer wraps each phase in `phase(...)`; the memory modes label their own allocations with
`scope(...)` and `mark_gradient(...)`. These are `torch.profiler.record_function` ranges that
`lowmem_grpo.memory.profile` reads back to attribute every allocation. This module is a leaf: the
training loop and the memory modes import it without importing the memory tools.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from torch.profiler import record_function

PREFIX = "lowmem::"
GRAD_MARK = PREFIX + "grad@"
PHASES = ("rollout", "rewards", "old log-probs", "reference log-probs", "forward", "backward", "optimizer",
          "evaluation")  # "rewards": marked only when a reward model scores (reward functions use no device)
# labels that hold whatever the phase: optimizer steps taken inside backward, activation offload's host copies
SCOPES = ("optimizer", "activation offload")


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Mark a trainer phase (one of PHASES) for the profiler. An out-of-memory error raised inside is
    tagged with the phase (`phase_of(error)`, the innermost phase wins), so the run can say where the
    memory ran out and which setting to change."""
    assert name in PHASES, name
    try:
        with record_function(f"{PREFIX}phase:{name}"):
            yield
    except torch.OutOfMemoryError as e:
        if phase_of(e) is None:
            e.lowmem_phase = name
        raise


def phase_of(error: BaseException) -> Optional[str]:
    """The phase an out-of-memory error was raised in (None outside any phase)."""
    return getattr(error, "lowmem_phase", None)


def scope(name: str) -> record_function:
    """Label the allocations made inside, whatever the phase (one of SCOPES)."""
    assert name in SCOPES, name
    return record_function(PREFIX + name)


def mark_gradient(grad: Optional[torch.Tensor]) -> None:
    """Tell a running profile that `grad`'s storage is a parameter gradient (called from grad hooks)."""
    if grad is not None and torch.autograd._profiler_enabled():
        with record_function(f"{GRAD_MARK}{grad.untyped_storage().data_ptr()}"):
            pass
