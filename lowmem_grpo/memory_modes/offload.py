"""Optimizer states in host RAM: the optimizer step inside backward, computed on the CPU.

The optimizer in backward (optimizer_in_backward.py) already knows the moment each gradient is
complete. With `optim.offload_optimizer`, that moment starts the gradient's trip to the host instead
of a device update:

    hook (gradient complete)  ->  norm and gradient copied to pinned host memory on a side stream;
                                  the device gradient is freed once the copy is done
    later hooks / end_step    ->  once the copy has arrived: the per-tensor rule (skip if non-finite,
                                  clip to the tensor's share), the inner optimizer steps the host
                                  copy of the weight, and the new weight is queued back to the device
    end_step                  ->  the compute stream waits for the last upload: the next forward
                                  sees every updated weight

So the device holds the weights and, briefly, the gradients in flight; the optimizer states, a copy
of the weights and a gradient buffer live in host RAM. The host update of one tensor runs while the
device works through the backward kernels already queued, in the hooks of later tensors (on the
autograd thread; a separate update thread would overlap more and is not done). The buffers that
cross PCIe are views of one block of exactly the planned size, page-locked on CUDA (host_arena.py:
per-tensor `pin_memory` would round each up to a power of two); the start-up check
(`check_host_ram`) counts them and the states before any is allocated.

The inner optimizer is the one the recipe names, applied to the host copy. Two ways to make the
updates land in bf16 device weights, with their host RAM per parameter (`host_bytes_per_param`):

    optimizer      host copy             gradient buffer   states          host RAM   CPU update, 2-core CPU
    adamw          fp32 master (4)       bf16 or fp32      fp32 (8)        14 / 16    torch's fused AdamW:
                                                                                      6.2 ns/parameter (fp32)
    adamw_8bit     bf16 + stochastic     bf16 (2)          8-bit (~2)       6         bitsandbytes' CPU 8-bit
                   rounding (2)                                                       path + rounding: 16-20

With `adamw` on bf16 weights the host keeps an fp32 master copy; the device gets it rounded to
nearest (its bf16 gradient buffer doubles as the upload buffer), so no update is lost. With
`adamw_8bit` on bf16 weights the stochastic-rounding optimizer (sr_adamw.py) updates the bf16 copy
itself. fp32 weights: the copy is fp32 and the device weight is exactly it. Measured costs:
benchmarks/offload_host_update.py and RESULTS.md.

Per step, across PCIe: every gradient down and every weight up, 2 x bytes(dtype) x parameters (1.5B
bf16: 6.2 GB); see `pcie_bytes_per_step`.

The tied embedding (`split_tied_head`). A tied weight W (V x H) has two uses: the fused loss head at the
end of the forward and the embedding lookup at its start. Autograd sums a leaf's contributions before
its hook fires, so the head's (V, H) gradient would wait on the device through the whole backward and
meet the lookup's (V, H) gradient at the end: two of them alive at once (Qwen2.5-3B bf16: 2 x 0.58
GiB). Instead the head multiplies by a leaf of its own that shares W's storage (policy/model.py,
`use_head_leaf`); its hook sends the head's contribution to a host buffer as soon as the head's
backward is done, and the device copy is freed. When W's own hook fires (the lookup), its gradient
goes down as any other, the two are added on the host (the same single rounding as autograd's sum on
the device), and the per-tensor rule applies to the sum: its norm is computed on the host, it is
skipped if non-finite, clipped to W's share, and W gets one update. The device never holds more than
one (V, H) gradient; the host holds one more (V, H) buffer. (The on-device optimizer in backward has no
such split: there the sum needs both contributions on the device at the lookup either way.)
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from ..phases import mark_gradient, scope
from .host_arena import PAGE, HostArena, arena_bytes, buffer_bytes
from .optimizer_in_backward import LAG_BYTES, OptimizerInBackward, _Finished, fp32_norm_tensor


def host_bytes_per_param(weight_bytes: int, optimizer: str) -> float:
    """Host RAM per parameter with the optimizer offloaded: weight copy (an fp32 master for torch AdamW),
    gradient buffer (the weight dtype), states (8-bit: 2 bytes plus two fp32 absmax per 256-block)."""
    if optimizer == "adamw":
        return 4 + weight_bytes + 8.0
    return 2 * weight_bytes + 2.0 + 8.0 / 256


def pcie_bytes_per_step(num_params: int, weight_bytes: int) -> int:
    """Bytes crossing PCIe per optimizer step: each gradient to the host, each weight back."""
    return 2 * weight_bytes * num_params


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


class OffloadedOptimizerInBackward(OptimizerInBackward):
    """OptimizerInBackward whose inner optimizers step host copies of the weights (module docstring).

    Same interface, same per-tensor rules and the same update as the on-device optimizer in backward:
    on a CPU-only machine the two give identical parameters and states (the tests check it)."""

    def __init__(self, groups: list[dict], make_inner: Callable[[list[dict]], torch.optim.Optimizer],
                 max_grad_norm: float | None, defaults: dict | None = None, lag_bytes: int = LAG_BYTES,
                 master_fp32: bool = False, state_bytes: int = 0):
        params = [p for g in groups for p in g["params"]]
        # fp32 master copies for torch AdamW: it would round bf16 updates to nearest and lose them
        self.master_fp32 = master_fp32
        master = lambda p: torch.float32 if master_fp32 else p.dtype  # noqa: E731
        self.on_cuda = any(p.device.type == "cuda" for p in params)
        # The buffers that cross PCIe, in one block of exact size, page-locked on CUDA (host_arena.py): the
        # weight copies (unless fp32 masters), the gradient buffers, the norm slots. The planner counts
        # the same (memory/plan.py, host_categories). `state_bytes`: the inner optimizer's host states.
        specs = ([(p.shape, p.dtype) for p in params if master(p) == p.dtype] + [(p.shape, p.dtype) for p in params]
                 + [((len(params),), torch.float32)])
        masters = sum(buffer_bytes(p.shape, torch.float32) for p in params if master(p) != p.dtype)
        check_host_ram(arena_bytes(buffer_bytes(*s) for s in specs), masters + state_bytes)  # before any of it
        self.arena = HostArena(specs, pinned=self.on_cuda)  # pinned: the copies are asynchronous
        # Built before the base class makes the inner optimizers, which take these host tensors.
        # (an fp32 master is never copied across PCIe itself: it goes up rounded, via the gradient buffer)
        self.host = {p: self.arena.take(p.shape, p.dtype) if master(p) == p.dtype
                     else torch.empty(p.shape, dtype=master(p)) for p in params}
        self.host_grad = {p: self.arena.take(p.shape, p.dtype) for p in params}
        self._host_grad_ptrs = {g.data_ptr() for g in self.host_grad.values()}
        self._host_norm_slots = self.arena.take((len(params),), torch.float32)
        self.side = torch.cuda.Stream(params[0].device) if self.on_cuda else None
        self.refresh_host_weights()
        super().__init__(groups, make_inner, max_grad_norm, defaults, lag_bytes)
        self._index_of = {p: i for i, p in enumerate(self.params)}
        self.tied: Optional[torch.Tensor] = None  # the tied embedding whose head use has its own leaf
        self._head_leaf: Optional[torch.Tensor] = None
        self.head_host: Optional[torch.Tensor] = None  # the head's contribution, on the host (V x H)
        self.head_arena: Optional[HostArena] = None  # its block of host memory
        self._head_arrived = False  # in this step (its copy may still be on the way: _head_ready)
        self._head_ready: Optional[torch.cuda.Event] = None

    # ----- the tied embedding (module docstring) ---------------------------------------------------
    def split_tied_head(self, model: nn.Module) -> bool:
        """If `model`'s output embedding is tied to its input embedding, give the fused head a leaf of its
        own for the weight (module docstring, "The tied embedding"); returns whether it did."""
        from ..policy.model import use_head_leaf
        out, inp = model.get_output_embeddings(), model.get_input_embeddings()
        if out is None or inp is None or out.weight is not inp.weight or out.weight not in self._index_of:
            return False
        self.tied = out.weight
        head = [(self.tied.shape, self.tied.dtype)]  # its own block: the split is decided after __init__
        check_host_ram(arena_bytes([buffer_bytes(*head[0])]))
        self.head_arena = HostArena(head, pinned=self.on_cuda)
        self.head_host = self.head_arena.take(*head[0])
        self._host_grad_ptrs.add(self.head_host.data_ptr())
        use_head_leaf(out, self.head_leaf)
        return True

    def head_leaf(self) -> torch.Tensor:
        """The tensor the fused head uses for the tied weight: its storage, its own gradient. Made again if
        the weight's storage changed (e.g. `.data` replaced)."""
        w, leaf = self.tied, self._head_leaf
        if leaf is None or leaf.data_ptr() != w.data_ptr() or leaf.shape != w.shape or leaf.device != w.device:
            leaf = self._head_leaf = w.detach().requires_grad_(w.requires_grad)
            leaf.register_post_accumulate_grad_hook(self._head_hook)
        return leaf

    def _head_hook(self, leaf: torch.Tensor) -> None:
        grad, leaf.grad = leaf.grad, None
        w = self.tied
        if not self.active:  # a backward outside a training step: the weight's .grad gets everything, as unsplit
            with torch.no_grad():
                w.grad = grad if w.grad is None else w.grad.add_(grad)
            return
        if self._index_of[w] in self._fired:
            raise RuntimeError("the output head's gradient of the tied embedding arrived after the embedding "
                               "lookup's; its single update has already been applied")
        self._count_live([q.grad for q in self.params if q.grad is not None] + [grad])
        mark_gradient(grad)
        with scope("optimizer"):
            if self._head_arrived:  # a second contribution in one backward (not in the trainer's graphs)
                self._wait_head()
                self.head_host.add_(grad.to(self.head_host.device))
                return
            self._head_ready = self._to_host(grad, self.head_host)
            self._head_arrived = True

    def _wait_head(self) -> None:
        if self._head_ready is not None and not self._head_ready.query():
            self._head_ready.synchronize()
            self.host_waits += 1
        self._head_ready = None

    def _arrived(self, f: _Finished) -> tuple[torch.Tensor, float]:
        if f.norm is not None:
            return super()._arrived(f)
        # The tied weight: the lookup's gradient is on the host; the sum and its norm are made there.
        if self._head_arrived:
            self._wait_head()
            f.grad.add_(self.head_host)
            self._head_arrived = False
        return f.grad, float(fp32_norm_tensor(f.grad))

    def begin_step(self) -> None:
        super().begin_step()
        self._head_arrived, self._head_ready = False, None

    def release_host_memory(self) -> None:
        """Unlock the pinned blocks now, once training is done with this optimizer (the buffers stay usable,
        as ordinary memory). Deleting the optimizer is not enough: the hooks on the weights keep it alive."""
        for arena in (self.arena, self.head_arena):
            if arena is not None:
                arena.release()

    def refresh_host_weights(self) -> None:
        """Copy the device weights into the host copies (at start and after weights are loaded)."""
        with torch.no_grad():
            for p, h in self.host.items():
                h.copy_(p.detach())

    def _updated(self, p: torch.Tensor) -> torch.Tensor:
        return self.host[p]

    def _count_live(self, grads: list[torch.Tensor]) -> None:
        """Counts device gradients only: pending ones are already in the host buffers."""
        super()._count_live([g for g in grads if g.data_ptr() not in self._host_grad_ptrs])

    def _finished(self, index: int, grad: torch.Tensor) -> _Finished:
        """Start the gradient's trip to the host; the device copy is freed when the trip is done. The tied
        weight's norm waits for the head's contribution: it is computed on the host (`_arrived`)."""
        p = self.params[index]
        host_grad, host_norm = self.host_grad[p], self._host_norm_slots[index]
        nbytes = grad.numel() * grad.element_size()
        if p is self.tied and self._head_arrived:
            return _Finished(index, host_grad, None, self._to_host(grad, host_grad), None, nbytes)
        ready = self._to_host(grad, host_grad, fp32_norm_tensor(grad), host_norm)
        return _Finished(index, host_grad, host_norm, ready, None, nbytes)

    def _to_host(self, grad: torch.Tensor, host_grad: torch.Tensor, norm: Optional[torch.Tensor] = None,
                 host_norm: Optional[torch.Tensor] = None) -> Optional[torch.cuda.Event]:
        """Copy a gradient (and its norm) into host buffers: at once on the CPU (None), else queued on the
        side stream, with an event that completes when they are there."""
        if not self.on_cuda:
            host_grad.copy_(grad)
            if norm is not None:
                host_norm.copy_(norm)
            return None
        self.side.wait_stream(torch.cuda.current_stream(grad.device))  # grad and norm are complete there
        with torch.cuda.stream(self.side):
            host_grad.copy_(grad, non_blocking=True)
            if norm is not None:
                host_norm.copy_(norm, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.side)
        # The caching allocator must not hand this memory out before the side stream has read it.
        grad.record_stream(self.side)
        if norm is not None:
            norm.record_stream(self.side)
        return ready

    def _apply(self, index, grad, norm, stream) -> None:
        p = self.params[index]
        host = self.host[p]
        if grad.dtype != host.dtype:  # a bf16 gradient for an fp32 master (exact widening)
            grad = grad.float()
        super()._apply(index, grad, norm, None)  # the update runs on the host, in host memory
        upload = host
        if host.dtype != p.dtype:  # the master rounded to nearest into the (pinned) gradient buffer:
            upload = self.host_grad[p]  # its gradient is used up; the next one arrives after this upload
            upload.copy_(host)
        if self.on_cuda:
            # Kernels that read the old weight (this tensor's backward) were queued before its hook ran.
            self.side.wait_stream(torch.cuda.current_stream(p.device))
            with torch.cuda.stream(self.side):  # the new weight goes back while backward goes on
                p.data.copy_(upload, non_blocking=True)
        else:
            with torch.no_grad():
                p.copy_(upload)

    def end_step(self) -> float:
        if self._head_arrived and self._index_of[self.tied] not in self._fired:
            # The head used the tied weight and the lookup did not (hidden states given directly): the
            # head's contribution is the whole gradient.
            index = self._index_of[self.tied]
            self._wait_head()
            self._head_arrived = False
            host_grad = self.host_grad[self.tied]
            host_grad.copy_(self.head_host)
            self._fired.append(index)
            self._pending.append(_Finished(index, host_grad, None, None, None, 0))
        norm = super().end_step()
        if self.on_cuda:  # the next forward (on the compute stream) must see every uploaded weight
            torch.cuda.current_stream(self.params[0].device).wait_stream(self.side)
        return norm

    def state_dict(self) -> dict:
        state = super().state_dict()
        if self.master_fp32:  # the device weights are the master rounded: resume needs the master itself
            state["master"] = [self.host[p] for p in self.params]
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.refresh_host_weights()  # the weights were loaded into the model just before (trainer._resume)
        if self.master_fp32:
            if "master" not in state:
                raise ValueError("this optimizer state has no fp32 master weights (saved without "
                                 "optim.offload_optimizer and optim.optimizer=adamw): resume with the settings it was "
                                 "saved with")
            with torch.no_grad():
                for p, m in zip(self.params, state["master"]):
                    self.host[p].copy_(m)
