"""Optimizer states in host RAM: gradients sent down from the backward hooks, summed on the host, and
one optimizer step per optimizer step computed on the CPU.

With `optim.offload_optimizer`, a post-accumulate-grad hook on every parameter (the hooks of
optimizer_in_backward.py) starts each gradient's trip to the host as soon as autograd has made it:

    hook, first micro-batch   ->  the gradient is copied into the parameter's pinned host gradient buffer
                                  (on the side stream; the device copy is freed once the copy is done)
    hook, later micro-batches ->  the gradient is copied chunk by chunk into a small staging ring in
                                  host RAM (`STAGING_SLOTS` x `STAGING_CHUNK_BYTES`) and added into the
                                  buffer there
    end_step (after the last  ->  every gradient of the optimizer step is on the host: the global norm
    micro-batch's backward)       (TRL's, torch clip_grad_norm_'s) on the calling thread, returned; then
                                  the clip, the inner optimizer's step of each host copy in forward order
                                  and each new weight's upload run on the update thread (below), and
                                  end_step returns at once
    next forward              ->  each module waits for its own parameters' updates (and, on CUDA, the
                                  compute stream for their uploads) before it runs

So the device holds the weights and, briefly, the gradients in flight (at most `lag_bytes` of first
copies, or the staging ring's chunks); the optimizer states, a copy of the weights and the gradient
buffers live in host RAM. `gradient_accumulation_steps` > 1 costs only the staging ring
(`staging_bytes()`, 64 MiB) in host RAM, and the number of optimizer steps -- the dominant cost, a full
host pass over the states -- is one per `gradient_accumulation_steps` micro-batches, as in TRL. The
buffers that cross PCIe are views of one block of exactly the planned size, page-locked on CUDA
(host_arena.py: per-tensor `pin_memory` would round each up to a power of two; the staging ring is one
power-of-two allocation already); the start-up check (`check_host_ram`) counts them and the states
before any is allocated.

Clipping is TRL's: the global norm over every gradient of the step, coef = max_grad_norm / (norm +
1e-6) clamped to 1, every gradient multiplied by it (by host_adamw.py's kernel, as it reads the gradient:
no pass of its own); a non-finite global norm skips the whole step
(weights and states untouched), as the plain path does. (The on-device optimizer in backward has no
whole gradient to take a norm of, so it keeps its per-tensor rule: optimizer_in_backward.py.) Per-tensor
norms are computed on the host in fp32 chunks (`fp32_norm_tensor`) and rounded to the gradient dtype, the
total is taken in that dtype, as torch's clip_grad_norm_ does, so the clip factor is the plain path's.

The accumulation dtype. The gradient buffer is in the weight dtype, and a later micro-batch's gradient is
added into it with one rounding per add: exactly what autograd does when it accumulates into `.grad` on
the device in the plain path, so offloaded and plain runs get the same summed gradient bit for bit (the
tests check it). Measured (benchmarks/offload_accumulation_dtype.py, RESULTS.md, "accumulation dtype"):
against the exact sum, a bf16 buffer's error grows from 1.8e-3 (ga 2) to 5.0e-3 (ga 16) relative, 3x
that of a single rounding of the exact sum to bf16 and ~300x below the gradient's own sampling noise;
an fp32 buffer would be near-exact but cost 2 more bytes per parameter of (pinned) host RAM, 5.8 GiB
for 3B. So the weight dtype: the plain path's arithmetic, at no host RAM beyond the staging ring.

The inner optimizer is the one the recipe names, applied to the host copy. Two ways to make the
updates land in bf16 device weights, with their host RAM per parameter (`host_bytes_per_param`):

    optimizer      host copy             gradient buffer   states          host RAM   host step, 2-core CPU
    adamw          fp32 master (4)       bf16 or fp32      fp32 (8)        14 / 16    host_adamw.py's one-pass
                                                                                      fp32 kernel (HostAdamW):
                                                                                      0.31 ns/parameter (bf16)
    adamw_8bit     bf16 + stochastic     bf16 (2)          8-bit (~2)       6         host_adamw.py's fused
                   rounding (2)                                                       kernel: 1.0-1.1 ns

With `adamw` on bf16 weights the host keeps an fp32 master copy; the device gets it rounded to
nearest (its bf16 gradient buffer doubles as the upload buffer), so no update is lost. With
`adamw_8bit` on bf16 weights the stochastic-rounding optimizer (sr_adamw.py) updates the bf16 copy
itself. fp32 weights: the copy is fp32 and the device weight is exactly it. The updates run in the
order of `params` (the optimizer's groups: decay matrices, then norm gains and biases, each in the model's
order), the order in which the plain path's optimizer steps them, so stochastic rounding draws the same
numbers. The global norm sums in the model's order instead (`norm_order`), as the plain path clips. Measured
costs: benchmarks/offload_host_update.py and RESULTS.md.

Off the autograd thread. The host update (a full pass over the states: the dominant cost of a step) runs
on one long-lived daemon thread, so the caller goes on at once: on a GPU machine the next generation or
forward starts while the host still updates the last parameters. Each parameter handed over gets a
readiness signal (a threading.Event, set once its update is done and its upload queued; on CUDA also an
event on the side stream after its upload). `wait_in_forward(model, heads)` puts a forward pre-hook on
every module that owns parameters directly, waiting for exactly those, and makes the fused loss head's
weight read (policy/model.py `Head`; the tied head's leaf) wait for the head weight: the embedding's update
is the first one done, the output head's the last, so the forward overlaps the rest. state_dict(),
load_state_dict(), refresh_host_weights(), begin_step() and step_zero_gradients() wait for all; code that
reads the weights otherwise (a checkpoint's save, save_pretrained) calls `synchronize()` first. Until
`wait_in_forward` is called nothing would wait, so end_step updates inline (as with update_thread=False).
The trainer calls it (training/step_modes.py, OffloadStep); the memory profiler turns the thread off
while it profiles (memory/profile.py: its tracker sees one thread). In the trainer a rollout's first
weight read comes before the updates are done and waits; tests/training/test_offload_training.py delays
every update on the worker and gets the plain run bit for bit.
An error on the worker is kept and raised on the caller's thread at its next wait (a forward, synchronize,
begin_step), once; the worker goes on with the next step. The learning rates are read in end_step (the
scheduler changes them right after). The stochastic-rounding draws (sr_adamw.py, host_adamw.py) come from a
copy of torch's global CPU generator taken in end_step, not from the generator itself, so they never
interleave with the caller's draws: the updates draw what they drew inline, and once all of them have been
waited for the global generator moves to where the copy ended, where the inline update leaves it; a
caller that draws from it in between (CPU sampling before the next forward) keeps its draws and is warned
once that the run now differs from an inline one. Threads: the host kernel (host_adamw.py) releases the
GIL and runs on its own pool of `torch.get_num_threads()` threads (host_pool.cpp), torch's own CPU ops on
the worker on torch's intra-op threads; on a GPU machine the caller mostly waits on CUDA, so the two share the cores with little
contention; on a CPU-only machine the forward and the update compete for the same cores (same results,
less overlap).

Per step, across PCIe: every gradient of every micro-batch down and every weight up once,
(gradient_accumulation_steps + 1) x bytes(dtype) x parameters (1.5B bf16, ga 1: 6.2 GB); see
`pcie_bytes_per_step`.

The tied embedding (`split_tied_head`). A tied weight W (V x H) has two uses: the fused loss head at the
end of the forward and the embedding lookup at its start. Autograd sums a leaf's contributions before
its hook fires, so the head's (V, H) gradient would wait on the device through the whole backward and
meet the lookup's (V, H) gradient at the end: two of them alive at once (Qwen2.5-3B bf16: 2 x 0.58
GiB). Instead the head multiplies by a leaf of its own that shares W's storage: the optimizer sets the
loss head's `weight_source` (policy/model.py, `Head`) to `head_leaf`, an explicit handle the offload mode
owns. The leaf's hook sends the head's contribution to a host buffer (`head_host`) as soon as the head's
backward is done, and the device copy is freed. When W's own hook fires (the lookup), its gradient
goes down as any other and the two are added on the host (the same single rounding as autograd's sum on
the device) before the micro-batch's sum joins the accumulated gradient (again one rounding, as on the
device). The device never holds more than one (V, H) gradient; the host holds one more (V, H) buffer.
(The on-device optimizer in backward has no such split: there the sum needs both contributions on the
device at the lookup either way.)
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import weakref
from collections import deque
from typing import Callable, Optional

import torch
from torch import nn

from ..phases import mark_gradient, scope
from ..host_arena import PAGE, HostArena, arena_bytes, buffer_bytes
from .optimizer_in_backward import LAG_BYTES, OptimizerInBackward, fp32_norm_tensor, weakly

logger = logging.getLogger(__name__)


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


UPDATE_THREAD = True  # the default: the host update runs on a worker thread (module docstring)

STAGING_SLOTS = 4  # chunks of a later micro-batch's gradient in flight to the host at once
STAGING_CHUNK_BYTES = 16 << 20


def staging_bytes() -> int:
    """Host RAM (pinned on CUDA) of the staging ring that later micro-batches' gradients arrive in:
    what gradient accumulation costs on top of the offloaded optimizer (the planner counts it)."""
    return STAGING_SLOTS * STAGING_CHUNK_BYTES


class OffloadedOptimizer(OptimizerInBackward):
    """The optimizer-in-backward hooks send each gradient to a host buffer; `end_step` clips by the global
    norm and steps host copies of the weights (module docstring).

    One optimizer step: `begin_step()`, then for each micro-batch its backward followed by
    `end_backward()`, then `end_step()` (which ends the last backward itself). The state_dict has the
    on-device optimizer in backward's format.

    `update_thread` (default UPDATE_THREAD, on): end_step hands the updates to a worker thread once
    `wait_in_forward(model, heads)` has made the forward wait for them; `synchronize()` before reading the
    weights other than through a forward (module docstring, "Off the autograd thread")."""

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
        # The update thread ("Off the autograd thread" in the module docstring). Used once the forward
        # waits for it (`wait_in_forward`); until then end_step updates inline.
        self.update_thread = update_thread
        self._forward_waits = False
        self._waiting_models: set[int] = set()  # ids of the models given to wait_in_forward
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._worker: Optional[threading.Thread] = None
        self._ready: dict[int, threading.Event] = {}  # handed-over updates not yet waited for, by index
        self._uploaded: dict[int, torch.cuda.Event] = {}  # CUDA: each one's upload, on the side stream
        self._step_done = threading.Event()  # the worker finished the step handed to it
        self._step_done.set()
        self._handed = False  # an update was handed over since the last synchronize (CUDA: wait for its uploads)
        self._error: Optional[BaseException] = None  # raised by the worker, re-raised at the next wait
        self._step_generator = None  # (generator, global state it copied) of the step in flight
        self._warned_rng = False
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
        self._summed: set[int] = set()  # indices whose host buffer holds a gradient in this optimizer step
        self._this_backward: set[int] = set()  # indices whose hook ran in the current backward
        self.tied: Optional[torch.Tensor] = None  # the tied embedding whose head use has its own leaf
        self._head_leaf: Optional[torch.Tensor] = None
        self.head_host: Optional[torch.Tensor] = None  # the head's contribution of one micro-batch (V x H)
        self.head_arena: Optional[HostArena] = None  # its block of host memory
        self._head_arrived = False  # in this backward (its copy may still be on the way: _head_ready)
        self._head_ready: Optional[torch.cuda.Event] = None

    # ----- the tied embedding (module docstring) ---------------------------------------------------
    def split_tied_head(self, model: nn.Module, heads=()) -> bool:
        """If `model`'s output embedding is tied to its input embedding, make each of `heads` (policy/model.py
        `Head`s: the loss's) multiply by a leaf of its own for the weight (module docstring, "The tied
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
    def _on_gradient(self, index: int, p: torch.Tensor) -> None:
        if not self.active:  # a backward outside a training step (e.g. a user's probe): leave .grad
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
            self._first_copies[index] = self._copy_to_host(grad, host_grad)
            self._bound_in_flight(self._first_copies[index], grad.numel() * grad.element_size())
            if with_head:  # head + lookup, one rounding (autograd's sum on the device)
                self._wait_first_copy(index)
                host_grad.add_(self.head_host)
        else:
            self._wait_first_copy(index)
            self._stage_and_add(grad, host_grad, self.head_host if with_head else None)
        self._summed.add(index)
        self._this_backward.add(index)
        self._fired.append(index)

    def _copy_to_host(self, grad: torch.Tensor, host: torch.Tensor) -> Optional[torch.cuda.Event]:
        """Copy a gradient into a host buffer: at once on the CPU (None), else queued on the side stream,
        with an event that completes when it is there."""
        if not self.on_cuda:
            host.copy_(grad)
            return None
        self.side.wait_stream(torch.cuda.current_stream(grad.device))  # the gradient is complete there
        with torch.cuda.stream(self.side):
            host.copy_(grad, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.side)
        # The caching allocator must not hand this memory out before the side stream has read it.
        grad.record_stream(self.side)
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
            # The head used the tied weight and the lookup did not (hidden states given directly): the
            # head's contribution is the tied weight's whole gradient in this micro-batch.
            index = self._index_of[self.tied]
            self._wait_head()
            self._head_arrived = False
            host_grad = self.host_grad[self.tied]
            self._wait_first_copy(index)
            if index in self._summed:
                host_grad.add_(self.head_host)
            else:
                host_grad.copy_(self.head_host)
            self._summed.add(index)
            self._fired.append(index)
        while self._staged:
            self._land_oldest_chunk()
        self._this_backward = set()

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

    def end_step(self, apply: bool = True) -> float:
        """Finish the optimizer step: the global norm of the summed gradients (returned), then, if `apply`
        and the norm is finite, the clip and one update of every parameter that got a gradient. With
        apply=False (the trainer's non-finite loss) nothing changes."""
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
            self._host_norm_slots[index] = fp32_norm_tensor(grad)
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

    def _rounding_generator(self) -> torch.Generator:
        """The step's stochastic-rounding draws: a copy of torch's global CPU generator as it stands, so the
        updates draw the numbers they drew from the global generator before (the plain path's: the tests
        compare bit for bit) on whichever thread they run, never racing the caller's own draws. The global
        generator takes the copy's final state once every update is done and waited for (`_adopt_rng`):
        where the plain path's step would have left it, so the caller's later sampling is the plain path's
        too, and `torch.manual_seed` and a checkpoint's RNG state (saved after `synchronize()`) fix the run."""
        start = torch.get_rng_state()
        generator = torch.Generator()
        generator.set_state(start)
        self._step_generator = (generator, start)
        return generator

    def _adopt_rng(self) -> None:
        """Move the global generator to where the step's updates left their copy (once they are done). If the
        caller drew from it in the meantime (before a forward or synchronize() waited for the updates), it
        is left where those draws took it: moving it back would hand out their numbers again."""
        pending, self._step_generator = self._step_generator, None
        if pending is None:
            return
        generator, start = pending
        if torch.equal(torch.get_rng_state(), start):
            torch.set_rng_state(generator.get_state())
        elif not self._warned_rng:
            self._warned_rng = True
            logger.warning("torch's global CPU generator was drawn from while the offloaded optimizer's update "
                           "was still running (after end_step, before a forward or synchronize()): this run's "
                           "random numbers now differ from a run without the update thread; call "
                           "optimizer.synchronize() before such draws to keep them the same")

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
        if self.on_cuda:  # (the side stream already waits for the backward: end_step)
            with torch.cuda.stream(self.side):  # the new weight goes back while the host updates the next
                p.data.copy_(upload, non_blocking=True)
                uploaded = torch.cuda.Event()
                uploaded.record(self.side)
            self._uploaded[index] = uploaded
        else:
            with torch.no_grad():
                p.copy_(upload)

    # ----- the update thread (module docstring, "Off the autograd thread") ---------------------------
    def wait_in_forward(self, model: nn.Module, heads=()) -> None:
        """Make every use of the weights wait for their own updates: a forward pre-hook on each module of
        `model` that owns parameters directly, and the fused loss heads' weight (`heads`: policy/model.py
        `Head`, whose weight is read without its module's forward). Until this is called, end_step
        updates inline. Idempotent per model.

        A forward traced by torch.compile does not wait (the hook returns at once when compiling, so it adds
        no graph break): the compiled decode step (policy/static_decode.py) runs only after its rollout's
        prefill, an eager forward of the same modules, has waited for all of them, and neither the compiled
        code nor a CUDA graph replay of it calls the hooks. It is the only forward this package compiles; code
        that compiles another forward of the model calls `synchronize()` before it."""
        if id(model) in self._waiting_models:
            return

        def waits_for(indices: list[int], wait=weakly(self._wait_for)):
            def hook(_module, _args):
                if torch.compiler.is_compiling():
                    return
                wait(indices)
            return hook
        for module in model.modules():
            indices = [self._index_of[p] for p in module.parameters(recurse=False) if p in self._index_of]
            if indices:
                module.register_forward_pre_hook(waits_for(indices))
        for head in heads:
            if head.weight_source is None:  # (the tied head's leaf waits itself: head_leaf)
                output = head.output
                indices = [self._index_of[p] for p in output.parameters(recurse=False) if p in self._index_of]
                head.weight_source = lambda output=output, wait=weakly(self._wait_for), indices=indices: (
                    wait(indices), output.weight)[1]
        self._waiting_models.add(id(model))
        self._forward_waits = True

    def _hand_over(self, order: list[int], coef: Optional[torch.Tensor], lrs: list[float],
                   generator: torch.Generator) -> None:
        """Queue the step's updates on the worker thread (started on first use) and return."""
        if self._worker is None or not self._worker.is_alive():
            # The thread holds the optimizer only through a weak reference, so an optimizer nobody uses any
            # more (a notebook's finished trainer) is collected with its host RAM and pinned blocks; its
            # finalizer then ends the thread. The finalizer also runs at interpreter exit (atexit), and it
            # joins the thread there: a daemon thread still inside the C++ update when Python finalizes is
            # torn down mid-call, which aborts the process ("terminate called without an active exception").
            self._worker = threading.Thread(target=_work, args=(weakref.ref(self), self._jobs),
                                            name="lowmem-grpo-host-update", daemon=True)
            self._worker.start()
            weakref.finalize(self, _stop_worker, self._jobs, self._worker)
        ready = {index: threading.Event() for index in order}
        self._ready.update(ready)
        self._handed = True
        self._step_done.clear()
        self._jobs.put((order, coef, lrs, generator, ready))

    def _run_job(self, job: tuple) -> None:
        """One optimizer step's updates on the worker. An error is kept for the caller's next wait, and
        every readiness signal of the job is set so that no wait hangs on an update that will not come."""
        try:
            self._update_all(*job)
        except BaseException as error:  # noqa: BLE001 -- re-raised on the caller's thread
            self._error = error
        finally:
            for event in job[-1].values():
                event.set()
            self._step_done.set()

    def _wait_for(self, indices: list[int]) -> None:
        """Wait until these parameters' updates are done and (CUDA) make the current stream wait for their
        uploads; re-raise an error of the worker. Free when nothing is pending."""
        if not self._ready:
            self._raise_worker_error()
            return
        for index in indices:
            ready = self._ready.pop(index, None)
            if ready is None:
                continue
            ready.wait()
            self._raise_worker_error()
            uploaded = self._uploaded.pop(index, None)
            if uploaded is not None:
                torch.cuda.current_stream(self.params[index].device).wait_event(uploaded)
        if not self._ready:  # every update waited for: the step's draws are all made
            self._adopt_rng()

    def synchronize(self) -> None:
        """Wait for every handed-over update (and, on CUDA, make the current stream wait for the uploads);
        re-raise an error of the worker. Call it before reading the weights other than through a forward
        (a checkpoint's save, save_pretrained); the optimizer's own state_dict, load_state_dict,
        begin_step and refresh_host_weights call it."""
        self._step_done.wait()
        self._ready, self._uploaded = {}, {}
        self._adopt_rng()
        if self._handed and self.on_cuda:
            torch.cuda.current_stream(self.params[0].device).wait_stream(self.side)
        self._handed = False
        self._raise_worker_error()

    def _raise_worker_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error

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


def _stop_worker(jobs: queue.SimpleQueue, worker: threading.Thread) -> None:
    """End the update thread after the job it is running (the optimizer's finalizer, at collection or exit)."""
    jobs.put(None)
    if worker is not threading.current_thread():  # (collected on the worker itself: it ends on its own)
        worker.join()


def _work(optimizer_ref: "weakref.ref[OffloadedOptimizer]", jobs: queue.SimpleQueue) -> None:
    """The update thread's loop: one job per optimizer step, until None (release_host_memory, or the
    optimizer's finalizer) or the optimizer is gone."""
    while True:
        job = jobs.get()
        optimizer = optimizer_ref() if job is not None else None
        if optimizer is None:
            return
        optimizer._run_job(job)
        del optimizer  # no strong reference while waiting for the next job
