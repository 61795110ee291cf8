"""How the backwards of one optimizer step become an update: one small object per memory mode, behind
the interface `Trainer.optimizer_step` drives the same way in every mode:

    mode.begin()                                  once per optimizer step
    for each micro-batch:
        mode.skipped_micro_batch()                every completion skipped (single process): no backward
        with mode.micro_batch(last):              forward + backward
            mode.backward(loss, loss_is_finite)
    grad_norm, finite = mode.finish(loss_sum, num_items, backwards)

PlainStep (autograd accumulation, one optimizer step), InBackwardStep (train.optimizer_in_backward:
updated inside each backward) and OffloadStep (optim.offload_optimizer: gradients summed on the host,
one update on the CPU). A step where every completion was skipped still steps Adam on a zero gradient.

Design notes: docs/training.md
"""

from __future__ import annotations

import contextlib
from typing import Callable

import numpy as np
import torch

from ..optim.offload import OffloadedOptimizer
from ..optim.optimizer_in_backward import OptimizerInBackward
from ..phases import phase
from ..policy.model import Head
from . import distributed


class StepMode:
    """The shared interface (module docstring). The defaults are the plain path's."""

    def begin(self) -> None:
        """Before the first micro-batch of an optimizer step."""

    def micro_batch(self, last: bool):
        """A context around one micro-batch's forward and backward; `last`: the step's last micro-batch."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, loss_is_finite: Callable[[], bool]) -> None:
        loss.backward()

    def skipped_micro_batch(self) -> None:
        """A micro-batch with completions, all of them skipped (their gradient is exactly zero)."""

    def finish(self, loss_sum: float, num_items: int, backwards: int) -> tuple[float, bool]:
        """After the last micro-batch: the update. Returns (the global gradient norm, whether the step was
        finite). `num_items`: the step's completion tokens (0: nothing to learn, no update); `backwards`:
        the backwards run (0 with num_items > 0: every completion skipped, a zero-gradient step)."""
        raise NotImplementedError

    def synchronize(self) -> None:
        """Wait until the last update has landed in every weight (before reading weights outside a forward:
        a checkpoint, the end of training). Only the offload mode updates after `finish` returns."""


class PlainStep(StepMode):
    """Gradients accumulate in .grad; clip_grad_norm_, then one optimizer step (module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor], loss_module: torch.nn.Module,
                 shards, max_grad_norm: float | None):
        self.optimizer, self.params, self.loss_module, self.shards = optimizer, params, loss_module, shards
        self.max_grad_norm = max_grad_norm

    def micro_batch(self, last: bool):
        """DDP all-reduces on the last micro-batch of an optimizer step only (no_sync before it)."""
        if last or not isinstance(self.loss_module, torch.nn.parallel.DistributedDataParallel):
            return contextlib.nullcontext()
        return self.loss_module.no_sync()

    def finish(self, loss_sum: float, num_items: int, backwards: int) -> tuple[float, bool]:
        with phase("optimizer"):
            if num_items and not backwards:  # every completion skipped: Adam still steps, on a zero gradient
                for p in self.params:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    else:
                        p.grad.zero_()
            max_norm = self.max_grad_norm or float("inf")
            grad_norm = (distributed.as_float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
                         if num_items else 0.0)
            finite = bool(np.isfinite(loss_sum) and np.isfinite(grad_norm))
            if finite and num_items:
                if self.shards:  # FSDP2: the optimizer steps the local shards
                    self.shards.link_grads()
                self.optimizer.step()
        return grad_norm, finite


class InBackwardStep(StepMode):
    """The optimizer in backward on the device: one micro-batch per optimizer step (module docstring)."""

    def __init__(self, optimizer: OptimizerInBackward):
        self.optimizer = optimizer
        self.grad_norm = 0.0

    def begin(self) -> None:
        self.grad_norm = 0.0

    def backward(self, loss: torch.Tensor, loss_is_finite: Callable[[], bool]) -> None:
        # The weights change during this backward: check the loss first. (One micro-batch per step here,
        # so this read is also the step's metrics read.)
        if loss_is_finite():
            self.optimizer.begin_step()
            loss.backward()
            self.grad_norm = self.optimizer.end_step()

    def skipped_micro_batch(self) -> None:  # this micro-batch is a whole optimizer step, with a zero gradient
        with phase("optimizer"):
            self.optimizer.step_zero_gradients()

    def finish(self, loss_sum: float, num_items: int, backwards: int) -> tuple[float, bool]:
        # the step already happened (or was skipped) inside backward
        finite = bool(np.isfinite(loss_sum) and np.isfinite(self.grad_norm) and not self.optimizer.nonfinite_tensors)
        return self.grad_norm, finite


class OffloadStep(StepMode):
    """Gradients summed on the host, the global norm, one update on the CPU (module docstring). Gives the
    policy's loss head its handle on a tied embedding (`split_tied_head`)."""

    def __init__(self, optimizer: OffloadedOptimizer, model: torch.nn.Module, head: Head):
        self.optimizer, self.head = optimizer, head
        optimizer.split_tied_head(model, [head])  # a tied embedding's two (V, H) gradients never meet on the device
        optimizer.wait_in_forward(model, [head])  # the host update runs on the worker thread

    def begin(self) -> None:
        self.optimizer.begin_step()

    def backward(self, loss: torch.Tensor, loss_is_finite: Callable[[], bool]) -> None:
        loss.backward()
        self.optimizer.end_backward()

    def finish(self, loss_sum: float, num_items: int, backwards: int) -> tuple[float, bool]:
        with phase("optimizer"):
            if num_items and not backwards:  # every completion skipped: Adam still steps, on a zero gradient
                self.optimizer.end_step(apply=False)
                grad_norm = self.optimizer.step_zero_gradients()
            else:  # as the plain path: no update without tokens or with a non-finite loss or norm
                grad_norm = self.optimizer.end_step(apply=bool(num_items and np.isfinite(loss_sum)))
                grad_norm = grad_norm if num_items else 0.0
        return grad_norm, bool(np.isfinite(loss_sum) and np.isfinite(grad_norm))

    def synchronize(self) -> None:
        self.optimizer.synchronize()


def make_step_mode(optimizer: torch.optim.Optimizer, model: torch.nn.Module, loss_module: torch.nn.Module,
                   shards, max_grad_norm: float | None, head: Head) -> StepMode:
    """The mode of the optimizer `build_optimizer` made. `head`: the policy's one loss head, which the loss
    and the old log-prob pass share (the offload mode may give it a handle of its own on a tied weight)."""
    if isinstance(optimizer, OffloadedOptimizer):
        return OffloadStep(optimizer, model, head)
    if isinstance(optimizer, OptimizerInBackward):
        return InBackwardStep(optimizer)
    return PlainStep(optimizer, [p for p in model.parameters() if p.requires_grad], loss_module, shards,
                     max_grad_norm)
