"""The offloaded optimizer (`optim.offload_optimizer`): optimizer states and the update in host RAM.

`OffloadedOptimizer` extends the optimizer in backward (optimizer_in_backward.py): each parameter's hook
sends its finished gradient to a host buffer in the weight dtype (first micro-batch: copied; later ones:
added through the `STAGING_SLOTS` x `STAGING_CHUNK_BYTES` staging ring, one rounding per add, as autograd
accumulates `.grad`). `end_step` takes torch clip_grad_norm_'s global norm (skipping the step if it is not
finite; a gradient that crosses once brings its norm: `device_norms`), then clips, steps the inner optimizer
on the host copy of each weight in forward order and uploads it, on the update thread (update_thread.py). The
device holds the weights and at most `lag_bytes` of gradients in flight; the host holds weight copies,
gradient buffers and states (host_ram.py counts them). Results equal the plain path's bit for bit. A tied
embedding's head contribution gets its own leaf and host buffer, so the device never holds two (V, H) gradients.

The host RAM functions (host_ram.py) and the update thread's names (update_thread.py) are importable here too.

Design notes: docs/memory-modes.md
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections import deque
from typing import Callable, Iterator, Optional

import torch
from torch import nn

from ..host_arena import HostArena, arena_bytes, buffer_bytes
from ..phases import mark_gradient, scope
from .host_ram import check_host_ram
from .host_adamw import grad_norm
from .optimizer_in_backward import LAG_BYTES, OptimizerInBackward, weakly
from ..transfers import count as count_transfer, count_sync
from .update_thread import UPDATE_THREAD, UpdateThread


STAGING_SLOTS = 4  # chunks of a later micro-batch's gradient in flight to the host at once
STAGING_CHUNK_BYTES = 16 << 20


def staging_bytes() -> int:
    """Host RAM (pinned on CUDA) of the staging ring that later micro-batches' gradients arrive in:
    what gradient accumulation costs on top of the offloaded optimizer (the planner counts it)."""
    return STAGING_SLOTS * STAGING_CHUNK_BYTES


class OffloadedOptimizer(UpdateThread, OptimizerInBackward):
    """The optimizer-in-backward hooks send each gradient to a host buffer; `end_step` clips by the global
    norm and steps host copies of the weights (docs/memory-modes.md).

    One optimizer step: `begin_step()`, then for each micro-batch its backward followed by
    `end_backward()`, then `end_step()` (which ends the last backward itself). The state_dict has the
    on-device optimizer in backward's format.

    `update_thread` (default UPDATE_THREAD, on): end_step hands the updates to a worker thread once
    `wait_in_forward(model, heads)` has made the forward wait for them; `synchronize()` before reading the
    weights other than through a forward (update_thread.py)."""

    def __init__(self, groups: list[dict], make_inner: Callable[[list[dict]], torch.optim.Optimizer],
                 max_grad_norm: float | None, defaults: dict | None = None, lag_bytes: int = LAG_BYTES,
                 master_fp32: bool = False, state_bytes: int = 0, update_thread: bool = UPDATE_THREAD,
                 norm_order: Optional[list[torch.Tensor]] = None):
        """norm_order: the parameters in the order the plain path clips them (its clip_grad_norm_ list, the
        model's order; default the groups' order). The global norm sums the squares of the per-tensor norms
        in that order, so it is the plain path's to the last bit: the groups (decay matrices first, then
        norm gains and biases) order them otherwise, and a sum in another order rounds otherwise."""
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
        self._init_update_thread(update_thread)  # update_thread.py: used once the forward waits for it
        self.refresh_host_weights()
        super().__init__(groups, make_inner, None, defaults, lag_bytes)  # None: no per-tensor caps
        self.max_grad_norm = max_grad_norm
        self._index_of = {p: i for i, p in enumerate(self.params)}
        ranked = [p for p in (norm_order or self.params) if p in self._index_of]
        if len(ranked) != len(self.params):
            raise ValueError(f"norm_order holds {len(ranked)} of the optimizer's {len(self.params)} parameters")
        self._norm_rank = {self._index_of[p]: r for r, p in enumerate(ranked)}  # index -> place in the norm's sum
        self._staging: Optional[torch.Tensor] = None  # (STAGING_SLOTS, STAGING_CHUNK_BYTES) bytes, made on first use
        self._staged: deque = deque()  # chunks in the ring, oldest first: (buffer, copied event, target, extra)
        self._staged_total = 0  # chunks staged so far (the next one goes to slot _staged_total % STAGING_SLOTS)
        self._first_copies: dict[int, Optional[torch.cuda.Event]] = {}  # first copies still landing, by index
        self._in_flight: deque = deque()  # (event, bytes) of first copies, to bound the device gradients held
        self._in_flight_bytes = 0
        self._on_host: set[int] = set()  # indices whose weight is its host copy (keep_on_host)
        self._holding = False  # gradients_held
        self._summed: set[int] = set()  # indices whose host buffer holds a gradient in this optimizer step
        self._this_backward: set[int] = set()  # indices whose hook ran in the current backward
        self.tied: Optional[torch.Tensor] = None  # the tied embedding whose head use has its own leaf
        self._head_leaf: Optional[torch.Tensor] = None
        self.head_host: Optional[torch.Tensor] = None  # the head's contribution of one micro-batch (V x H)
        self.head_arena: Optional[HostArena] = None  # its block of host memory
        self._head_arrived = False  # in this backward (its copy may still be on the way: _head_ready)
        self._head_ready: Optional[torch.cuda.Event] = None
        # device_norms: a gradient that crosses once per step has its norm taken on the device as it leaves,
        # and the norm crosses with it into its slot (_norm_arrived), so the host does not read the whole
        # gradient again for the global norm. On by default on CUDA (the device's reduction is nearly free,
        # the host's pass over every gradient is not); on the CPU the same function on the same values
        # gives the same bits either way (the tests turn it on there). A tensor summed on the host in the
        # last step (accumulation, the tied head, lookup rows) gets its norm on the host, not twice.
        self.device_norms = self.on_cuda
        self._norm_arrived: set[int] = set()  # indices whose norm slot holds their whole gradient's norm
        self._host_sums: set[int] = set()  # indices a host-side add reached in this step
        self._host_sums_before: set[int] = set()  # ... in the last step: no device norm at their first arrival

    # ----- the tied embedding (docs/memory-modes.md) -------------------------------------------------
    def split_tied_head(self, model: nn.Module, heads=()) -> bool:
        """If `model`'s output embedding is tied to its input embedding, make each of `heads` (policy/model.py
        `Head`s: the loss's) multiply by a leaf of its own for the weight (docs/memory-modes.md, "The tied
        embedding"); returns whether it did."""
        out, inp = model.get_output_embeddings(), model.get_input_embeddings()
        if out is None or inp is None or out.weight is not inp.weight or out.weight not in self._index_of:
            return False
        self.tied = out.weight
        self._tied_indices = [self._index_of[self.tied]]
        if self.head_host is None:
            head = [(self.tied.shape, self.tied.dtype)]  # its own block: the split is decided after __init__
            check_host_ram(arena_bytes([buffer_bytes(*head[0])]))
            self.head_arena = HostArena(head, pinned=self.on_cuda)
            self.head_host = self.head_arena.take(*head[0])
            self._host_grad_ptrs.add(self.head_host.data_ptr())
        for head in heads:
            head.weight_source = self.head_leaf
        return True

    def head_leaf(self) -> torch.Tensor:
        """The tensor the fused head uses for the tied weight: its storage, its own gradient. Made again if
        the weight's storage changed (e.g. `.data` replaced)."""
        self._wait_for(self._tied_indices)  # its update, if still on the update thread
        w, leaf = self.tied, self._head_leaf
        if leaf is None or leaf.data_ptr() != w.data_ptr() or leaf.shape != w.shape or leaf.device != w.device:
            leaf = self._head_leaf = w.detach().requires_grad_(w.requires_grad)
            leaf.register_post_accumulate_grad_hook(weakly(self._head_hook))
        return leaf

    def _head_hook(self, leaf: torch.Tensor) -> None:
        if self.active and self._holding:  # gradients_held: autograd adds the next backward's into it
            return
        grad, leaf.grad = leaf.grad, None
        w = self.tied
        if not self.active:  # a backward outside a training step: the weight's .grad gets everything, as unsplit
            with torch.no_grad():
                w.grad = grad if w.grad is None else w.grad.add_(grad)
            return
        if self._index_of[w] in self._this_backward:
            raise RuntimeError("the output head's gradient of the tied embedding arrived after the embedding "
                               "lookup's; it can no longer be summed with it")
        self._count_live([q.grad for q in self.params if q.grad is not None] + [grad])
        mark_gradient(grad)
        with scope("optimizer"):
            if self._head_arrived:  # a second contribution in one backward (not in the trainer's graphs)
                self._wait_head()
                self.head_host.add_(grad.to(self.head_host.device))
                return
            self._head_ready = self._copy_to_host(grad, self.head_host)
            self._head_arrived = True

    def _wait_head(self) -> None:
        self._wait_event(self._head_ready)
        self._head_ready = None

    # ----- gradients to the host -------------------------------------------------------------------
    @contextlib.contextmanager
    def gradients_held(self) -> Iterator[None]:
        """Inside, finished gradients stay in `.grad` on the device, where autograd adds the next backward's
        into them (one rounding per add, as the host's sum); the first backward outside sends the sum on.
        (training/step_modes.py, LayerMajorStep: one layer's gradients, summed over a step's micro-batches.)"""
        self._holding = True
        try:
            yield
        finally:
            self._holding = False

    def send_held(self) -> None:
        """Send on what `gradients_held` left in `.grad` (the tied head's part first), as the hooks would
        have after a backward outside it: for a caller whose every backward held its gradients."""
        if not self.active:
            return
        if self._head_leaf is not None and self._head_leaf.grad is not None:
            self._head_hook(self._head_leaf)
        for index, p in enumerate(self.params):
            if p.grad is not None:
                self._on_gradient(index, p)

    def _on_gradient(self, index: int, p: torch.Tensor) -> None:
        if not self.active or self._holding:  # outside a training step (e.g. a user's probe), or held: leave .grad
            return
        self._count_live([q.grad for q in self.params if q.grad is not None])
        mark_gradient(p.grad)  # for a running memory profile (lowmem_grpo.memory.profile); free otherwise
        grad, p.grad = p.grad, None  # the device lets go of it once it is on its way
        with scope("optimizer"):
            self._receive(index, grad)

    def _receive(self, index: int, grad: torch.Tensor) -> None:
        """Send a finished gradient to parameter `index`'s host buffer: copied there if it is the step's
        first, else added into it through the staging ring (with the head's contribution of this
        micro-batch, for the tied weight)."""
        p = self.params[index]
        host_grad = self.host_grad[p]
        with_head = p is self.tied and self._head_arrived
        if with_head:
            self._wait_head()
            self._head_arrived = False
        if index not in self._summed:
            norm = (grad_norm(grad) if self.device_norms and not with_head
                    and index not in self._host_sums_before else None)
            with_norm = () if norm is None else ((norm, self._host_norm_slots[index]),)
            self._first_copies[index] = self._copy_to_host(grad, host_grad, also=with_norm)
            self._bound_in_flight(self._first_copies[index], grad.numel() * grad.element_size())
            if norm is not None:
                self._norm_arrived.add(index)
            if with_head:  # head + lookup, one rounding (autograd's sum on the device)
                self._wait_first_copy(index)
                host_grad.add_(self.head_host)
                self._added_on_host(index)
        else:
            self._wait_first_copy(index)
            self._stage_and_add(grad, host_grad, self.head_host if with_head else None)
            self._added_on_host(index)
        self._summed.add(index)
        self._this_backward.add(index)
        self._fired.append(index)

    def receive_rows(self, p: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Add a gradient given by its non-zero rows to parameter `p`'s host buffer: `p`'s gradient is zero
        but at the (distinct) row indices `ids`, where it is `rows` (an embedding lookup's, from
        training/lookup_rows.py). The same roundings as the whole gradient's: a row added to zero is itself,
        and each row is added once. Sent with its ids ("lookup gradients"); the host waits for them."""
        if not self.active:  # outside a training step: as a whole gradient in .grad
            grad = torch.zeros_like(p).index_add_(0, ids, rows.to(p.dtype))
            p.grad = grad if p.grad is None else p.grad.add_(grad)
            return
        index = self._index_of[p]
        with scope("optimizer"):
            if self._head_arrived:  # the tied head's part of this micro-batch first, as end_backward adds it
                self._fold_head()
            host_ids = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=self.on_cuda)
            host_rows = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=self.on_cuda)
            ready = [self._copy_to_host(ids, host_ids, "lookup gradients"),
                     self._copy_to_host(rows, host_rows, "lookup gradients")]
            for event in ready:
                self._wait_event(event)
            self._wait_first_copy(index)
            while self._staged:  # earlier chunks may still be on their way into this buffer
                self._land_oldest_chunk()
            host_grad = self.host_grad[p]
            if index not in self._summed:
                host_grad.zero_()
            host_grad.index_add_(0, host_ids, host_rows)
            self._added_on_host(index)
        self._summed.add(index)
        self._this_backward.add(index)
        self._fired.append(index)

    def _copy_to_host(self, grad: torch.Tensor, host: torch.Tensor, kind: str = "gradients",
                      also: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()) -> Optional[torch.cuda.Event]:
        """Copy a gradient into a host buffer: at once on the CPU (None), else queued on the side stream,
        with an event that completes when it is there. Counted as a transfer (`kind`) either way. `also`:
        (device tensor, host tensor) pairs copied with it, under the same event (its norm: 4 bytes, not
        counted)."""
        count_transfer(kind, "d2h", grad.numel() * grad.element_size())
        if not self.on_cuda:
            host.copy_(grad)
            for source, target in also:
                target.copy_(source)
            return None
        self.side.wait_stream(torch.cuda.current_stream(grad.device))  # the gradient is complete there
        with torch.cuda.stream(self.side):
            host.copy_(grad, non_blocking=True)
            for source, target in also:
                target.copy_(source, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.side)
        # The caching allocator must not hand this memory out before the side stream has read it.
        for tensor in (grad, *(source for source, _ in also)):
            tensor.record_stream(self.side)
        return ready

    def _bound_in_flight(self, ready: Optional[torch.cuda.Event], nbytes: int) -> None:
        """Keep at most `lag_bytes` of device gradients waiting for their first copy (oldest waited for)."""
        if ready is None:
            return
        self._in_flight.append((ready, nbytes))
        self._in_flight_bytes += nbytes
        while self._in_flight_bytes > self.lag_bytes and len(self._in_flight) > 1:
            event, n = self._in_flight.popleft()
            self._wait_event(event)
            self._in_flight_bytes -= n

    def _wait_event(self, event: Optional[torch.cuda.Event]) -> None:
        if event is not None and not event.query():
            event.synchronize()
            self.host_waits += 1
            count_sync()

    def _wait_first_copy(self, index: int) -> None:
        self._wait_event(self._first_copies.pop(index, None))

    def staging_ring(self) -> torch.Tensor:
        """The (STAGING_SLOTS, STAGING_CHUNK_BYTES) byte ring later micro-batches' gradients arrive in, made
        on first use (a run with gradient_accumulation_steps > 1 makes it in its second micro-batch)."""
        if self._staging is None:
            # one pinned allocation of a power of two (64 MiB): torch's host allocator rounds nothing off it
            self._staging = torch.empty(STAGING_SLOTS, STAGING_CHUNK_BYTES, dtype=torch.uint8, pin_memory=self.on_cuda)
        return self._staging

    def _stage_and_add(self, grad: torch.Tensor, host_grad: torch.Tensor, extra: Optional[torch.Tensor]) -> None:
        """host_grad += grad (+ extra, summed first), chunk by chunk through the staging ring: at most
        STAGING_SLOTS chunks on their way; a chunk is added in once its copy has landed."""
        staging = self.staging_ring()
        source, target = grad.reshape(-1), host_grad.view(-1)
        extra = None if extra is None else extra.view(-1)
        chunk = STAGING_CHUNK_BYTES // grad.element_size()
        for start in range(0, source.numel(), chunk):
            end = min(start + chunk, source.numel())
            if len(self._staged) == STAGING_SLOTS:
                self._land_oldest_chunk()
            buffer = staging[self._staged_total % STAGING_SLOTS].view(grad.dtype)[:end - start]
            self._staged_total += 1
            ready = self._copy_to_host(source[start:end], buffer)
            self._staged.append((buffer, ready, target[start:end], None if extra is None else extra[start:end]))

    def _land_oldest_chunk(self) -> None:
        buffer, ready, target, extra = self._staged.popleft()
        self._wait_event(ready)
        if extra is not None:
            buffer.add_(extra)
        target.add_(buffer)

    def end_backward(self) -> None:
        """After each micro-batch's backward: its gradients are all in their host buffers."""
        if self._head_arrived:
            self._fold_head()
        while self._staged:
            self._land_oldest_chunk()
        self._this_backward = set()

    def _fold_head(self) -> None:
        """Add the tied head's contribution of this micro-batch to the weight's host buffer, where the
        lookup's gradient did not come with it (hidden states given directly, or a lookup's rows)."""
        index = self._index_of[self.tied]
        self._wait_head()
        self._head_arrived = False
        host_grad = self.host_grad[self.tied]
        self._wait_first_copy(index)
        if index in self._summed:
            host_grad.add_(self.head_host)
        else:
            host_grad.copy_(self.head_host)
        self._added_on_host(index)
        self._summed.add(index)
        self._fired.append(index)

    # ----- the step --------------------------------------------------------------------------------
    def begin_step(self) -> None:
        self.synchronize()  # the last step's updates read the host gradient buffers that this step fills
        if self.on_cuda:  # the last step's uploads read host buffers that this step's gradients overwrite
            self.side.synchronize()
        self.active, self.nonfinite_tensors, self.host_waits = True, 0, 0
        self.max_live_grads = self.max_live_grad_bytes = 0
        self._fired, self._summed, self._this_backward = [], set(), set()
        self._staged.clear()  # left by a backward that raised: its step is broken anyway
        self._first_copies, self._in_flight, self._in_flight_bytes = {}, deque(), 0
        self._head_arrived, self._head_ready = False, None
        self._norm_arrived, self._host_sums_before, self._host_sums = set(), self._host_sums, set()

    def _added_on_host(self, index: int) -> None:
        """Parameter `index`'s host buffer got a sum on the host: its norm is the host's to take, this step
        and the next (where its first arrival then takes no device norm)."""
        self._norm_arrived.discard(index)
        self._host_sums.add(index)

    def end_step(self, apply: bool = True) -> float:
        """Finish the optimizer step: the global norm of the summed gradients (returned), then, if `apply`
        and the norm is finite, the clip and one update of every parameter that got a gradient. With
        apply=False (the trainer's non-finite loss) nothing changes."""
        self.send_held()  # (none left where the caller sent them)
        self.end_backward()
        for index in list(self._first_copies):
            self._wait_first_copy(index)
        self._in_flight, self._in_flight_bytes = deque(), 0
        order = sorted(self._summed)  # forward order: the plain optimizer's, and its RNG draws
        norm = self._global_norm(order)
        if apply and math.isfinite(float(norm)):
            coef = None
            if self.max_grad_norm:  # torch.nn.utils.clip_grad_norm_: one factor for all, at most 1
                coef = torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)
            # Read here, on the calling thread: the scheduler changes the rates right after end_step, and
            # the rounding draws must not interleave with the caller's sampling.
            lrs = [self.param_groups[self._group_of[i]]["lr"] for i in order]
            # each updated weight goes up once (counted here, on the calling thread: this step's bytes), but
            # those kept on the host (they cross when they compute: policy layers)
            count_transfer("weights", "h2d", sum(self.params[i].numel() * self.params[i].element_size()
                                                 for i in order if i not in self._on_host))
            generator = self._rounding_generator()
            if self.on_cuda:  # kernels that read the old weights (the backward) are queued on the compute stream
                self.side.wait_stream(torch.cuda.current_stream(self.params[0].device))
            if self.update_thread and self._forward_waits:
                self._hand_over(order, coef, lrs, generator)
            else:
                self._update_all(order, coef, lrs, generator, {})
                self._adopt_rng()
                if self.on_cuda:  # the next forward (on the compute stream) must see every uploaded weight
                    torch.cuda.current_stream(self.params[0].device).wait_stream(self.side)
        if self._fired:
            self._update_order = list(dict.fromkeys(self._fired))
        self.active = False
        return float(norm)

    def _global_norm(self, order: list[int]) -> torch.Tensor:
        """torch clip_grad_norm_'s total norm of the host gradients: each tensor's norm in its dtype (made
        in fp32 chunks: no fp32 copy of a bf16 embedding), then the norm of those."""
        if not order:
            return torch.zeros(())
        norms = []
        for index in sorted(order, key=self._norm_rank.__getitem__):  # the plain path's order (norm_order)
            grad = self.host_grad[self.params[index]]
            if index not in self._norm_arrived:  # (else its slot holds the device's: device_norms)
                self._host_norm_slots[index] = grad_norm(grad)
            norms.append(self._host_norm_slots[index].to(grad.dtype))
        self.nonfinite_tensors = int(sum(not math.isfinite(float(n)) for n in norms))
        return torch.linalg.vector_norm(torch.stack(norms))

    def clip_gradient(self, index: int, coef: Optional[torch.Tensor]) -> None:
        """Apply the clip factor to parameter `index`'s host gradient, as clip_grad_norm_ does (a factor of 1
        is left out: exact either way). An inner optimizer that takes a gradient scale (host_adamw.py's
        kernel) multiplies in fp32 inside its update, which saves a pass over the gradient; any other
        gets the gradient multiplied in place."""
        if coef is None or float(coef) >= 1.0:
            return
        p = self.params[index]
        inner = self.inner[p]
        if getattr(inner, "takes_grad_scale", False):
            inner.param_groups[0]["grad_scale"] = float(coef)
        else:
            self.host_grad[p].mul_(coef)

    def _update_all(self, order: list[int], coef: Optional[torch.Tensor], lrs: list[float],
                    generator: torch.Generator, ready: dict[int, threading.Event]) -> None:
        """The step's updates in forward order; `ready[index]` is set once that update's upload is queued."""
        with scope("optimizer"):
            for index, lr in zip(order, lrs):
                self._update(index, coef, lr, generator)
                if index in ready:
                    ready[index].set()

    def _update(self, index: int, coef: Optional[torch.Tensor], lr: Optional[float] = None,
                generator: Optional[torch.Generator] = None) -> None:
        """Clip one host gradient, step its inner optimizer on the host copy (at `lr`, rounding draws from
        `generator`), send the new weight up (CUDA: `_uploaded[index]` completes when it is there)."""
        p = self.params[index]
        grad, host = self.host_grad[p], self.host[p]
        # An fp32 master (`adamw` on bf16 weights) goes up rounded to nearest, in the (pinned) gradient
        # buffer: its gradient is used up; the next one arrives after this upload.
        rounded = host.dtype != p.dtype
        step_fused = getattr(self.inner[p], "step_fused", None)  # host_adamw.HostAdamW: all of it in one pass
        scale = 1.0 if coef is None else min(float(coef), 1.0)
        if step_fused is None or not step_fused(host, grad, lr=lr, grad_scale=scale,
                                                round_into=grad if rounded else None):
            self.clip_gradient(index, coef)
            self.inner[p].rounding_generator = generator  # read by sr_adamw.py and host_adamw.py
            self._step_inner(index, grad.float() if rounded else grad, lr)  # bf16 grad, fp32 master: widened
            if rounded:
                grad.copy_(host)
        upload = grad if rounded else host
        if index in self._on_host:  # the host copy is the weight itself (keep_on_host)
            return
        if self.on_cuda:  # (the side stream already waits for the backward: end_step)
            with torch.cuda.stream(self.side):  # the new weight goes back while the host updates the next
                p.data.copy_(upload, non_blocking=True)
                uploaded = torch.cuda.Event()
                uploaded.record(self.side)
            self._uploaded[index] = uploaded
        else:
            with torch.no_grad():
                p.copy_(upload)

    def keep_on_host(self, params: list[torch.Tensor]) -> None:
        """model.offload_weights: each of `params` takes its host copy as its own storage (the device copy, or
        the host tensor it had, is dropped), and its update is not sent up: whoever runs it on the device
        copies it there first, after `wait_for_update` (policy/streaming.py). Needs the weight's own dtype on
        the host (no fp32 master)."""
        self.synchronize()
        for p in params:
            host = self.host[p]
            if host.dtype != p.dtype:
                raise ValueError(f"model.offload_weights streams the host copy, but it is {host.dtype} where the "
                                 f"weight is {p.dtype} (an fp32 master): use an 8-bit optimizer")
            host.copy_(p.detach())
            p.data = host
            self._on_host.add(self._index_of[p])

    def wait_for_update(self, params: list[torch.Tensor]) -> None:
        """Until the pending updates of `params` are done (a no-op where none is pending)."""
        self._wait_for([self._index_of[p] for p in params if p in self._index_of])

    def step_zero_gradients(self) -> float:
        """One optimizer step in which every gradient is exactly zero, without a backward (every completion
        of the step skipped): Adam still moves on its momentum; returns the global norm, 0."""
        if self.active:
            raise RuntimeError("step_zero_gradients() inside a step: call end_step() first")
        self.begin_step()
        for index, p in enumerate(self.params):
            self.host_grad[p].zero_()
            self._summed.add(index)
        return self.end_step()

    def release_host_memory(self) -> None:
        """Unlock the pinned blocks now, once training is done with this optimizer (the buffers stay usable,
        as ordinary memory), while the model and the optimizer live on; raises if the driver refuses
        (host_arena.py). (An optimizer nobody refers to any more is collected, the hooks on the weights and
        the update thread hold it weakly; its blocks are then unlocked at host_arena's next known point.)"""
        self.synchronize()
        if self._worker is not None and self._worker.is_alive():  # the worker thread ends too
            self._jobs.put(None)
            self._worker.join()
        self._worker = None
        for arena in (self.arena, self.head_arena):
            if arena is not None:
                arena.release()

    def refresh_host_weights(self) -> None:
        """Copy the device weights into the host copies (at start and after weights are loaded)."""
        self.synchronize()
        with torch.no_grad():
            for p, h in self.host.items():
                if p.data_ptr() != h.data_ptr():  # (not a weight kept on the host: keep_on_host)
                    h.copy_(p.detach())

    def _updated(self, p: torch.Tensor) -> torch.Tensor:
        return self.host[p]

    def _count_live(self, grads: list[torch.Tensor]) -> None:
        """Counts device gradients only: pending ones are already in the host buffers."""
        super()._count_live([g for g in grads if g.data_ptr() not in self._host_grad_ptrs])

    def state_dict(self) -> dict:
        self.synchronize()
        state = super().state_dict()
        if self.master_fp32:  # the device weights are the master rounded: resume needs the master itself
            state["master"] = [self.host[p] for p in self.params]
        return state

    def load_state_dict(self, state: dict) -> None:
        self.synchronize()
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

