"""A drop-in for Liger-Kernel users: `FusedLinearGRPOLoss` takes `LigerFusedLinearGRPOLoss`'s constructor and
`forward` arguments (liger-kernel 0.8.x, by name and meaning) and returns the same structure, computed by
`linear_grpo_loss` (no (B, T, V) logits, the padding dropped before the head).

    loss_fn = FusedLinearGRPOLoss(beta=0.04, loss_type="dapo")   # was LigerFusedLinearGRPOLoss(...)
    loss, metrics = loss_fn(hidden, lm_head.weight, completion_ids, completion_mask, advantages,
                            ref_per_token_logps=ref, old_per_token_logps=old)
    # metrics: (kl, clip_ratio) when beta != 0, else (clip_ratio,): 0-dim masked token means, as Liger's

Supported: loss_type "grpo", "bnpo", "dr_grpo", "dapo"; importance_sampling_level "token" and "sequence"
(GSPO); reference log-probs given, or computed here from ref_input / ref_weight / ref_bias (no gradient)
as Liger does. Liger's other loss types and options are refused by name rather than computed differently;
`compiled` and `chunk_size` are accepted and have no effect.

Design notes: docs/kernels.md ("Liger-Kernel's interface")
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from .linear import linear_token_logprobs
from .linear_loss import linear_grpo_loss

SUPPORTED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
_LIGER_ONLY_LOSS_TYPES = ("cispo", "sapo", "luspo", "vespo")


class FusedLinearGRPOLoss(nn.Module):
    """`liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss`'s interface on lowmem-grpo's fused head."""

    def __init__(self, beta: float = 0.04, compiled: bool = True, use_ref_model: bool = True, chunk_size: int = 1,
                 epsilon_low: float = 0.2, epsilon_high: float = 0.2, loss_type: str = "dapo",
                 max_completion_length: Optional[int] = None, importance_sampling_level: str = "token",
                 sapo_temperature_pos: float = 1.0, sapo_temperature_neg: float = 1.05, temperature: float = 1.0,
                 delta: Optional[float] = None, use_bias_correction_kl: bool = False, vespo_k_pos: float = 2.0,
                 vespo_lambda_pos: float = 3.0, vespo_k_neg: float = 3.0, vespo_lambda_neg: float = 2.0):
        """Arguments as LigerFusedLinearGRPOLoss's; the SAPO / VESPO ones exist only for their loss types,
        which are refused here, so they are accepted and unused."""
        super().__init__()
        if loss_type not in SUPPORTED_LOSS_TYPES:
            which = "Liger's" if loss_type in _LIGER_ONLY_LOSS_TYPES else "an unknown"
            raise ValueError(f"loss_type={loss_type!r} is {which} loss type, not computed by lowmem-grpo's head; "
                             f"use one of {', '.join(SUPPORTED_LOSS_TYPES)} (or Liger's own module for it)")
        if importance_sampling_level not in ("token", "sequence"):
            raise ValueError(f"importance_sampling_level={importance_sampling_level!r}: use 'token' or 'sequence'")
        if delta is not None:
            raise ValueError(f"delta={delta} (INTELLECT-2's two-sided clip) is not supported; leave it None")
        if use_bias_correction_kl:
            raise ValueError("use_bias_correction_kl=True is not supported; leave it False")
        if loss_type == "dr_grpo" and max_completion_length is None:
            raise ValueError("loss_type='dr_grpo' divides by max_completion_length: pass max_completion_length=...")
        self.beta, self.compiled, self.use_ref_model, self.chunk_size = beta, compiled, use_ref_model, chunk_size
        self.epsilon_low, self.epsilon_high = epsilon_low, epsilon_high
        self.loss_type, self.max_completion_length = loss_type, max_completion_length
        self.importance_sampling_level, self.temperature = importance_sampling_level, temperature
        self.sapo_temperature_pos, self.sapo_temperature_neg = sapo_temperature_pos, sapo_temperature_neg
        self.delta, self.use_bias_correction_kl = delta, use_bias_correction_kl
        self.vespo_k_pos, self.vespo_lambda_pos = vespo_k_pos, vespo_lambda_pos
        self.vespo_k_neg, self.vespo_lambda_neg = vespo_k_neg, vespo_lambda_neg

    def forward(self, _input: Tensor, lin_weight: Tensor, selected_token_ids: Tensor, attention_mask: Tensor,
                advantages: Tensor, bias: Optional[Tensor] = None, ref_per_token_logps: Optional[Tensor] = None,
                old_per_token_logps: Optional[Tensor] = None, ref_input: Optional[Tensor] = None,
                ref_weight: Optional[Tensor] = None, ref_bias: Optional[Tensor] = None,
                vllm_is_ratio: Optional[Tensor] = None, num_items_in_batch=None) -> tuple[Tensor, tuple[Tensor, ...]]:
        """_input (B, T, H), lin_weight (V, H), selected_token_ids / attention_mask (B, T), advantages (B,).

        Returns (loss, metrics): metrics = (kl, clip_ratio) when beta != 0, else (clip_ratio,)."""
        if vllm_is_ratio is not None:
            raise ValueError("vllm_is_ratio (vLLM importance-sampling correction) is not supported; pass None")
        ref = ref_per_token_logps
        if self.beta != 0.0 and ref is None:
            if not self.use_ref_model or ref_input is None:
                raise ValueError(f"beta={self.beta} needs reference log-probs: pass ref_per_token_logps, or "
                                 "ref_input (and ref_weight) with use_ref_model=True")
            with torch.no_grad():  # Liger: the reference head from ref_input / ref_weight, no gradient
                ref = linear_token_logprobs(ref_input, lin_weight if ref_weight is None else ref_weight,
                                            selected_token_ids.masked_fill(attention_mask == 0, 0), bias=ref_bias,
                                            temperature=self.temperature)
        if self.loss_type == "dapo":
            num_items_in_batch = dapo_normalizer(attention_mask, num_items_in_batch)
        loss, metrics = linear_grpo_loss(
            _input, lin_weight, selected_token_ids, advantages, mask=attention_mask, old_logp=old_per_token_logps,
            ref_logp=ref if self.beta != 0.0 else None, bias=bias, epsilon_low=self.epsilon_low,
            epsilon_high=self.epsilon_high, beta=self.beta, temperature=self.temperature, loss_type=self.loss_type,
            importance_sampling_level=self.importance_sampling_level, max_completion_length=self.max_completion_length,
            num_items_in_batch=num_items_in_batch)
        extra = (metrics["kl"],) if self.beta != 0.0 else ()
        return loss, extra + (metrics["clip_ratio"],)


def dapo_normalizer(attention_mask: Tensor, num_items_in_batch=None):
    """Liger's per-process dapo denominator: num_items_in_batch / world_size, or without it the mask's tokens
    summed over processes / world_size, at least 1; None (this micro-batch's tokens) on one process."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    world_size = torch.distributed.get_world_size() if distributed else 1
    if num_items_in_batch is not None:
        return max(float(num_items_in_batch) / world_size, 1.0)
    if not distributed:
        return None
    total = attention_mask.to(torch.float32).sum()
    torch.distributed.all_reduce(total)
    return (total / world_size).clamp(min=1.0)
