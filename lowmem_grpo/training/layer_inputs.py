"""The layer inputs a layer-major backward recomputes from (training/step_modes.py, LayerMajorStep): kept
on the device, or in host RAM with model.offload_activations, each brought back one ahead of its use.
On CUDA the host copies go into one page-locked block (activation_offload.HostBlock) that grows to the
largest step's inputs: the planner's "activations (offloaded)". The bytes are counted as transfers
("activations") wherever a GPU would copy them.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..phases import scope
from ..transfers import count
from .activation_offload import MIN_BYTES, HostBlock


class LayerInputStore:
    """Each (layer, micro-batch) input the backward recomputes from: kept where it is, or, with `offload`,
    copied to host RAM (pinned, on a side stream on CUDA) and brought back one ahead of its use. On a CPU
    device the copies are made only with `copy_on_cpu`; the bytes are counted either way ("activations")."""

    def __init__(self, offload: bool, copy_on_cpu: bool = False):
        self.offload, self.copy_on_cpu = offload, copy_on_cpu
        self._kept: dict[tuple[int, int], Tensor] = {}
        self._host: dict[tuple[int, int], tuple[Tensor, torch.device, Optional[torch.cuda.Event]]] = {}
        self._back: dict[tuple[int, int], tuple[Tensor, Optional[torch.cuda.Event]]] = {}
        self._uncopied: set[tuple[int, int]] = set()  # kept on a CPU device where a GPU would copy (counted)
        self._stream: Optional[torch.cuda.Stream] = None
        self.block = HostBlock(pinned=True)  # used on CUDA only

    def put(self, key: tuple[int, int], hidden: Tensor) -> None:
        hidden = hidden.detach()
        if not self.offload or hidden.numel() * hidden.element_size() < MIN_BYTES:  # as activation offload
            self._kept[key] = hidden
            return
        count("activations", "d2h", hidden.numel() * hidden.element_size())
        if hidden.device.type == "cuda":
            stream = self._side(hidden.device)
            host = self.block.take(hidden.shape, hidden.dtype)
            if host is None:  # past the block (the first step): plain memory, the copy then waits
                host = torch.empty(hidden.shape, dtype=hidden.dtype)
            stream.wait_stream(torch.cuda.current_stream(hidden.device))
            with torch.cuda.stream(stream):
                host.copy_(hidden, non_blocking=True)
                hidden.record_stream(stream)
                down = torch.cuda.Event()
                down.record(stream)
            self._host[key] = (host, hidden.device, down)
        elif self.copy_on_cpu:  # (a memory profile on the CPU: its host copies are counted as host RAM)
            with scope("activation offload"):
                self._host[key] = (hidden.clone(), hidden.device, None)
        else:
            self._kept[key] = hidden
            self._uncopied.add(key)

    def prefetch(self, key: tuple[int, int]) -> None:
        """Start bringing `key`'s input back (a no-op for one kept on the device or already on its way)."""
        if key not in self._host or key in self._back:
            return
        host, device, down = self._host.pop(key)
        count("activations", "h2d", host.numel() * host.element_size())
        if device.type != "cuda":
            self._back[key] = (host.clone(), None)  # the device's copy, as a GPU makes one
            return
        stream = self._side(device)
        back = torch.empty(host.shape, dtype=host.dtype, device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):  # after its copy down: the same stream, in order
            back.copy_(host, non_blocking=True)
            back.record_stream(stream)
            up = torch.cuda.Event()
            up.record(stream)
        self._back[key] = (back, up)

    def take(self, key: tuple[int, int]) -> Tensor:
        """`key`'s input on its device (then forgotten here)."""
        if key in self._kept:
            if key in self._uncopied:  # counted as a GPU would move it back
                self._uncopied.discard(key)
                count("activations", "h2d", self._kept[key].numel() * self._kept[key].element_size())
            return self._kept.pop(key)
        self.prefetch(key)
        back, up = self._back.pop(key)
        if up is not None:
            torch.cuda.current_stream(back.device).wait_event(up)
        return back

    def _side(self, device: torch.device) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def clear(self) -> None:
        """Forget every input (a new step; the last one's were all taken, or its backward failed)."""
        self._kept.clear(), self._host.clear(), self._back.clear(), self._uncopied.clear()
        if self._stream is not None:
            self._stream.synchronize()  # no copy still reads or writes the block
            self.block.begin()
