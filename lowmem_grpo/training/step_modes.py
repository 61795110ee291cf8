"""How the backwards of one optimizer step become an update: one small object per memory mode, behind
the interface `Trainer.optimizer_step` drives the same way in every mode:

    mode.begin(loss_fns)                          once per optimizer step, with the losses that will run
    for each micro-batch:                         (skipped_micro_batch(): every completion skipped)
        with mode.micro_batch(last):
            loss, metrics = mode.forward(loss_fn)     the micro-batch's loss
            mode.backward(loss, loss_is_finite)
    grad_norm, finite = mode.finish(loss_sum, num_items, backwards)

PlainStep (autograd accumulation), InBackwardStep (train.optimizer_in_backward: updated inside each
backward), OffloadStep (optim.offload_optimizer: gradients summed on the host, one update on the CPU)
and LayerMajorStep (offload with train.layer_major_backward: each layer runs over every micro-batch at
once, forward and backward; each gradient crosses once per step). A step where every completion was
skipped still steps Adam on a zero gradient. Design notes: docs/training.md, docs/memory-modes.md
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from ..config import Config
from ..optim.offload import OffloadedOptimizer
from ..optim.optimizer_in_backward import OptimizerInBackward
from ..phases import phase
from ..policy.layer_major import DecoderLayers, LayerInputs, decoder_layers
from ..policy.model import Head
from ..policy.streaming import LayerStreamer
from . import distributed
from .layer_inputs import LayerInputStore
from .lookup_rows import LookupRows
from .loss import PolicyLoss

LossFn = Callable[[], tuple[Tensor, dict]]  # one micro-batch's (loss, metrics)


class StepMode:
    """The shared interface (module docstring). The defaults are the plain path's."""

    def begin(self, loss_fns: Sequence[LossFn] = ()) -> None:
        """Before the first micro-batch of an optimizer step; `loss_fns`: the losses `forward` will be given,
        in that order (the micro-batches that run a forward)."""

    def micro_batch(self, last: bool):
        """A context around one micro-batch's forward and backward; `last`: the step's last micro-batch."""
        return contextlib.nullcontext()

    def forward(self, loss_fn: LossFn) -> tuple[torch.Tensor, dict]:
        """The micro-batch's (loss, metrics): `loss_fn()`, the loss module's forward on it."""
        return loss_fn()

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

    def begin(self, loss_fns: Sequence[LossFn] = ()) -> None:
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

    def begin(self, loss_fns: Sequence[LossFn] = ()) -> None:
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


