"""A frozen decoder kept in host RAM and run on the device a layer at a time (the reference model and
streamed reward models).

`stream_decoder(model, decoder, device)` leaves the weights of `decoder.layers` and of the embedding
where they are (host RAM; one pinned block on CUDA, `pinned_copies`), moves the decoder's other children
(final norm, rotary tables: a few KiB) to `device`, and installs forward hooks that copy each layer's
weights to the device just before it runs, the next layer's copy overlapping this layer's compute (a
side stream on CUDA). The device then holds about two layers' weights. Callers look the embeddings up
on the host and pass `inputs_embeds`. A layer-major pass (policy/layer_major.py) keeps a layer on the
device across its calls with `LayerStreamer.resident(i)`: one copy for every micro-batch. On a CPU-only
machine the copies are no-ops and the hooks run as they would on a GPU, which is how the tests exercise
this path.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator, Optional

import torch
from torch import Tensor, nn

from ..host_arena import HostArena
from ..transfers import count


def pinned_copies(params: list[nn.Parameter]) -> HostArena:
    """Move `params` into one block of pinned host memory of exactly their size (host_arena.py; per-tensor
    `pin_memory()` rounds each up to a power of two). The block is pinned once filled: each old tensor
    is freed as it is copied, so the host never holds two copies of the model."""
    arena = HostArena([(p.shape, p.dtype) for p in params])
    for p in params:
        p.data = arena.take(p.shape, p.dtype).copy_(p.data)
    arena.pin()
    return arena


class LayerStreamer:
    """Forward hooks that give each decoder layer device copies of its weights just in time."""

    def __init__(self, layers: nn.ModuleList, device: torch.device, kind: str = "reference layers"):
        self.device, self.kind = device, kind  # kind: what its copies are counted as (transfers.py)
        self.host = [[(p, p.data) for p in layer.parameters()] for layer in layers]
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.ready: dict[int, tuple[list[Tensor], object]] = {}
        self.copies = 0  # layer copies started (a test checks the hooks ran)
        self._installed: Optional[int] = None  # the layer whose device copies its parameters hold
        self._resident: Optional[int] = None  # the layer kept on the device across calls (`resident`)
        for i, layer in enumerate(layers):
            if any(True for _ in layer.buffers()):
                raise NotImplementedError(f"decoder layer {i} has buffers; streaming handles parameters only")
            layer.register_forward_pre_hook(functools.partial(self._before, i))
            layer.register_forward_hook(functools.partial(self._after, i))

    def _fetch(self, i: int) -> None:
        if i in self.ready or i >= len(self.host):
            return
        count(self.kind, "h2d", sum(h.numel() * h.element_size() for _, h in self.host[i]))
        ctx = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        with ctx:
            copies = [h.to(self.device, non_blocking=True) for _, h in self.host[i]]
            event = torch.cuda.Event() if self.stream is not None else None
            if event is not None:
                event.record(self.stream)
        self.ready[i] = (copies, event)
        self.copies += 1

    @contextlib.contextmanager
    def resident(self, i: int) -> Iterator[None]:
        """Inside, layer i's weights stay on the device across its calls: fetched at the first (or already on
        their way), released at the end."""
        self._resident = i
        try:
            yield
        finally:
            self._resident = None
            if self._installed == i:
                self._release(i)

    def _before(self, i: int, module, args):
        if self._installed == i:  # resident, and installed by an earlier call
            return
        self._fetch(i)
        copies, event = self.ready.pop(i)
        if event is not None:  # compute waits for this layer's copy, and owns the memory from here on
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for t in copies:
                t.record_stream(current)
        for (p, _), t in zip(self.host[i], copies):
            p.data = t
        self._installed = i
        self._fetch(i + 1)  # the next layer's copy overlaps this layer's compute

    def _after(self, i: int, module, args, output):
        if self._resident != i:
            self._release(i)

    def _release(self, i: int) -> None:
        for p, h in self.host[i]:
            p.data = h  # the device copy is freed once the compute stream is done with it
        self._installed = None


def stream_decoder(model: nn.Module, decoder: nn.Module, device: torch.device,
                   fix: str, kind: str = "reference layers") -> tuple[Optional[HostArena], LayerStreamer]:
    """Set `decoder` (a part of the frozen `model`) up to stream its layers to `device` (module docstring).
    Returns (the pinned block of all of `model`'s weights on CUDA, else None; the streamer). `fix` ends
    the error for a decoder without a `.layers` list (the setting that avoids streaming)."""
    if not isinstance(getattr(decoder, "layers", None), nn.ModuleList):
        raise NotImplementedError(f"{type(decoder).__name__} has no .layers list to stream; {fix}")
    arena = pinned_copies(list(model.parameters())) if device.type == "cuda" else None
    for name, child in decoder.named_children():
        if name not in ("layers", "embed_tokens"):
            child.to(device)  # final norm, rotary tables: a few KiB
    return arena, LayerStreamer(decoder.layers, device, kind)
