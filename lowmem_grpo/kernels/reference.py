"""The spec of every fused op, in plain torch, written to read like the formulas.

Everything is computed in fp32 by default. `dtype=` recomputes in a lower precision: the tests use it
to set tolerances (a kernel in dtype D must be as close to the fp32 reference as the reference
computed in D is). Memory is not a concern here: these materialise the full [N, V] log-softmax.

Design notes: docs/kernels.md ("The spec")
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def token_logprobs(logits: Tensor, ids: Tensor, *, temperature: float = 1.0, return_entropy: bool = False,
                   dtype: torch.dtype = torch.float32):
    """logp = log_softmax(logits / T).gather(ids);  H = -sum_v p_v log p_v."""
    logprobs = torch.log_softmax(logits.to(dtype) / temperature, dim=-1)  # (..., V)
    logp = logprobs.gather(-1, ids.unsqueeze(-1)).squeeze(-1).float()
    if not return_entropy:
        return logp
    entropy = -(logprobs.exp() * logprobs).sum(-1).float()
    return logp, entropy


def _per_sequence(advantages: Tensor) -> Tensor:
    return advantages[:, None] if advantages.dim() == 1 else advantages


def grpo_token_loss(logits: Tensor, ids: Tensor, advantages: Tensor, *, mask: Optional[Tensor] = None,
                    old_logp: Optional[Tensor] = None, ref_logp: Optional[Tensor] = None, epsilon_low: float = 0.2,
                    epsilon_high: Optional[float] = None, beta: float = 0.0, temperature: float = 1.0,
                    dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
    """Per token: l = -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A) + beta k3."""
    logp = token_logprobs(logits, ids, temperature=temperature, dtype=dtype)
    return grpo_token_terms(logp, advantages, mask=mask, old_logp=old_logp, ref_logp=ref_logp,
                            epsilon_low=epsilon_low, epsilon_high=epsilon_high, beta=beta)


def grpo_token_terms(logp: Tensor, advantages: Tensor, *, mask: Optional[Tensor] = None,
                     old_logp: Optional[Tensor] = None, ref_logp: Optional[Tensor] = None, epsilon_low: float = 0.2,
                     epsilon_high: Optional[float] = None, beta: float = 0.0) -> dict[str, Tensor]:
    eps_high = epsilon_low if epsilon_high is None else epsilon_high
    A = _per_sequence(advantages).float()
    old = logp.detach() if old_logp is None else old_logp
    rho = torch.exp(logp - old)
    loss = -torch.min(rho * A, torch.clamp(rho, 1 - epsilon_low, 1 + eps_high) * A)
    if ref_logp is not None:
        kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1
    else:
        kl = torch.zeros_like(logp)
    loss = loss + beta * kl
    is_low = (rho < 1 - epsilon_low) & (A < 0)
    is_high = (rho > 1 + eps_high) & (A > 0)
    m = torch.ones_like(logp, dtype=torch.bool) if mask is None else mask.bool()
    return {
        "loss": loss * m, "logp": logp * m, "kl": kl * m,
        "is_clipped": (is_low | is_high) & m, "is_low_clipped": is_low & m, "is_high_clipped": is_high & m,
    }


def linear_token_logprobs(hidden: Tensor, weight: Tensor, ids: Tensor, *, bias: Optional[Tensor] = None,
                          temperature: float = 1.0, return_entropy: bool = False, dtype: torch.dtype = torch.float32):
    """The same as token_logprobs on logits = hidden @ weight.T + bias."""
    logits = hidden.to(dtype) @ weight.to(dtype).T
    if bias is not None:
        logits = logits + bias.to(dtype)
    return token_logprobs(logits, ids, temperature=temperature, return_entropy=return_entropy, dtype=dtype)


def linear_grpo_loss(hidden: Tensor, weight: Tensor, ids: Tensor, advantages: Tensor, *,
                     mask: Optional[Tensor] = None, old_logp: Optional[Tensor] = None,
                     ref_logp: Optional[Tensor] = None, bias: Optional[Tensor] = None, epsilon_low: float = 0.2,
                     epsilon_high: Optional[float] = None, beta: float = 0.0, temperature: float = 1.0,
                     loss_type: str = "dapo", importance_sampling_level: str = "token",
                     max_completion_length: Optional[int] = None, num_items_in_batch=None,
                     dtype: torch.dtype = torch.float32) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO loss of one micro-batch, reduced as TRL's loss_type says."""
    eps_high = epsilon_low if epsilon_high is None else epsilon_high
    m = torch.ones(ids.shape, device=ids.device) if mask is None else mask.float()  # (B, T)
    logp, entropy = linear_token_logprobs(hidden, weight, ids.masked_fill(m == 0, 0), bias=bias,
                                          temperature=temperature, return_entropy=True, dtype=dtype)
    A = _per_sequence(advantages).float()
    old = logp.detach() if old_logp is None else old_logp
    log_ratio = logp - old
    if importance_sampling_level == "sequence":  # GSPO: one ratio per sequence
        log_ratio = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0))[:, None]
    rho = torch.exp(log_ratio)
    per_token = -torch.min(rho * A, torch.clamp(rho, 1 - epsilon_low, 1 + eps_high) * A)
    kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1 if ref_logp is not None else torch.zeros_like(logp)
    per_token = per_token + beta * kl

    if loss_type == "grpo":
        loss = ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = (per_token * m).sum() / m.sum().clamp(min=1.0)
    elif loss_type == "dapo":
        loss = (per_token * m).sum() / (m.sum().clamp(min=1.0) if num_items_in_batch is None else num_items_in_batch)
    elif loss_type == "dr_grpo":
        loss = (per_token * m).sum() / (per_token.shape[0] * (max_completion_length or ids.shape[1]))
    else:
        raise ValueError(loss_type)

    def masked_mean(x):
        return (x.float() * m).sum() / m.sum().clamp(min=1.0)

    is_low = ((rho < 1 - epsilon_low) & (A < 0)).expand_as(m)
    is_high = ((rho > 1 + eps_high) & (A > 0)).expand_as(m)
    metrics = {
        "kl": masked_mean(kl.detach()), "entropy": masked_mean(entropy.detach()),
        "clip_ratio": masked_mean(is_low | is_high), "clip_ratio_low": masked_mean(is_low),
        "clip_ratio_high": masked_mean(is_high),
    }
    return loss, metrics
