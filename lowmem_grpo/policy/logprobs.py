"""The policy's log-probs of a batch's completion tokens: what the loss and the old-policy pass compute.

`completion_hidden` runs the decoder over `cat(prompt, completion)` (or the packed layout, packing.py)
and returns the hidden states at the positions that predict the completion tokens, (B, C, H): the loss
applies the fused head to them with gradients. `completion_logprobs` is the no-grad pass over a whole
batch, (N, C) fp32 on the CPU, 0 on padding. No (tokens, V) logits tensor exists in either.
The reference model's pass (frozen weights off the GPU) is reference.py. The op both use on hidden
states is `kernels.linear_token_logprobs`; `token_logprobs` here is a deprecated name of completion_logprobs.
"""

from __future__ import annotations

import functools
import warnings
from typing import Optional

import torch
from torch import Tensor

from ..kernels import linear_token_logprobs
from ..transfers import count
from .batch import Batch
from .layer_major import decoder_layers, layer_major_outputs
from .model import Head, hidden_states
from .packing import Packing, packed_completion_hidden, should_pack
from .streaming import LayerStreamer


def completion_hidden(head: Head, batch: Batch, pack: Packing = Packing.OFF) -> Tensor:
    """Hidden states at the positions that predict the completion tokens: (B, C, H).

    `pack`: whether to run each prompt once for its completions in this batch (Packing, packing.py);
    the values are the same either way.
    """
    if should_pack(pack, batch, head.decoder):
        return packed_completion_hidden(head.decoder, batch)
    input_ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1)  # (B, P + C)
    attention = torch.cat([batch.prompt_mask, batch.completion_mask], 1)
    hidden = hidden_states(head, input_ids, attention)  # (B, P + C, H)
    P, C = batch.prompt_ids.shape[1], batch.completion_ids.shape[1]
    return hidden[:, P - 1:P + C - 1]


@torch.no_grad()
def completion_logprobs(head: Head, batch: Batch, *, temperature: float, micro_batch: int, device: torch.device,
                        autocast_bf16: bool = False, pack: Packing = Packing.OFF,
                        streamer: Optional[LayerStreamer] = None, stream_rows: Optional[int] = None) -> Tensor:
    """log pi(completion token) for every completion of `batch`: (N, C) fp32 on the CPU, 0 on padding.

    Runs in micro-batches through the fused head, so no (tokens, V) tensor exists here either;
    `pack` runs each prompt once per micro-batch (see completion_hidden). With `streamer` (the decoder's
    layers streamed from host RAM: model.offload_weights) the micro-batches go through each layer together,
    `stream_rows` rows at a time (whole micro-batches, at least one; None: all), so a layer crosses once for
    them (layer_major.py); the values are those of one micro-batch at a time.
    """
    out = torch.zeros(batch.completion_ids.shape, dtype=torch.float32)
    starts = list(range(0, len(batch), micro_batch))
    together = (1 if streamer is None else len(starts) if stream_rows is None
                else max(1, stream_rows // micro_batch))
    for g in range(0, len(starts), together):
        group = starts[g:g + together]
        mbs = [batch.rows(start, start + micro_batch).to(device) for start in group]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast_bf16):
            if streamer is None:
                hiddens = [completion_hidden(head, mbs[0], pack)]  # (b, c, H)
            else:
                hiddens = layer_major_outputs(decoder_layers(head.decoder),
                                              [functools.partial(completion_hidden, head, mb, pack) for mb in mbs],
                                              around=streamer.resident)
            logps = []
            for mb, hidden in zip(mbs, hiddens):
                ids = mb.completion_ids.masked_fill(~mb.completion_mask, 0)
                logps.append(linear_token_logprobs(hidden, head.weight, ids, bias=head.bias,
                                                   temperature=temperature, softcap=head.softcap))
        for start, mb, logp in zip(group, mbs, logps):
            c = mb.completion_ids.shape[1]
            count("log-probs", "d2h", logp.numel() * 4)
            out[start:start + len(mb), :c] = (logp * mb.completion_mask).float().cpu()
    return out


def __getattr__(name: str) -> object:
    """`token_logprobs`, the old name of completion_logprobs, warns (DeprecationWarning) and gives it."""
    if name == "token_logprobs":
        warnings.warn("lowmem_grpo.policy.logprobs.token_logprobs is deprecated: use completion_logprobs "
                      "(the same function); kernels.token_logprobs is the op on logits", DeprecationWarning,
                      stacklevel=2)
        return completion_logprobs
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