class LayerMajorStep(OffloadStep):
    """OffloadStep whose micro-batches share one backward per layer: each gradient crosses once per step.

    `begin`: for every micro-batch, the decoder up to its layers (DecoderLayers.record); then layer by
    layer, every micro-batch through it without a graph, keeping each input (LayerInputStore). `forward`:
    the loss from the micro-batch's last layer output (finishing_from); `backward` reaches the loss head
    and the final norm. `finish`: last layer to first, each layer is
    recomputed and back-propagated for every micro-batch in turn, its gradients summed in `.grad` on the
    device (autograd's sum, one rounding per add, as the host's) and handed to the optimizer by the last
    micro-batch's backward only (`gradients_held`); then, per micro-batch, the part before the layers is
    run again (the embedding lookup) and back-propagated, the lookup's gradient sent as the rows it read
    (lookup_rows.py); then the update. Per micro-batch the arithmetic is gradient checkpointing's. With
    `hold_head` (train.head_gradient_once_per_step) the head's and the final norm's gradients are summed in
    `.grad` on the device too, across the micro-batches' loss backwards, and sent before the layers'. With
    `group` layers per checkpoint (model.layers_per_checkpoint), only each group's first input is kept and
    the group's layers are recomputed and back-propagated together: the same operations in the same order.
    Otherwise the head's (and the final norm's) gradients leave once per micro-batch: holding them keeps a
    (V, H) sum on the device through every micro-batch's loss head. With a `streamer` (model.offload_weights)
    each layer (each group) is on the device only for its calls, for every micro-batch at once, while the next
    one is copied: twice per step."""

    def __init__(self, optimizer: OffloadedOptimizer, model: nn.Module, head: Head, policy_loss: PolicyLoss, *,
                 autocast: bool, offload_inputs: bool, group: int = 1, hold_head: bool = False,
                 streamer: Optional[LayerStreamer] = None):
        super().__init__(optimizer, model, head)
        self.layers: DecoderLayers = decoder_layers(head.decoder)
        self.streamer = streamer  # model.offload_weights: the layers' weights cross per layer (or group)
        self.group, self.hold_head = group, hold_head
        self.policy_loss = policy_loss  # its offload_copy_on_cpu: a CPU memory profile wants real host copies
        self.autocast = autocast
        self.store = LayerInputStore(offload_inputs)
        self.lookup = LookupRows(model.get_input_embeddings())
        self._calls: list[list[tuple[tuple, dict]]] = []  # per micro-batch of this step: each layer's arguments
        self._loss_fns: list[LossFn] = []  # and its loss, to run the lookup again
        self._forwarded = 0  # the losses `forward` has run this step
        self._last: list[Tensor] = []  # each micro-batch's last layer output, a leaf; its .grad after backward

    def begin(self, loss_fns: Sequence[LossFn] = ()) -> None:
        """The decoder up to its layers for each of `loss_fns`, then each layer, first to last, over all of
        them, without a graph: each layer's weights are read once per step."""
        super().begin()
        self.store.clear()
        self.store.copy_on_cpu = self.policy_loss.offload_copy_on_cpu
        self._loss_fns, self._forwarded = list(loss_fns), 0
        records: list[LayerInputs] = [self.layers.record(f) for f in self._loss_fns]
        self._calls = [r.calls for r in records]
        hidden = [r.hidden.detach() for r in records]  # (the graph to the embedding: made again in finish)
        del records  # each input lives in the store only (in host RAM with offload_inputs)
        if hidden:
            if self.streamer is not None:
                self.streamer.forget()  # (nothing fetched before this step's weights is used)
            with torch.no_grad(), self._autocast(hidden[0]):
                for i in range(len(self.layers)):
                    with self._resident([i]):
                        for m, calls in enumerate(self._calls):
                            if i % self.group == 0:
                                self.store.put((i, m), hidden[m])
                            hidden[m] = self.layers.run(i, hidden[m], calls[i])
        self._last = [h.detach().requires_grad_() for h in hidden]

    def forward(self, loss_fn: LossFn) -> tuple[Tensor, dict]:
        """The loss from this micro-batch's last layer output (made in `begin`)."""
        m, self._forwarded = self._forwarded, self._forwarded + 1
        if m >= len(self._loss_fns) or loss_fn is not self._loss_fns[m]:
            raise RuntimeError("LayerMajorStep.forward takes the losses given to begin(), in their order")
        with self.layers.finishing_from(self._last[m]):
            return loss_fn()

    def backward(self, loss: Tensor, loss_is_finite: Callable[[], bool]) -> None:
        """The loss's backward to the last layer outputs; with `hold_head` its gradients stay on the device."""
        with self.optimizer.gradients_held() if self.hold_head else contextlib.nullcontext():
            loss.backward()
        self.optimizer.end_backward()

    def finish(self, loss_sum: float, num_items: int, backwards: int) -> tuple[float, bool]:
        if self.hold_head:  # the head's and final norm's sums, once
            self.optimizer.send_held()
            self.optimizer.end_backward()
        if self._calls:
            with phase("backward"):
                self._layers_backward()
        return super().finish(loss_sum, num_items, backwards)

    def _layers_backward(self) -> None:
        grads = [last.grad if last.grad is not None else torch.zeros_like(last) for last in self._last]
        self._last = []
        k, n_layers = len(self._calls), len(self.layers)
        starts = list(reversed(range(0, n_layers, self.group)))
        order = [(i, m) for i in starts for m in range(k)]
        for g, i in enumerate(starts):
            group = list(range(i, min(i + self.group, n_layers)))
            following = list(range(starts[g + 1], i)) if g + 1 < len(starts) else []
            with self._resident(group, following):  # the group's weights on the device for every micro-batch
                for m in range(k):
                    n = g * k + m
                    if n + 1 < len(order):
                        self.store.prefetch(order[n + 1])
                    x = self.store.take((i, m)).requires_grad_()
                    held = self.optimizer.gradients_held() if m + 1 < k else contextlib.nullcontext()
                    with held, self._autocast(x):
                        out = x
                        for j in group:
                            out = self.layers.run(j, out, self._calls[m][j])
                        torch.autograd.backward(out, grads[m])
                    grads[m] = x.grad
        self._calls = []
        for loss_fn, grad in zip(self._loss_fns, grads):  # the lookup (and whatever runs before the layers)
            with self.lookup.compact() as lookups:  # its gradient as the rows it read
                first = self.layers.record(loss_fn).hidden
            if first.requires_grad:
                first.backward(grad)
                for ids, rows in lookups:
                    if rows.grad is not None:
                        self.optimizer.receive_rows(self.lookup.weight, ids, rows.grad)
                self.optimizer.end_backward()
        self._loss_fns = []

    def _resident(self, layers: list[int], following: Optional[list[int]] = None):
        if self.streamer is None:
            return contextlib.nullcontext()
        return self.streamer.resident(layers, following)

    def _autocast(self, like: Tensor):
        return torch.autocast(like.device.type, dtype=torch.bfloat16, enabled=self.autocast)


