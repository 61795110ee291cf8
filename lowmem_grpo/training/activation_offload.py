"""Asynchronous CPU offload of the activations that gradient checkpointing keeps (the layer inputs), with
prefetch in backward.

Inside `offload_activations()` every saved tensor of 3+ dimensions and at least `min_bytes` is copied to
pinned host memory on a side CUDA stream and released on the device once the copy is done; in backward
the next layer input needed is prefetched while the current one is used. Parameters and 2-D tensors are
never moved. The device holds at most one layer input more than without prefetch. On a CPU-only machine
it does nothing unless `copy_on_cpu` (tests, CPU memory profiles). `prefetched` and `fetched_on_demand`
count how each tensor came back. On CUDA the host copies go into one reused page-locked `HostBlock` per
device.

Design notes: docs/training.md
"""

from __future__ import annotations

import logging
import weakref
from typing import Optional

import torch
from torch import nn

from ..phases import scope
from ..transfers import count
from ..host_arena import HostArena, arena_bytes, round_up

log = logging.getLogger(__name__)


MIN_BYTES = 1 << 20  # smaller saved tensors stay where they are (the planner reads it: memory/plan.py)
_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The copy stream of `device`, made on first use and reused by every pack of every context after
    it (the loss makes a context per micro-batch; a stream per pack would take the next stream of
    torch's pool each time)."""
    stream = _side_streams.get(device)
    if stream is None:
        stream = _side_streams[device] = torch.cuda.Stream(device)
    return stream


class HostBlock:
    """Host memory for one micro-batch's offloaded saves at a time: one block (a HostArena, page-locked on
    CUDA), handed out front to back to each context in turn and reused by the next.

    A context calls `begin()` before its first copy: the block is reused from its start only if no save of
    the previous context still needs its host copy (alive and not yet copied back: backward has not run,
    or the graph is kept); else this context gets nothing from it. `take()` returns a view of the block,
    or None where the save does not fit (the caller copies it elsewhere); the bytes a context asked for
    set the block's size at the next `begin()`, so it grows to the largest micro-batch seen."""

    def __init__(self, pinned: bool):
        self.pinned = pinned
        self.arena: Optional[HostArena] = None
        self._base: Optional[torch.Tensor] = None  # the arena's bytes, (nbytes,) uint8
        self.high_water = 0  # the most bytes one context asked for (64-byte aligned, as handed out)
        self.overflows = 0  # saves that did not fit, over all contexts (tests, logs)
        self._asked = 0  # bytes the current context has asked for
        self._usable = False
        self._held: weakref.WeakSet = weakref.WeakSet()  # the current context's records in the block

    @property
    def nbytes(self) -> int:
        return self.arena.nbytes if self.arena is not None else 0

    def begin(self) -> None:
        """A new context's saves start at the block's front (after growing it, if the last ones did not fit)."""
        self._asked = 0
        if any(r.back is None for r in self._held):  # a save still needs its host copy: keep out of it
            self._usable = False
            log.debug("activation offload: the previous micro-batch's saves are still held; copying to plain "
                      "host memory")
            return
        self._held = weakref.WeakSet()
        if self.high_water > self.nbytes:
            if self.arena is not None:
                self.arena.release()  # (waits for the device's copies from the old block)
            size = arena_bytes([self.high_water])  # to the page: what the arena pins anyway
            self.arena = HostArena([((size,), torch.uint8)], pinned=self.pinned)
            self._base = self.arena.take((size,), torch.uint8)
            log.info("activation offload: %.3f GiB of host memory%s for one micro-batch's saves",
                     self.nbytes / 2**30, " pinned" if self.pinned else "")
        self._usable = self.arena is not None

    def take(self, shape: torch.Size, dtype: torch.dtype) -> Optional[torch.Tensor]:
        """A view of the block for a save of this shape and dtype, or None where it does not fit."""
        start = round_up(self._asked)
        size = shape.numel() * dtype.itemsize
        self._asked = start + size
        self.high_water = max(self.high_water, self._asked)
        if not self._usable or self._asked > len(self._base):  # (so are the saves after it: _asked only grows)
            self.overflows += 1
            return None
        return self._base[start:start + size].view(dtype).view(shape)

    def hold(self, record: "_Offloaded") -> None:
        self._held.add(record)


_host_blocks: dict[torch.device, HostBlock] = {}


def host_block(device: torch.device) -> HostBlock:
    """The page-locked block of `device`'s offloaded saves, made on first use (empty until a context asks)."""
    block = _host_blocks.get(device)
    if block is None:
        block = _host_blocks[device] = HostBlock(pinned=True)
    return block


class _Offloaded:
    """One saved tensor on the host: the host copy, the event its copy down records (CUDA), and, once
    fetched, the device copy with the event its copy back records."""

    __slots__ = ("host", "down", "device", "index", "back", "up", "__weakref__")

    def __init__(self, host: torch.Tensor, down, device: torch.device, index: int):
        self.host, self.down, self.device, self.index = host, down, device, index
        self.back: torch.Tensor | None = None  # the copy back, once issued
        self.up = None  # its event (CUDA)


class offload_activations(torch.autograd.graph.saved_tensors_hooks):  # noqa: N801 (a context manager)
    def __init__(self, min_bytes: int = MIN_BYTES, copy_on_cpu: bool = False, prefetch: bool = True,
                 block: Optional[HostBlock] = None):
        """block: where the host copies go (default: on CUDA the device's `host_block`; on the CPU, with
        copy_on_cpu, a clone per save, which a memory profile counts one by one)."""
        self.min_bytes = min_bytes
        self.copy_on_cpu = copy_on_cpu
        self.prefetch = prefetch
        self.block = block
        self._begun = False
        self.offloaded_bytes = 0  # total moved to the host inside this context (a test checks it)
        self.prefetched = self.fetched_on_demand = 0
        self._packed: list[_Offloaded] = []  # in pack order; an entry is dropped once its copy back is issued
        self._ahead: _Offloaded | None = None  # the one prefetched and not yet unpacked: at most one
        # id of each tensor packed -> weak references to it and to its record, and its version: a tensor that
        # several ops save (RMSNorm's fp32 input: by pow and by mul) goes to the host once and comes back once.
        # Weak: autograd's saved slots alone keep a record (and its copies) alive, as without this map.
        self._saved: dict[int, tuple[weakref.ref, int, weakref.ref]] = {}
        self._seen: dict[int, tuple[weakref.ref, int]] = {}  # tensors only counted (a CPU run), by id
        super().__init__(self._pack, self._unpack)

    def _eligible(self, t: torch.Tensor) -> bool:
        """Whether a GPU would move `t` (a layer input: 3+ dimensions, min_bytes or more, not a weight)."""
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter) or t.dim() < 3:
            return False
        return t.numel() * t.element_size() >= self.min_bytes

    def _counted_only(self, t: torch.Tensor) -> None:
        """A CPU run moves nothing: count the bytes a GPU would move down and back, once per tensor."""
        seen = self._seen.get(id(t))
        if seen is not None and seen[0]() is t and seen[1] == t._version:
            return
        self._seen[id(t)] = (weakref.ref(t), t._version)
        nbytes = t.numel() * t.element_size()
        count("activations", "d2h", nbytes)
        count("activations", "h2d", nbytes)

    def _block_for(self, device: torch.device) -> Optional[HostBlock]:
        """The block this context's host copies go to (begun at its first save), or None: a copy each."""
        if self.block is None and device.type == "cuda":
            self.block = host_block(device)
        if self.block is not None and not self._begun:
            self.block.begin()
            self._begun = True
        return self.block

    def _pack(self, t: torch.Tensor):
        if not self._eligible(t):
            return t
        if not (t.device.type == "cuda" or (self.copy_on_cpu and t.device.type == "cpu")):
            self._counted_only(t)
            return t
        same = self._saved.get(id(t))
        if same is not None and same[0]() is t and same[1] == t._version:  # saved before, unchanged since
            record = same[2]()
            if record is not None:
                return record
        self.offloaded_bytes += t.numel() * t.element_size()
        count("activations", "d2h", t.numel() * t.element_size())
        block = self._block_for(t.device)
        with scope("activation offload"):  # host RAM on any machine (a CPU profile leaves it out)
            host = block.take(t.shape, t.dtype) if block is not None else None
            in_block = host is not None
            if host is None:
                host = t.clone() if t.device.type == "cpu" else torch.empty(t.shape, dtype=t.dtype)
        if t.device.type == "cpu":
            if in_block:
                host.copy_(t)
            record = _Offloaded(host, None, t.device, len(self._packed))
        else:
            stream = side_stream(t.device)
            stream.wait_stream(torch.cuda.current_stream(t.device))  # t is fully written before we copy it
            with torch.cuda.stream(stream):
                host.copy_(t, non_blocking=True)  # (plain host memory: returns once copied)
                t.record_stream(stream)  # the allocator keeps t's memory until the copy has finished
                down = torch.cuda.Event()
                down.record(stream)
            record = _Offloaded(host, down, t.device, len(self._packed))
        if in_block:
            block.hold(record)
        self._packed.append(record)
        self._saved[id(t)] = (weakref.ref(t), t._version, weakref.ref(record))
        return record

    def _fetch(self, record: _Offloaded) -> None:
        """Issue the copy back of `record` (CUDA: on the side stream, after its copy down)."""
        self._packed[record.index] = None
        count("activations", "h2d", record.host.numel() * record.host.element_size())
        if record.down is None:  # copy_on_cpu
            record.back = record.host.clone()
            return
        current, stream = torch.cuda.current_stream(record.device), side_stream(record.device)
        # Allocated on the compute stream, where it is used and freed; the side stream waits for whatever
        # used that memory before, and the allocator is told the side stream writes it.
        record.back = torch.empty(record.host.shape, dtype=record.host.dtype, device=record.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):  # after its copy down: the same stream, in order
            record.back.copy_(record.host, non_blocking=True)
            record.back.record_stream(stream)
            record.up = torch.cuda.Event()
            record.up.record(stream)

    def _unpack(self, packed):
        if not isinstance(packed, _Offloaded):
            return packed
        if packed.back is None:
            self._fetch(packed)
            self.fetched_on_demand += 1
        elif packed is self._ahead:
            self._ahead = None
            self.prefetched += 1
        if self.prefetch and self._ahead is None:  # the next one backward needs: the closest one packed
            for earlier in range(packed.index - 1, -1, -1):  # before this one, not yet fetched
                if self._packed[earlier] is not None:
                    self._ahead = self._packed[earlier]
                    self._fetch(self._ahead)
                    break
        if packed.up is not None:
            torch.cuda.current_stream(packed.device).wait_event(packed.up)  # never read a half-written copy
        return packed.back
