"""Asynchronous CPU offload of the activations that gradient checkpointing keeps (the layer inputs).

With checkpointing, the only activations alive between forward and backward are each decoder layer's
input (B, T, H) (checkpoint's own hooks drop everything inside a layer) plus a few tensors outside
the layers. Inside `offload_activations()` every such saved tensor of 3+ dimensions and at least
`min_bytes` is copied to pinned host memory on a side CUDA stream, so the copy overlaps the next
layer's compute, and the device copy is released once the transfer is done. In backward it is copied
back when autograd unpacks it. Parameters and 2-D tensors (weights, their autocast copies) are never
moved. On a CPU-only machine it does nothing unless `copy_on_cpu` (tests: same hooks, real copies).
"""

from __future__ import annotations

import torch
from torch import nn


_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The copy stream of `device`, made on first use and reused by every pack of every context after
    it (the loss makes a context per micro-batch; a stream per pack would take the next stream of
    torch's pool each time)."""
    stream = _side_streams.get(device)
    if stream is None:
        stream = _side_streams[device] = torch.cuda.Stream(device)
    return stream


class offload_activations(torch.autograd.graph.saved_tensors_hooks):  # noqa: N801 (a context manager)
    def __init__(self, min_bytes: int = 1 << 20, copy_on_cpu: bool = False):
        self.min_bytes = min_bytes
        self.copy_on_cpu = copy_on_cpu
        self.offloaded_bytes = 0  # total moved to the host inside this context (a test checks it)
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
            return (t.clone(), None, t.device)
        stream = side_stream(t.device)
        stream.wait_stream(torch.cuda.current_stream(t.device))  # t is fully written before we copy it
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        with torch.cuda.stream(stream):
            host.copy_(t, non_blocking=True)
            t.record_stream(stream)  # the allocator keeps t's memory until the copy has finished
            event = torch.cuda.Event()
            event.record(stream)
        return (host, event, t.device)

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        host, event, device = packed
        if event is None:
            return host
        torch.cuda.current_stream(device).wait_event(event)  # never read a half-written host buffer
        return host.to(device, non_blocking=True)