def layer_major_wanted(cfg: Config, world_size: int) -> bool:
    """train.layer_major_backward resolved. None (the default) is on where it takes gradients off PCIe for
    little device memory: offload_optimizer with gradient_accumulation_steps > 1, gradient checkpointing and
    model.offload_activations (every micro-batch's layer inputs then wait in host RAM), in one process; and
    with model.offload_weights (which needs it). On
    the device instead (`true` without offload_activations) they cost gradient_accumulation_steps times
    checkpointing's layer inputs: `lowmem-grpo plan` shows whether that fits. True under torchrun raises."""
    t, o, m = cfg.train, cfg.optim, cfg.model
    if t.layer_major_backward is None:
        return (o.offload_optimizer and m.gradient_checkpointing and world_size == 1
                and (m.offload_weights or (m.offload_activations and t.gradient_accumulation_steps > 1)))
    if t.layer_major_backward and world_size > 1:
        raise ValueError("train.layer_major_backward runs in one process: under torchrun set it to false (or leave "
                         "it unset)")
    return bool(t.layer_major_backward)


def layers_per_checkpoint(cfg: Config, world_size: int) -> int:
    """model.layers_per_checkpoint, checked against the step mode it needs: above 1 only where the layer-major
    backward runs (`layer_major_wanted`), the one mode that recomputes layers in groups."""
    group = cfg.model.layers_per_checkpoint
    if group > 1:
        _needs_layer_major(cfg, world_size, f"model.layers_per_checkpoint={group}", "model.layers_per_checkpoint=1")
    return group


def head_gradient_once(cfg: Config, world_size: int) -> bool:
    """train.head_gradient_once_per_step, checked against the step mode it needs (the layer-major one)."""
    if cfg.train.head_gradient_once_per_step:
        _needs_layer_major(cfg, world_size, "train.head_gradient_once_per_step",
                           "train.head_gradient_once_per_step=false")
    return cfg.train.head_gradient_once_per_step


def offload_weights(cfg: Config, world_size: int) -> bool:
    """model.offload_weights, checked against the step mode it needs (the layer-major one)."""
    if cfg.model.offload_weights:
        _needs_layer_major(cfg, world_size, "model.offload_weights", "model.offload_weights=false")
    return cfg.model.offload_weights


def _needs_layer_major(cfg: Config, world_size: int, setting: str, off: str) -> None:
    if not layer_major_wanted(cfg, world_size):
        raise ValueError(f"{setting} needs the layer-major backward, which is off here (it runs with "
                         "optim.offload_optimizer, gradient_checkpointing and gradient_accumulation_steps > 1, in one "
                         f"process; unset, also offload_activations or offload_weights): set {off}, or "
                         "train.layer_major_backward=true")


def make_step_mode(optimizer: torch.optim.Optimizer, model: torch.nn.Module, loss_module: torch.nn.Module,
                   shards, max_grad_norm: float | None, head: Head, *, layer_major: bool = False,
                   autocast: bool = False, offload_inputs: bool = False, group: int = 1,
                   hold_head: bool = False, streamer: Optional[LayerStreamer] = None) -> StepMode:
    """The mode of the optimizer `build_optimizer` made. `head`: the policy's one loss head, which the loss
    and the old log-prob pass share (the offload mode may give it a handle of its own on a tied weight).
    `layer_major` (`layer_major_wanted`; offload only): LayerMajorStep, its layers under bf16 `autocast`
    as the loss's, their inputs in host RAM with `offload_inputs` (model.offload_activations), recomputed
    `group` layers at a time (`layers_per_checkpoint`), the head's gradient sent once with `hold_head`
    (`head_gradient_once`), the layers' weights streamed from host RAM by `streamer` (model.offload_weights)."""
    if isinstance(optimizer, OffloadedOptimizer):
        if layer_major:
            if not isinstance(loss_module, PolicyLoss):
                raise ValueError("a layer-major backward runs in one process, on the policy's own loss module")
            return LayerMajorStep(optimizer, model, head, loss_module, autocast=autocast,
                                  offload_inputs=offload_inputs, group=group, hold_head=hold_head,
                                  streamer=streamer)
        return OffloadStep(optimizer, model, head)
    if layer_major:
        raise ValueError("a layer-major backward needs the offloaded optimizer (optim.offload_optimizer=true)")
    if isinstance(optimizer, OptimizerInBackward):
        return InBackwardStep(optimizer)
    return PlainStep(optimizer, [p for p in model.parameters() if p.requires_grad], loss_module, shards,
                     max_grad_norm)
