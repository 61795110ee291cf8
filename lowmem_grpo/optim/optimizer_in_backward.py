"""The optimizer step inside backward: each parameter is updated by its own inner optimizer as soon as its
gradient is complete (a post-accumulate-grad hook), then the gradient is freed, so no full-model gradient
ever exists.

One backward is one optimizer step (no gradient accumulation). Each tensor is clipped to its share of
max_grad_norm, cap_p = max_grad_norm * sqrt(numel_p / numel_total); the reported grad_norm is the true
global norm before clipping. A non-finite tensor is skipped and the step reported as skipped. On CUDA the
norms reach the host through pinned memory and events: at most `lag_bytes` of finished gradients wait for
them, and `host_waits` counts the times the host had to wait.

Design notes: docs/memory-modes.md ("The optimizer in backward")
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..phases import mark_gradient, scope


NORM_CHUNK = 1 << 20  # elements
LAG_BYTES = 32 << 20  # gradient bytes a CUDA backward may hold while their norms travel to the host


def fp32_norm_tensor(t: torch.Tensor) -> torch.Tensor:
    """The L2 norm accumulated in fp32, over 1M-element chunks, as a 0-dim fp32 tensor on t's device:
    the CPU widens a bf16 tensor to fp32 before reducing it, which for the embedding's gradient would
    be a whole fp32 copy."""
    flat = t.reshape(-1)
    chunks = [torch.linalg.vector_norm(flat[i:i + NORM_CHUNK], dtype=torch.float32)
              for i in range(0, flat.numel(), NORM_CHUNK)]
    if not chunks:
        return torch.zeros((), dtype=torch.float32, device=t.device)
    return torch.linalg.vector_norm(torch.stack(chunks))


def fp32_norm(t: torch.Tensor) -> float:
    """`fp32_norm_tensor` read on the host (a device sync on CUDA)."""
    return float(fp32_norm_tensor(t))


def weakly(method: Callable) -> Callable:
    """`method` (bound) for a hook that a weight or module keeps: it holds the optimizer only weakly and does
    nothing once the optimizer is gone. A parameter's hooks live as long as the parameter, and a strong
    reference from them would keep an optimizer nobody uses (with its host RAM and pinned blocks: offload.py)
    alive as long as the model, or for ever: torch's garbage collector does not see through them."""
    if not hasattr(method, "__self__"):  # a plain function (e.g. a test's replacement): nothing to hold weakly
        return method
    ref = weakref.WeakMethod(method)

    def call(*args, **kwargs):
        bound = ref()
        return None if bound is None else bound(*args, **kwargs)
    return call


def _step_bnb_without_sync(opt: torch.optim.Optimizer) -> None:
    """What bitsandbytes' `Optimizer8bit.step` does for an optimizer of one non-paged parameter, minus
    its `sync_gpu` after the update. Uses bitsandbytes internals (initialized, check_overrides, to_gpu,
    init_state, update_step; read from 0.50.2), so the tests compare it with `step()`."""
    if not opt.initialized:
        opt.check_overrides()
        opt.to_gpu()
        opt.initialized = True
    group = opt.param_groups[0]
    p = group["params"][0]
    if p.grad is None:
        return
    if len(opt.state[p]) == 0:
        opt.init_state(group, p, 0, 0)
    opt.update_step(group, p, 0, 0)


def _syncs_itself(inner: torch.optim.Optimizer) -> bool:
    """Whether `inner.step()` synchronises the device after each parameter: bitsandbytes' optimizers do.
    (Without bitsandbytes imported, no optimizer can be one of its.)"""
    bnb_optim = sys.modules.get("bitsandbytes.optim.optimizer")
    return bnb_optim is not None and isinstance(inner, bnb_optim.Optimizer8bit)


@dataclass
class _Finished:
    """A gradient whose hook has run; its update waits until its norm is on the host."""
    index: int  # into OptimizerInBackward.params
    grad: torch.Tensor
    norm: Optional[torch.Tensor]  # 0-dim fp32; on the host once `ready` has completed (None: see _arrived)
    ready: Optional[torch.cuda.Event]  # None: `norm` is readable now
    stream: Optional[torch.cuda.Stream]  # where the gradient was made; the update is queued there too
    nbytes: int


