"""Asynchronous CPU offload of the activations that gradient checkpointing keeps (the layer inputs), with
prefetch in backward.

With checkpointing, the only activations alive between forward and backward are each decoder layer's
input (B, T, H) (checkpoint's own hooks drop everything inside a layer) plus a few tensors outside
the layers. Inside `offload_activations()` every such saved tensor of 3+ dimensions and at least
`min_bytes` is copied to pinned host memory on a side CUDA stream (one per device, made once), so the
copy overlaps the next layer's compute, and the device copy is released once the transfer is done.

Backward needs them in the reverse order of the forward. When autograd unpacks one, the one packed just
before it (the input of the layer whose backward comes next) starts its copy back on the side stream, so
that copy overlaps this layer's recomputation and backward; autograd's compute stream waits only on its
event. A tensor unpacked before its prefetch was issued (the first, or an order other than the reverse)
is copied back then. So the device holds at most one layer input more than without prefetch (the
planner counts it: memory/plan.py). Parameters and 2-D tensors (weights, their autocast copies) are never
moved. On a CPU-only machine it does nothing unless `copy_on_cpu` (tests: same hooks, same order, real
copies; a CPU memory profile, memory/profile.py, turns it on, so that what stays is what a GPU would
hold). The host copies are made under `scope("activation offload")`, so a profile counts them as
host RAM ("activations (offloaded)"); the copies back are the phase's own (activations, as on a GPU).
`prefetched`, `fetched_on_demand` count how each came back (the tests read them).
"""

from __future__ import annotations

import torch
from torch import nn

from ..phases import scope


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


class _Offloaded:
    """One saved tensor on the host: the pinned copy, the event its copy down records (CUDA), and, once
    fetched, the device copy with the event its copy back records."""

    __slots__ = ("host", "down", "device", "index", "back", "up")

    def __init__(self, host: torch.Tensor, down, device: torch.device, index: int):
        self.host, self.down, self.device, self.index = host, down, device, index
        self.back: torch.Tensor | None = None  # the copy back, once issued
        self.up = None  # its event (CUDA)


class offload_activations(torch.autograd.graph.saved_tensors_hooks):  # noqa: N801 (a context manager)
    def __init__(self, min_bytes: int = MIN_BYTES, copy_on_cpu: bool = False, prefetch: bool = True):
        self.min_bytes = min_bytes
        self.copy_on_cpu = copy_on_cpu
        self.prefetch = prefetch
        self.offloaded_bytes = 0  # total moved to the host inside this context (a test checks it)
        self.prefetched = self.fetched_on_demand = 0
        self._packed: list[_Offloaded] = []  # in pack order; an entry is dropped once its copy back is issued
        self._ahead: _Offloaded | None = None  # the one prefetched and not yet unpacked: at most one
        super().__init__(self._pack, self._unpack)

    def _wanted(self, t: torch.Tensor) -> bool:
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter) or t.dim() < 3:
            return False
        if t.numel() * t.element_size() < self.min_bytes:
            return False
        return t.device.type == "cuda" or (self.copy_on_cpu and t.device.type == "cpu")

    def _pack(self, t: torch.Tensor):
        if not self._wanted(t):
            return t
        self.offloaded_bytes += t.numel() * t.element_size()
        if t.device.type == "cpu":
            with scope("activation offload"):  # host RAM on any machine (a CPU profile leaves it out)
                host = t.clone()
            record = _Offloaded(host, None, t.device, len(self._packed))
        else:
            stream = side_stream(t.device)
            stream.wait_stream(torch.cuda.current_stream(t.device))  # t is fully written before we copy it
            with scope("activation offload"):
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            with torch.cuda.stream(stream):
                host.copy_(t, non_blocking=True)
                t.record_stream(stream)  # the allocator keeps t's memory until the copy has finished
                down = torch.cuda.Event()
                down.record(stream)
            record = _Offloaded(host, down, t.device, len(self._packed))
        self._packed.append(record)
        return record

    def _fetch(self, record: _Offloaded) -> None:
        """Issue the copy back of `record` (CUDA: on the side stream, after its copy down)."""
        self._packed[record.index] = None
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
