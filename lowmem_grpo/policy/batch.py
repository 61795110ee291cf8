"""`Batch`: the completions of one generation batch, and the helpers that build one.

A generation batch is held as one left-padded prompt tensor and one right-padded completion tensor:

    prompt_ids      (N, P)  left padding, prompt_mask marks real tokens
    completion_ids  (N, C)  completion_mask is 1 up to and including the first EOS, 0 after it

so `cat(prompt, completion)` is a causal sequence whose positions P-1 .. P+C-2 predict the
completion tokens. Row i of a batch of G samples per prompt belongs to prompt i // G.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import torch
from torch import Tensor

from ..transfers import count


@dataclass
class Batch:
    """Completions of one generation batch (rows are completions; row i belongs to prompt i // G)."""

    prompt_ids: Tensor  # (N, P) long, left-padded
    prompt_mask: Tensor  # (N, P) bool
    completion_ids: Tensor  # (N, C) long, right-padded
    completion_mask: Tensor  # (N, C) bool: tokens that get a loss
    is_truncated: Tensor  # (N,) bool: hit max_completion_length without EOS
    advantages: Optional[Tensor] = None  # (N,) fp32
    old_logp: Optional[Tensor] = None  # (N, C) fp32, when the policy moves while this batch is in use
    ref_logp: Optional[Tensor] = None  # (N, C) fp32, when beta > 0
    sampling_logp: Optional[Tensor] = None  # (N, C) fp32: the sampling engine's own (generation.engine=vllm)
    is_weight: Optional[Tensor] = None  # (N, C) fp32: the importance-sampling correction's token weights

    def __len__(self) -> int:
        return self.completion_ids.shape[0]

    def rows(self, start: int, stop: int) -> "Batch":
        """Rows [start, stop), trimmed to the columns they use (less padding, less compute)."""
        sl = {f.name: (None if getattr(self, f.name) is None else getattr(self, f.name)[start:stop])
              for f in fields(self)}
        p_keep = sl["prompt_mask"].any(0).nonzero()
        p0 = int(p_keep[0]) if len(p_keep) else sl["prompt_mask"].shape[1] - 1  # left padding to drop
        c_keep = sl["completion_mask"].any(0).nonzero()
        c1 = int(c_keep[-1]) + 1 if len(c_keep) else 1  # right padding to drop
        for name in ("prompt_ids", "prompt_mask"):
            sl[name] = sl[name][:, p0:]
        for name in ("completion_ids", "completion_mask", "old_logp", "ref_logp", "sampling_logp", "is_weight"):
            if sl[name] is not None:
                sl[name] = sl[name][:, :c1]
        return Batch(**sl)

    def select(self, keep: Tensor) -> "Batch":
        """The rows where `keep` (N,) bool is True, trimmed like rows()."""
        index = keep.nonzero().squeeze(1)
        picked = Batch(**{f.name: (None if getattr(self, f.name) is None else getattr(self, f.name)[index])
                          for f in fields(self)})
        return picked.rows(0, len(index))

    def to(self, device: torch.device) -> "Batch":
        """The batch on `device` (from the host: counted as a transfer, "batches", on a CPU device too)."""
        tensors = [t for t in (getattr(self, f.name) for f in fields(self)) if t is not None]
        count("batches", "h2d", sum(t.numel() * t.element_size() for t in tensors))
        return Batch(**{f.name: (None if getattr(self, f.name) is None else getattr(self, f.name).to(device))
                        for f in fields(self)})

    def state_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """(ids, mask), each (N, max_len), padded on the left."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.bool)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s):] = True
    return ids, mask


def eos_mask(completion_ids: Tensor, eos_ids: list[int]) -> tuple[Tensor, Tensor]:
    """(mask, is_truncated): mask keeps tokens up to and including the first EOS. (N, C), (N,)."""
    is_eos = torch.isin(completion_ids, torch.tensor(eos_ids, device=completion_ids.device))
    C = completion_ids.shape[1]
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1), torch.full_like(is_eos[:, 0], C, dtype=torch.long))
    mask = torch.arange(C, device=completion_ids.device)[None, :] <= first[:, None]
    return mask, ~is_eos.any(1)
