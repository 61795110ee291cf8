"""Rollout: sample completions with `generate`, cut them at EOS, and the no-grad log-prob passes.

A generation batch is held as one left-padded prompt tensor and one right-padded completion tensor:

    prompt_ids      (N, P)  left padding, prompt_mask marks real tokens
    completion_ids  (N, C)  completion_mask is 1 up to and including the first EOS, 0 after it

so `cat(prompt, completion)` is a causal sequence whose positions P-1 .. P+C-2 predict the
completion tokens. Generation runs in micro-batches (KV cache bounded by
generation.generation_micro_batch_size completions), in eval mode (no checkpointing, cache on).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional, Union

import torch
from torch import Tensor, nn

from ..config import GenerationConfig
from ..kernels import linear_token_logprobs
from .model import Head, hidden_states
from .packing import packed_completion_hidden, should_pack


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
        for name in ("completion_ids", "completion_mask", "old_logp", "ref_logp"):
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


def sampling_kwargs(cfg: GenerationConfig, greedy: bool = False) -> dict:
    if greedy:
        return dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    # Every knob is set explicitly: generate() fills values left as None from the model's own
    # generation_config.json (Qwen2.5-Instruct's sets top_k, top_p and a repetition penalty), which
    # would silently change the sampling distribution from the one configured. 0 means "off".
    return dict(do_sample=True, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                min_p=0.0 if cfg.min_p is None else cfg.min_p, repetition_penalty=cfg.repetition_penalty)


@torch.no_grad()
def generate(model: nn.Module, prompts: list[list[int]], cfg: GenerationConfig, *, eos_ids: list[int], pad_id: int,
             device: torch.device, greedy: bool = False, micro_batch: Optional[int] = None,
             autocast_bf16: bool = False, max_new_tokens: Optional[int] = None) -> Batch:
    """One completion per entry of `prompts` (repeat a prompt G times to get G samples).

    generation.fast_rollout: runs of identical consecutive prompts (a prompt's G copies) are prefilled
    once, finished rows stop costing compute and their slots go to waiting samples (policy/sampling.py);
    same distribution as generate(),
    which is used where sampling.py cannot match it (the reason is logged once). generation.compile_decode
    picks its decode step (`decode_mode`).
    """
    from transformers import GenerationConfig as HFGenerationConfig

    from .sampling import (compile_failed, decode_mode, falls_back, group_runs, sample,  # (sampling.py
                           use_fast_sampling)  # imports this module)
    micro_batch = micro_batch or cfg.generation_micro_batch_size
    max_new = max_new_tokens or cfg.max_completion_length
    if cfg.fast_rollout and use_fast_sampling(model, cfg, greedy):
        distinct, counts = group_runs(prompts)
        kw = dict(eos_ids=eos_ids, pad_id=pad_id, device=device, greedy=greedy, micro_batch=micro_batch,
                  autocast_bf16=autocast_bf16, max_new_tokens=max_new)
        decode = decode_mode(model, cfg, device)
        try:
            completion_ids = sample(model, distinct, counts, cfg, decode=decode, **kw)  # (N, C)
        except Exception as e:  # noqa: BLE001 - compile_decode: a step that fails to compile, capture, run
            if decode != "compiled" or not falls_back(e):
                raise
            compile_failed(e)
            completion_ids = sample(model, distinct, counts, cfg, decode="dynamic", **kw)
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
    keep = batch.completion_mask & ~torch.isin(batch.completion_ids, torch.tensor(eos_ids))
    ids = [row[k].tolist() for row, k in zip(batch.completion_ids, keep)]
    texts = [i if tokenizer is None else tokenizer.decode(i, skip_special_tokens=True) for i in ids]
    completions = [[{"role": "assistant", "content": c}] if isinstance(p, list) and p and isinstance(p[0], dict)
                   else c for p, c in zip(prompts, texts)]
    return Decoded(keep, ids, texts, completions)


def completion_hidden(head: Head, batch: Batch, pack: Union[bool, str] = False) -> Tensor:
    """Hidden states at the positions that predict the completion tokens: (B, C, H).

    `pack`: run each prompt once for its completions in this batch (policy/packing.py); same values.
    "auto": where that does less work (packing.packing_pays).
    """
    if should_pack(pack, batch, head.decoder):
        return packed_completion_hidden(head.decoder, batch)
    input_ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1)  # (B, P + C)
    attention = torch.cat([batch.prompt_mask, batch.completion_mask], 1)
    hidden = hidden_states(head, input_ids, attention)  # (B, P + C, H)
    P, C = batch.prompt_ids.shape[1], batch.completion_ids.shape[1]
    return hidden[:, P - 1:P + C - 1]


@torch.no_grad()
def token_logprobs(head: Head, batch: Batch, *, temperature: float, micro_batch: int, device: torch.device,
                   autocast_bf16: bool = False, pack: Union[bool, str] = False) -> Tensor:
    """log pi(completion token) for every completion of `batch`: (N, C) fp32 on the CPU, 0 on padding.

    Runs in micro-batches through the fused head, so no (tokens, V) tensor exists here either;
    `pack` runs each prompt once per micro-batch (see completion_hidden).
    """
    out = torch.zeros(batch.completion_ids.shape, dtype=torch.float32)
    for start in range(0, len(batch), micro_batch):
        mb = batch.rows(start, start + micro_batch).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast_bf16):
            hidden = completion_hidden(head, mb, pack)  # (b, c, H)
            ids = mb.completion_ids.masked_fill(~mb.completion_mask, 0)
            logp = linear_token_logprobs(hidden, head.weight, ids, bias=head.bias, temperature=temperature)
        c = mb.completion_ids.shape[1]
        out[start:start + len(mb), :c] = (logp * mb.completion_mask).float().cpu()
    return out
