"""The reference model (beta > 0), kept off the GPU, and its log-probs.

`Reference` holds a frozen copy in CPU RAM and computes reference log-probs of a `Batch`, (N, C) fp32
on the CPU, 0 on padding, in one of two modes (train.reference_compute): "cpu" runs the whole forward
on the CPU; "stream" runs it on the training device, copying each decoder layer there just before it
runs (one ahead, on a side stream) and the output head one vocabulary slice at a time, so the device
holds about two layers and one head slice. On CUDA the streamed weights sit in one pinned block
(`pinned_copies`, host_arena.py). The stream mode runs unchanged on a CPU-only machine.
Design notes: docs/rollouts.md
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import Tensor, nn

from ..host_arena import HostArena
from ..kernels.linear import default_chunk_size
from ..kernels.logprobs import finalize_stats, logits_stats, new_stats
from .batch import Batch
from .model import build_head, position_ids_for
from .packing import Packing, packed_completion_hidden, should_pack


def pinned_copies(params: list[nn.Parameter]) -> HostArena:
    """Move `params` into one block of pinned host memory of exactly their size (host_arena.py; per-tensor
    `pin_memory()` rounds each up to a power of two). The block is pinned once filled: each old tensor
    is freed as it is copied, so the host never holds two copies of the model."""
    arena = HostArena([(p.shape, p.dtype) for p in params])
    for p in params:
        p.data = arena.take(p.shape, p.dtype).copy_(p.data)
    arena.pin()
    return arena


class _LayerStreamer:
    """Forward hooks that give each decoder layer device copies of its weights just in time."""

    def __init__(self, layers: nn.ModuleList, device: torch.device):
        self.device = device
        self.host = [[(p, p.data) for p in layer.parameters()] for layer in layers]
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.ready: dict[int, tuple[list[Tensor], object]] = {}
        self.copies = 0  # layer copies started (a test checks the hooks ran)
        for i, layer in enumerate(layers):
            if any(True for _ in layer.buffers()):
                raise NotImplementedError(f"decoder layer {i} has buffers; streaming handles parameters only")
            layer.register_forward_pre_hook(functools.partial(self._before, i))
            layer.register_forward_hook(functools.partial(self._after, i))

    def _fetch(self, i: int) -> None:
        if i in self.ready or i >= len(self.host):
            return
        ctx = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        with ctx:
            copies = [h.to(self.device, non_blocking=True) for _, h in self.host[i]]
            event = torch.cuda.Event() if self.stream is not None else None
            if event is not None:
                event.record(self.stream)
        self.ready[i] = (copies, event)
        self.copies += 1

    def _before(self, i: int, module, args):
        self._fetch(i)
        copies, event = self.ready.pop(i)
        if event is not None:  # compute waits for this layer's copy, and owns the memory from here on
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for t in copies:
                t.record_stream(current)
        for (p, _), t in zip(self.host[i], copies):
            p.data = t
        self._fetch(i + 1)  # the next layer's copy overlaps this layer's compute

    def _after(self, i: int, module, args, output):
        for p, h in self.host[i]:
            p.data = h  # the device copy is freed once the compute stream is done with it


class Reference:
    """A frozen reference model in CPU RAM that produces reference log-probs on demand."""

    def __init__(self, model: nn.Module, device: torch.device, mode: str):
        if mode not in ("cpu", "stream"):
            raise ValueError(f"reference mode must be cpu or stream, got {mode!r}")
        self.model = model.eval().requires_grad_(False)
        self.head = build_head(model)
        self.mode = mode
        self.device = device if mode == "stream" else torch.device("cpu")
        self.streamer = None
        self.arena = None  # the pinned block of the weights (streamed on CUDA)
        if mode == "stream":
            decoder = self.head.decoder
            if not isinstance(getattr(decoder, "layers", None), nn.ModuleList):
                raise NotImplementedError(f"{type(decoder).__name__} has no .layers list to stream; "
                                          "use train.reference_compute=cpu")
            if self.device.type == "cuda":  # asynchronous host-to-device copies need pinned memory
                self.arena = pinned_copies(list(model.parameters()))
            for name, child in decoder.named_children():
                if name not in ("layers", "embed_tokens"):
                    child.to(self.device)  # final norm, rotary tables: a few KiB
            self.streamer = _LayerStreamer(decoder.layers, self.device)

    @torch.no_grad()
    def logprobs(self, batch: Batch, *, temperature: float, micro_batch: int, autocast_bf16: bool = False,
                 pack: Packing = Packing.OFF) -> Tensor:
        """log pi_ref(completion token): (N, C) fp32 on the CPU, 0 on padding. `pack`: each prompt runs
        once per micro-batch (policy/packing.py)."""
        out = torch.zeros(batch.completion_ids.shape, dtype=torch.float32)
        for start in range(0, len(batch), micro_batch):
            mb = batch.rows(start, start + micro_batch)
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=autocast_bf16):
                hidden = self._completion_hidden(mb, pack)  # (b, c, H) on self.device
                ids = mb.completion_ids.masked_fill(~mb.completion_mask, 0).to(self.device)
                logp = self._head_logprobs(hidden.reshape(-1, hidden.shape[-1]), ids.reshape(-1), temperature)
            c = mb.completion_ids.shape[1]
            out[start:start + len(mb), :c] = logp.view(len(mb), c).float().cpu() * mb.completion_mask
        return out

    def _completion_hidden(self, mb: Batch, pack: Packing = Packing.OFF) -> Tensor:
        if should_pack(pack, mb, self.head.decoder):  # embeddings looked up on the CPU, like below
            return packed_completion_hidden(self.head.decoder, mb, device=self.device, embed_on_cpu=True)
        input_ids = torch.cat([mb.prompt_ids, mb.completion_ids], 1)  # (b, P + C), on the CPU
        attention = torch.cat([mb.prompt_mask, mb.completion_mask], 1)
        decoder = self.head.decoder
        embeds = decoder.get_input_embeddings()(input_ids)  # the lookup runs where the table lives: CPU
        hidden = decoder(inputs_embeds=embeds.to(self.device), attention_mask=attention.to(self.device),
                         position_ids=position_ids_for(attention).to(self.device), use_cache=False).last_hidden_state
        P, C = mb.prompt_ids.shape[1], mb.completion_ids.shape[1]
        return hidden[:, P - 1:P + C - 1]

    def _head_logprobs(self, hidden: Tensor, ids: Tensor, temperature: float) -> Tensor:
        """Fused-head log-probs with the (CPU-resident) head weight copied one vocabulary slice at a time."""
        weight, bias = self.head.weight, self.head.bias
        vocab = weight.shape[0]
        chunk = default_chunk_size(hidden.shape[0], vocab)
        stats = new_stats(hidden.shape[0], hidden.device)
        for i, v0 in enumerate(range(0, vocab, chunk)):
            v1 = min(v0 + chunk, vocab)
            w = weight[v0:v1].to(hidden.device, hidden.dtype, non_blocking=True)  # (chunk, H)
            logits = hidden @ w.t()  # (N, chunk)
            if bias is not None:
                logits = logits + bias[v0:v1].to(hidden.device, hidden.dtype)
            logits_stats(logits, ids, stats, col_offset=v0, inv_temp=1.0 / temperature, accumulate=i > 0)
        _, logp, _ = finalize_stats(stats)
        return logp
