"""The reference model (beta > 0), kept off the GPU, and its log-probs.

`Reference` holds a frozen copy in CPU RAM and computes reference log-probs of a `Batch`, (N, C) fp32
on the CPU, 0 on padding, in one of two modes (train.reference_compute): "cpu" runs the whole forward
on the CPU, a micro-batch at a time; "stream" runs it on the training device layer-major: each decoder
layer is copied there once (one ahead, on a side stream) and runs every micro-batch of the batch, then
the output head goes up one vocabulary slice at a time, each slice applied to every row, so the weights
cross once per batch and the device holds about two layers, one head slice and every row's hidden states.
On CUDA the streamed weights sit in one pinned block (policy/streaming.py, shared with streamed reward
models). The stream mode runs unchanged on a CPU-only machine.
Design notes: docs/rollouts.md
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor, nn

from ..kernels.linear import default_chunk_size
from ..kernels.logprobs import finalize_stats, logits_stats, new_stats
from .batch import Batch
from ..transfers import count
from .layer_major import DecoderLayers, layer_major_outputs
from .model import build_head, position_ids_for
from .packing import Packing, packed_completion_hidden, should_pack
from .streaming import pinned_copies, stream_decoder  # noqa: F401 (pinned_copies: also imported from here)


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
            self.arena, self.streamer = stream_decoder(model, self.head.decoder, self.device,
                                                       "use train.reference_compute=cpu")
            self.layers = DecoderLayers(self.head.decoder.layers)

    @torch.no_grad()
    def logprobs(self, batch: Batch, *, temperature: float, micro_batch: int, autocast_bf16: bool = False,
                 pack: Packing = Packing.OFF, stream_rows: Optional[int] = None) -> Tensor:
        """log pi_ref(completion token): (N, C) fp32 on the CPU, 0 on padding. `pack`: each prompt runs
        once per micro-batch (policy/packing.py). Streamed, the micro-batches go through the layers and the
        head together (module docstring), `stream_rows` rows at a time (whole micro-batches, at least one;
        None: all); the values are those of one micro-batch at a time."""
        out = torch.zeros(batch.completion_ids.shape, dtype=torch.float32)
        starts = list(range(0, len(batch), micro_batch))
        together = (1 if self.streamer is None else len(starts) if stream_rows is None
                    else max(1, stream_rows // micro_batch))
        groups = [starts[i:i + together] for i in range(0, len(starts), together)]
        for group in groups:
            mbs = [batch.rows(start, start + micro_batch) for start in group]
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=autocast_bf16):
                hidden = self._hidden_layer_major(mbs, pack) if self.streamer is not None else [
                    self._completion_hidden(mbs[0], pack)]  # (b, c, H) each, on self.device
                ids = [mb.completion_ids.masked_fill(~mb.completion_mask, 0).to(self.device) for mb in mbs]
                logp = self._head_logprobs(torch.cat([h.reshape(-1, h.shape[-1]) for h in hidden]),
                                           torch.cat([i.reshape(-1) for i in ids]), temperature)
            for start, mb, part in zip(group, mbs, logp.split([i.numel() for i in ids])):
                c = mb.completion_ids.shape[1]
                if self.streamer is not None:
                    count("log-probs", "d2h", part.numel() * part.element_size())
                out[start:start + len(mb), :c] = part.view(len(mb), c).float().cpu() * mb.completion_mask
        return out

    def _hidden_layer_major(self, mbs: list[Batch], pack: Packing) -> list[Tensor]:
        """Each micro-batch's completion hidden states, every layer streamed once for all of them."""
        return layer_major_outputs(self.layers, [functools.partial(self._completion_hidden, mb, pack) for mb in mbs],
                                   around=self.streamer.resident)

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
        bias32 = None if bias is None else bias.to(hidden.device, torch.float32)  # added in fp32, as the head does
        vocab = weight.shape[0]
        chunk = default_chunk_size(hidden.shape[0], vocab, hidden.device.type)
        stats = new_stats(hidden.shape[0], hidden.device)
        for i, v0 in enumerate(range(0, vocab, chunk)):
            v1 = min(v0 + chunk, vocab)
            if self.streamer is not None:  # (cpu mode: nothing crosses)
                count("reference head", "h2d", (v1 - v0) * weight.shape[1] * weight.element_size())
            w = weight[v0:v1].to(hidden.device, hidden.dtype, non_blocking=True)  # (chunk, H)
            logits = hidden @ w.t()  # (N, chunk)
            logits_stats(logits, ids, stats, col_offset=v0, inv_temp=1.0 / temperature, accumulate=i > 0,
                         bias=bias32, softcap=self.head.softcap or 0.0)
        _, logp, _ = finalize_stats(stats)
        return logp
