"""Decoder layers kept in host RAM and run on the device a layer at a time: the reference model, streamed
reward models, and the trained policy's own layers under model.offload_weights.

`stream_decoder(model, decoder, device)` leaves the weights of `decoder.layers` and of the embedding
where they are (host RAM; one pinned block on CUDA, `pinned_copies`), moves the decoder's other children
(final norm, rotary tables: a few KiB) to `device`, and installs forward hooks that copy each layer's
weights to the device just before it runs, the next layer's copy overlapping this layer's compute (a
side stream on CUDA). The device then holds about two layers' weights. Callers look the embeddings up
on the host and pass `inputs_embeds`. A layer-major pass (policy/layer_major.py) keeps a layer (or a
group) on the device across its calls with `LayerStreamer.resident`: one copy for every micro-batch.
`stream_trained_layers` does the same for the policy, whose host copies are the offloaded optimizer's;
`look_up_on_host` keeps its untied embedding table there too, looked up where it is.
On a CPU-only machine the copies are no-ops (real ones with `copy_on_cpu`) and the hooks run as they
would on a GPU, which is how the tests exercise this path.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterator, Optional, Sequence

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
    """Forward hooks that give each decoder layer device copies of its weights just in time.

    `wait(i)`: called before layer i's weights are read for a copy (the trained policy's: until the host
    update of those weights is done). `copy_on_cpu`: on a CPU device, make real copies too (the tests then
    see what a GPU run would: a layer's compute never reads the host tensors)."""

    def __init__(self, layers: nn.ModuleList, device: torch.device, kind: str = "reference layers",
                 wait: Optional[Callable[[int], None]] = None, copy_on_cpu: bool = False):
        self.device, self.kind = device, kind  # kind: what its copies are counted as (transfers.py)
        self.wait, self.copy_on_cpu = wait, copy_on_cpu
        self.host = [[(p, p.data) for p in layer.parameters()] for layer in layers]
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.ready: dict[int, tuple[list[Tensor], object]] = {}
        self.copies = 0  # layer copies started (a test checks the hooks ran)
        self._installed: set[int] = set()  # the layers whose device copies their parameters hold
        self._resident: list[int] = []  # the layers kept on the device across calls (`resident`)
        self._following: list[int] = []  # and the ones fetched while they compute
        for i, layer in enumerate(layers):
            if any(True for _ in layer.buffers()):
                raise NotImplementedError(f"decoder layer {i} has buffers; streaming handles parameters only")
            layer.register_forward_pre_hook(functools.partial(self._before, i))
            layer.register_forward_hook(functools.partial(self._after, i))

    def layer_bytes(self, i: int) -> int:
        return sum(h.numel() * h.element_size() for _, h in self.host[i])

    def _fetch(self, i: int) -> None:
        if i in self.ready or i in self._installed or not 0 <= i < len(self.host):
            return
        if self.wait is not None:
            self.wait(i)
        count(self.kind, "h2d", self.layer_bytes(i))
        ctx = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        with ctx:
            if self.copy_on_cpu and self.device.type == "cpu":
                copies = [h.clone() for _, h in self.host[i]]
            else:
                copies = [h.to(self.device, non_blocking=True) for _, h in self.host[i]]
            event = torch.cuda.Event() if self.stream is not None else None
            if event is not None:
                event.record(self.stream)
        self.ready[i] = (copies, event)
        self.copies += 1

    @contextlib.contextmanager
    def resident(self, layers: int | Sequence[int], following: Optional[Sequence[int]] = None) -> Iterator[None]:
        """Inside, the weights of `layers` (one index or several) stay on the device across their calls:
        fetched at the first call (or already on their way), released at the end. While they compute, the
        rest of them and then `following` are fetched (default: the layer after the last one)."""
        layers = [layers] if isinstance(layers, int) else list(layers)
        self._resident = layers
        self._following = [layers[-1] + 1] if following is None else list(following)
        try:
            yield
        finally:
            self._resident, self._following = [], []
            for i in layers:
                if i in self._installed:
                    self._release(i)

    def forget(self) -> None:
        """Drop copies fetched ahead and not used (before the host weights change: they would be stale)."""
        self.ready.clear()

    def _before(self, i: int, module, args):
        if i in self._installed:  # resident, and installed by an earlier call
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
        self._installed.add(i)
        if i in self._resident:  # the copies overlap this layer's compute
            for j in self._resident[self._resident.index(i) + 1:] + self._following:
                self._fetch(j)
        else:
            self._fetch(i + 1)

    def _after(self, i: int, module, args, output):
        if i not in self._resident:
            self._release(i)

    def _release(self, i: int) -> None:
        for p, h in self.host[i]:
            p.data = h  # the device copy is freed once the compute stream is done with it
        self._installed.discard(i)


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


def move_all_but(model: nn.Module, kept_modules: Sequence[nn.Module], device: torch.device) -> None:
    """`model.to(device)` for everything except the tensors of `kept_modules`, which stay where they are (host
    RAM): model.offload_weights, where the whole model would not fit the device."""
    kept = {id(t) for m in kept_modules for t in [*m.parameters(), *m.buffers()]}
    with torch.no_grad():
        for module in model.modules():
            for _, p in list(module.named_parameters(recurse=False)):
                if id(p) not in kept:
                    p.data = p.data.to(device)
            for name, b in list(module.named_buffers(recurse=False)):
                if id(b) not in kept:
                    module._buffers[name] = b.to(device)


def host_table(model: nn.Module) -> Optional[nn.Embedding]:
    """model.offload_weights: the input embedding whose table stays in host RAM with the layers, or None: it
    must be an nn.Embedding and not tied to the output head (the loss head needs a tied table on the device)."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if not isinstance(embedding, nn.Embedding) or (head is not None and head.weight is embedding.weight):
        return None
    return embedding


class HostLookup:
    """Mixed into an embedding's class by `look_up_on_host`: the lookup runs where the table is (host RAM) and
    its rows go to the ids' device. A call that gives the module a table of its own (torch.func.functional_call:
    LookupRows' rows) runs the class's lookup as it is."""

    def forward(self, ids: Tensor, *args, **kwargs) -> Tensor:
        if id(self.weight) != self.host_table_id:
            return super().forward(ids, *args, **kwargs)
        self.before_read()
        return _rows_up(super().forward(ids.to(self.weight.device), *args, **kwargs), ids.device)


def _rows_up(rows: Tensor, device: torch.device) -> Tensor:
    """Rows read from a table in host RAM, to `device` (counted where a GPU run would copy them)."""
    count("embedding rows", "h2d", rows.numel() * rows.element_size())
    return rows.to(device)


@functools.lru_cache(maxsize=None)
def _host_lookup_class(cls: type) -> type:
    return type(f"HostLookup{cls.__name__}", (HostLookup, cls), {})


def table_rows(embedding: nn.Module, ids: Tensor) -> Tensor:
    """Rows `ids` of `embedding`'s table (detached), on the ids' device: from host RAM, counted, where
    `look_up_on_host` keeps the table there."""
    table = embedding.weight.detach()
    if not isinstance(embedding, HostLookup):
        return table[ids]
    embedding.before_read()
    return _rows_up(table[ids.to(table.device)], ids.device)


def look_up_on_host(optimizer, embedding: nn.Embedding) -> None:
    """model.offload_weights: `embedding`'s table (`host_table`) becomes the offloaded optimizer's host copy
    (`OffloadedOptimizer.keep_on_host`) and is looked up there, once its update is done; only the rows read
    cross to the device (the embedding's gradient comes back as those rows: training/lookup_rows.py)."""
    optimizer.keep_on_host([embedding.weight])
    weight = embedding.weight
    embedding.__class__ = _host_lookup_class(type(embedding))
    embedding.host_table_id = id(weight)
    embedding.before_read = lambda: optimizer.wait_for_update([weight])


def stream_trained_layers(optimizer, layers: nn.ModuleList, device: torch.device,
                          copy_on_cpu: bool = False) -> LayerStreamer:
    """model.offload_weights: the trained layers' weights become the offloaded optimizer's host copies
    (`OffloadedOptimizer.keep_on_host`, pinned on CUDA) and stream to `device` a layer at a time, each copy
    made once the layer's update is done. `copy_on_cpu`: LayerStreamer's."""
    params = [list(layer.parameters()) for layer in layers]
    optimizer.keep_on_host([p for group in params for p in group])
    return LayerStreamer(layers, device, kind="policy layers", copy_on_cpu=copy_on_cpu,
                         wait=lambda i: optimizer.wait_for_update(params[i]))