class OptimizerInBackward(torch.optim.Optimizer):
    """Looks like one optimizer to the LR scheduler and checkpoints; steps happen in backward hooks.

    `make_inner(params_groups)` builds the per-parameter optimizer (e.g. bitsandbytes AdamW8bit).
    The outer param_groups hold the learning rate that schedulers set; updates copy it to the inner one.
    `lag_bytes` bounds the gradients held while their norms reach the host (CUDA only; module docstring).
    """

    def __init__(self, groups: list[dict], make_inner: Callable[[list[dict]], torch.optim.Optimizer],
                 max_grad_norm: float | None, defaults: dict | None = None, lag_bytes: int = LAG_BYTES):
        super().__init__(groups, dict(defaults or {}))  # defaults (lr, betas, ...) fill each group
        self.params = [p for g in self.param_groups for p in g["params"]]
        total = sum(p.numel() for p in self.params)
        self.inner = {}
        self.caps = {}
        self._group_of = []  # group index of each parameter, by position in self.params
        for group_index, group in enumerate(self.param_groups):
            options = {k: v for k, v in group.items() if k != "params"}
            for p in group["params"]:
                self.inner[p] = make_inner([{"params": [self._updated(p)], **options}])
                self.caps[p] = None if not max_grad_norm else max_grad_norm * math.sqrt(p.numel() / total)
                # By index, not by dict: load_state_dict replaces the group dicts the scheduler writes to.
                p.register_post_accumulate_grad_hook(functools.partial(weakly(self._on_gradient), len(self._group_of)))
                self._group_of.append(group_index)
        # bitsandbytes optimizers whose step() would sync the device for nothing (paged ones need it)
        self._bnb_unpaged = {p: _syncs_itself(inner) and not inner.is_paged for p, inner in self.inner.items()}
        self.lag_bytes = lag_bytes
        self._pending: deque[_Finished] = deque()
        self._pending_bytes = 0
        self._host_norms = torch.empty(0)  # pinned fp32 slots for the norms in flight (CUDA)
        self._host_used = 0
        self._fired: list[int] = []  # parameter indices in the order their hooks ran in this backward
        self._update_order: list[int] = []  # ... in the last complete backward (see step_zero_gradients)
        self.active = False
        self._sq_norm = 0.0
        self.nonfinite_tensors = 0
        self.host_waits = 0  # times the host waited for the device during the last step
        self.max_live_grads = 0  # most parameters holding a gradient at once during the last backward
        self.max_live_grad_bytes = 0  # and the most gradient bytes alive at once (memory accounting checks it)

    def _on_gradient(self, index: int, p: torch.Tensor) -> None:
        """Parameter `index`'s post-accumulate-grad hook (held weakly by the parameter: `weakly`)."""
        if not self.active:  # a backward outside a training step (e.g. a user's probe): leave .grad
            return
        # Pending gradients were taken off their parameters but are alive all the same.
        live = [q.grad for q in self.params if q.grad is not None] + [f.grad for f in self._pending]
        self._count_live(live)
        mark_gradient(p.grad)  # for a running memory profile (lowmem_grpo.memory.profile); free otherwise
        grad, p.grad = p.grad, None  # the point of this optimizer: the parameter lets go of it here
        self._fired.append(index)
        with scope("optimizer"):
            self._pending.append(self._finished(index, grad))
            self._pending_bytes += self._pending[-1].nbytes
            self._apply_finished(wait=False)

    def _updated(self, p: torch.Tensor) -> torch.Tensor:
        """The tensor the inner optimizer updates for parameter p: p itself (offload.py: a host copy)."""
        return p

    def _finished(self, index: int, grad: torch.Tensor) -> _Finished:
        """A gradient whose hook ran, on its way to its update: its norm travels to the host."""
        norm, ready, stream = self._norm_to_host(fp32_norm_tensor(grad))
        return _Finished(index, grad, norm, ready, stream, grad.numel() * grad.element_size())

    def _count_live(self, grads: list[torch.Tensor]) -> None:
        self.max_live_grads = max(self.max_live_grads, len(grads))
        self.max_live_grad_bytes = max(self.max_live_grad_bytes, sum(g.numel() * g.element_size() for g in grads))

    def _norm_to_host(self, norm: torch.Tensor):
        """(the norm where the host can read it, an event that completes when it is there, the stream).
        On CUDA, an asynchronous copy into a slot of a pinned buffer: nothing waits for it here."""
        if norm.device.type != "cuda":
            return norm, None, None  # CPU: already there (other devices: read with a sync when applied)
        if self._host_used == len(self._host_norms):  # the first CUDA backward, or more hooks than tensors
            # Allocated once, not per hook: pinning memory (cudaHostAlloc) can itself stall the device.
            # A full buffer stays alive while pending updates hold views of it.
            self._host_norms = torch.empty(max(len(self.params), 2 * self._host_used), dtype=torch.float32,
                                          pin_memory=True)
            self._host_used = 0
        host = self._host_norms[self._host_used]  # (slots are reused next step: all read by end_step)
        self._host_used += 1
        stream = torch.cuda.current_stream(norm.device)
        host.copy_(norm, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(stream)
        return host, ready, stream

    def _apply_finished(self, wait: bool) -> None:
        """Apply the pending updates whose norms have arrived, oldest first (the order of the hooks).
        With `wait`, apply them all. Otherwise, when the pending gradients exceed lag_bytes, apply the
        oldest until at most half of lag_bytes stays pending, after one wait: for the event of the
        newest one that must go (events of one stream complete in order), which is old enough that the
        kernels queued after it keep the GPU busy while the host queues the updates."""
        must = 0  # how many of the oldest pending updates are applied now, waiting if need be
        if wait:
            must = len(self._pending)
        elif self._pending_bytes > self.lag_bytes:
            left = self._pending_bytes
            for f in self._pending:
                if left <= self.lag_bytes // 2:
                    break
                left, must = left - f.nbytes, must + 1
        if must:
            self._wait(self._pending[must - 1])
        while self._pending:
            f = self._pending[0]
            if must > 0:
                self._wait(f)  # nothing to wait for unless made on another stream than the one waited for
            elif f.ready is not None and not f.ready.query():
                break
            must -= 1
            self._pending.popleft()
            self._pending_bytes -= f.nbytes
            self._apply(f.index, *self._arrived(f), f.stream)

    def _arrived(self, f: _Finished) -> tuple[torch.Tensor, float]:
        """(gradient, its norm read on the host) of a finished gradient whose `ready` has completed."""
        return f.grad, float(f.norm)

    def _wait(self, f: _Finished) -> None:
        if f.ready is not None and not f.ready.query():
            f.ready.synchronize()
            self.host_waits += 1

    def _apply(self, index: int, grad: torch.Tensor, norm: float, stream: Optional[torch.cuda.Stream]) -> None:
        """Today's per-tensor rule, with the norm already on the host: skip if non-finite, clip to the
        tensor's cap, step its inner optimizer at the current learning rate."""
        self._sq_norm += norm * norm
        if not math.isfinite(norm):
            self.nonfinite_tensors += 1
            return
        p = self.params[index]
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            cap = self.caps[p]
            if cap is not None and norm > cap:
                grad.mul_(cap / (norm + 1e-6))
            self._step_inner(index, grad)

    def _step_inner(self, index: int, grad: torch.Tensor, lr: Optional[float] = None) -> None:
        """Step parameter `index`'s inner optimizer on `grad` (already clipped) at `lr`, default the current
        learning rate (offload.py's update thread passes the one read when its step was handed over)."""
        p = self.params[index]
        inner = self.inner[p]
        inner.param_groups[0]["lr"] = self.param_groups[self._group_of[index]]["lr"] if lr is None else lr
        # A later gradient of p may be accumulating (a hook firing twice in one backward, as with
        # reentrant checkpointing): keep it for its own hook.
        target = self._updated(p)
        later, target.grad = target.grad, grad
        try:
            if self._bnb_unpaged[p] and _on_default_stream(target):
                with torch.no_grad():
                    _step_bnb_without_sync(inner)
            else:
                inner.step()
        finally:
            target.grad = later

    def begin_step(self) -> None:
        self.active, self._sq_norm, self.nonfinite_tensors, self.host_waits = True, 0.0, 0, 0
        self.max_live_grads = self.max_live_grad_bytes = 0
        self._pending.clear()  # left by a backward that raised: its step is broken anyway
        self._pending_bytes = 0
        self._host_used = 0
        self._fired = []

    def end_step(self) -> float:
        """Finish the step that the backward just ran; returns the global gradient norm (before clipping)."""
        self._apply_finished(wait=True)
        if self._fired:
            self._update_order = list(dict.fromkeys(self._fired))
        self.active = False
        return math.sqrt(self._sq_norm)

    def step_zero_gradients(self) -> float:
        """One optimizer step in which every gradient is exactly zero, without a backward: what the
        hooks would do for a backward of `0 * loss`. Adam still moves on its momentum. One zero
        gradient exists at a time (allocated, stepped, freed); the current learning rates apply; the
        metrics count it as a step with global norm 0, which is returned.

        Parameters are stepped in the order their hooks ran in the last backward (then any others, in
        reverse order of registration): the stochastic-rounding optimizer draws from the global RNG
        per parameter, so this order makes its draws those of the real zero-gradient backward."""
        if self.active:
            raise RuntimeError("step_zero_gradients() inside a step: call end_step() first")
        self.begin_step()
        order = list(dict.fromkeys(self._update_order + list(range(len(self.params) - 1, -1, -1))))
        with scope("optimizer"):
            for index in order:
                p = self._updated(self.params[index])
                grad = torch.zeros_like(p)
                self._count_live([grad])
                mark_gradient(grad)
                stream = torch.cuda.current_stream(p.device) if p.device.type == "cuda" else None
                self._apply(index, grad, 0.0, stream)
                del grad  # freed before the next one exists
        return self.end_step()

    def step(self, closure=None):  # the real steps ran in backward
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def state_dict(self) -> dict:
        return {"outer": super().state_dict(), "inner": [self.inner[p].state_dict() for p in self.params]}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state["outer"])
        for p, s in zip(self.params, state["inner"]):
            self.inner[p].load_state_dict(s)


def _on_default_stream(p: torch.Tensor) -> bool:
    """bitsandbytes launches its kernels on the legacy default stream (no stream argument): without its
    sync they are ordered with ours only if ours run there too."""
    return p.device.type != "cuda" or torch.cuda.current_stream(p.device).cuda_stream == 0

