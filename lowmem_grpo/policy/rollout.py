"""Rollout: sample completions of prompts (`generate`) and decode them for the rewards.

`generate` returns a `Batch` (batch.py) of one completion per prompt given, cut at the first EOS;
it runs in micro-batches of generation.generation_micro_batch_size completions (which bound the KV
cache), in eval mode, with the fast sampling loop (sampling.py) where it can reproduce transformers'
generate() and generate() itself elsewhere. `decode_completions` gives the reward functions the
completions as text (or token ids, without a tokenizer), EOS excluded.
Design notes: docs/rollouts.md
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor, nn
from transformers import GenerationConfig as HFGenerationConfig

from ..config import GenerationConfig
from .batch import Batch, eos_mask, left_pad
from .packed_linear import use_packed
from .sampling import (compile_failed, decode_mode, falls_back, group_runs, sample, sampling_kwargs,
                       use_fast_sampling)

__all__ = ["Decoded", "decode_completions", "generate"]


@torch.no_grad()
def generate(model: nn.Module, prompts: list[list[int]], cfg: GenerationConfig, *, eos_ids: list[int], pad_id: int,
             device: torch.device, greedy: bool = False, micro_batch: Optional[int] = None,
             autocast_bf16: bool = False, max_new_tokens: Optional[int] = None) -> Batch:
    """One completion per entry of `prompts` (repeat a prompt G times to get G samples).

    generation.fast_rollout: runs of identical consecutive prompts (a prompt's G copies) are prefilled
    once, finished rows stop costing compute and their slots go to waiting samples (policy/sampling.py),
    with generate()'s distribution; generate() itself runs where sampling.py cannot match it (the reason
    is logged once). generation.compile_decode picks the decode step (`decode_mode`);
    generation.pack_decode_weights packs the Linear weights for it (`packed_linear.use_packed`).
    """
    micro_batch = micro_batch or cfg.generation_micro_batch_size
    max_new = max_new_tokens or cfg.max_completion_length
    if cfg.fast_rollout and use_fast_sampling(model, cfg, greedy):
        distinct, counts = group_runs(prompts)
        kw = dict(eos_ids=eos_ids, pad_id=pad_id, device=device, greedy=greedy, micro_batch=micro_batch,
                  autocast_bf16=autocast_bf16, max_new_tokens=max_new)
        decode = decode_mode(model, cfg, device)
        rows = min(micro_batch, len(prompts))  # a decode step's rows at most: what auto packing is measured at
        packed = use_packed(model, cfg.pack_decode_weights if decode != "compiled" else False, device, autocast_bf16,
                            rows)
        try:
            completion_ids = sample(model, distinct, counts, cfg, decode=decode, packed=packed, **kw)  # (N, C)
        except Exception as e:  # noqa: BLE001 - compile_decode: a step that fails to compile, capture, run
            if decode != "compiled" or not falls_back(e):
                raise
            compile_failed(e)
            completion_ids = sample(model, distinct, counts, cfg, decode="dynamic",
                                    packed=use_packed(model, cfg.pack_decode_weights, device, autocast_bf16, rows),
                                    **kw)
    else:
        was_training = model.training
        model.eval()  # checkpointing only acts in training mode, so the KV cache is used here
        gen_cfg = HFGenerationConfig(max_new_tokens=max_new, eos_token_id=eos_ids, pad_token_id=pad_id,
                                     use_cache=True, **sampling_kwargs(cfg, greedy))
        completions: list[Tensor] = []
        try:
            for start in range(0, len(prompts), micro_batch):
                ids, mask = left_pad(prompts[start:start + micro_batch], pad_id)
                ids, mask = ids.to(device), mask.to(device)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast_bf16):
                    out = model.generate(input_ids=ids, attention_mask=mask.long(), generation_config=gen_cfg)
                completions.append(out[:, ids.shape[1]:].cpu())  # (n, <= max_new)
        finally:
            model.train(was_training)
        width = max(max(c.shape[1] for c in completions), 1)
        completion_ids = torch.cat([nn.functional.pad(c, (0, width - c.shape[1]), value=pad_id)
                                    for c in completions])
    prompt_ids, prompt_mask = left_pad(prompts, pad_id)
    completion_mask, is_truncated = eos_mask(completion_ids, eos_ids)
    completion_ids = completion_ids.masked_fill(~completion_mask, pad_id)
    return Batch(prompt_ids, prompt_mask, completion_ids, completion_mask, is_truncated)


@dataclass
class Decoded:
    """What reward functions see of a batch's completions (EOS excluded)."""

    keep: Tensor  # (N, C) bool: completion tokens other than EOS
    ids: list[list[int]]
    texts: list  # decoded strings, or the id lists when there is no tokenizer
    completions: list  # TRL convention: conversational prompts get [{"role": "assistant", "content": text}]


def decode_completions(batch: Batch, prompts: list, eos_ids: list[int], tokenizer) -> Decoded:
    """The completions of `batch` without padding and EOS, as token ids and as text (`tokenizer` None: ids)."""
    keep = batch.completion_mask & ~torch.isin(batch.completion_ids, torch.tensor(eos_ids))
    ids = [row[k].tolist() for row, k in zip(batch.completion_ids, keep)]
    texts = [i if tokenizer is None else tokenizer.decode(i, skip_special_tokens=True) for i in ids]
    completions = [[{"role": "assistant", "content": c}] if isinstance(p, list) and p and isinstance(p[0], dict)
                   else c for p, c in zip(prompts, texts)]
    return Decoded(keep, ids, texts, completions)
