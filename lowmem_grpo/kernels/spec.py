"""The spec of every fused op, in plain torch, written to read like the formulas.

Each function has its op's name and signature (plus `dtype=`): `spec.token_logprobs` is what
`kernels.token_logprobs` computes, `spec.grpo_token_terms` what `kernels.grpo_token_terms` computes.

Everything is computed in fp32 by default. `dtype=` recomputes in a lower precision: the tests use it
to set tolerances (a kernel in dtype D must be as close to the fp32 spec as the spec computed in D
is). Memory is not a concern here: these materialise the full [N, V] log-softmax.

Design notes: docs/kernels.md ("The spec")
"""

from __future__ import annotations

import math
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


def _sequence_shaped(ratio: Optional[Tensor]) -> Optional[Tensor]:
    """An importance-sampling ratio given as (B,) reads as one per sequence, (B, 1)."""
    return ratio[:, None] if ratio is not None and ratio.dim() == 1 else ratio


def vespo_phi(log_ratio: Tensor, advantages: Tensor, mask: Tensor, importance_sampling_ratio: Optional[Tensor] = None,
              *, k_pos: float = 2.0, lambda_pos: float = 3.0, k_neg: float = 3.0, lambda_neg: float = 2.0) -> Tensor:
    """VESPO's gamma weight of each sequence, phi(w) = exp(lambda) w^k exp(-lambda w) (phi(1) = 1), no gradient.

    w = prod_t exp(log_ratio_t) over the mask, times the product of the importance-sampling ratios given,
    both in log space clamped to [log 1e-8, 20]; k, lambda by the advantage's sign (A >= 0: the _pos pair)."""
    with torch.no_grad():
        floor = math.log(1e-8)
        log_w = (log_ratio.clamp(-20.0, 20.0) * mask).sum(-1, keepdim=True)  # (B, 1)
        if importance_sampling_ratio is not None:
            log_w = log_w + importance_sampling_ratio.log().clamp(floor, 20.0).sum(-1, keepdim=True)
        log_w = log_w.clamp(floor, 20.0)
        A = _per_sequence(advantages)
        k = torch.where(A >= 0, k_pos, k_neg)
        lam = torch.where(A >= 0, lambda_pos, lambda_neg).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * log_w.exp())
        return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def grpo_token_terms(logp: Tensor, advantages: Tensor, *, mask: Optional[Tensor] = None,
                     old_logp: Optional[Tensor] = None, ref_logp: Optional[Tensor] = None, epsilon_low: float = 0.2,
                     epsilon_high: Optional[float] = None, beta: float = 0.0, loss_type: str = "grpo",
                     importance_sampling_level: str = "token", delta: Optional[float] = None,
                     use_bias_correction_kl: bool = False, importance_sampling_ratio: Optional[Tensor] = None,
                     entropy_mask: Optional[Tensor] = None, sapo_temperature_pos: float = 1.0,
                     sapo_temperature_neg: float = 1.05, vespo_k_pos: float = 2.0, vespo_lambda_pos: float = 3.0,
                     vespo_k_neg: float = 3.0, vespo_lambda_neg: float = 2.0) -> dict[str, Tensor]:
    """The per-token policy loss of every loss_type, differentiable w.r.t. logp by autograd.

        rho  = exp(logp - old)   (sequence level: exp of the masked mean of logp - old, one per sequence)
        PPO-clip (grpo, bnpo, dapo, dr_grpo, luspo): -min(min(rho, delta) A, clip(rho, 1 - eps_low, 1 + eps_high) A)
        cispo: -sg[min(rho, eps_high)] A logp          sapo: -sigmoid(tau (rho - 1)) 4 / tau A  (tau by sign of A)
        vespo: -sg[phi] A logp                          (phi: vespo_phi)
        pg  *= entropy_mask * is_ratio (vespo folds is_ratio into phi);  kl = k3 (* rho if bias-corrected)
        loss = pg + beta kl
    """
    eps_high = epsilon_low if epsilon_high is None else epsilon_high
    m = torch.ones_like(logp) if mask is None else mask.float()
    A = _per_sequence(advantages).float()
    is_ratio = _sequence_shaped(importance_sampling_ratio)
    old = logp.detach() if old_logp is None else old_logp
    log_ratio = logp - old
    if importance_sampling_level == "sequence":
        log_weight = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0))[:, None]
    else:
        log_weight = log_ratio
    rho = torch.exp(log_weight)
    zeros = torch.zeros_like(rho * A, dtype=torch.bool)
    is_low, is_high = zeros, zeros
    if loss_type == "cispo":
        pg = -torch.clamp(rho, max=eps_high).detach() * A * logp
        is_high = (rho > eps_high) & (A > 0)
    elif loss_type == "sapo":
        tau = torch.where(A > 0, sapo_temperature_pos, sapo_temperature_neg)
        pg = -torch.sigmoid(tau * (rho - 1)) * 4 / tau * A
    elif loss_type == "vespo":
        phi = vespo_phi(log_ratio, A, m, is_ratio, k_pos=vespo_k_pos, lambda_pos=vespo_lambda_pos, k_neg=vespo_k_neg,
                        lambda_neg=vespo_lambda_neg)
        pg = -phi * A * logp
    else:
        clipped = torch.clamp(rho, 1 - epsilon_low, 1 + eps_high)
        unclipped = rho if delta is None else torch.clamp(rho, max=delta)
        pg = -torch.min(unclipped * A, clipped * A)
        is_low, is_high = (rho < 1 - epsilon_low) & (A < 0), (rho > 1 + eps_high) & (A > 0)
    if entropy_mask is not None:
        pg = pg * entropy_mask
    if is_ratio is not None and loss_type != "vespo":
        pg = pg * is_ratio
    if ref_logp is not None:
        kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1
        if use_bias_correction_kl:
            kl = kl * rho
    else:
        kl = torch.zeros_like(logp)
    loss = pg + beta * kl
    keep = m.bool()
    return {
        "loss": loss * m, "logp": logp * m, "kl": kl * m,
        "is_clipped": (is_low | is_high) & keep, "is_low_clipped": is_low & keep, "is_high_clipped": is_high & keep,
    }


def grpo_token_loss(logits: Tensor, ids: Tensor, advantages: Tensor, *, mask: Optional[Tensor] = None,
                    old_logp: Optional[Tensor] = None, ref_logp: Optional[Tensor] = None, epsilon_low: float = 0.2,
                    epsilon_high: Optional[float] = None, beta: float = 0.0, temperature: float = 1.0,
                    dtype: torch.dtype = torch.float32, **variant) -> dict[str, Tensor]:
    """grpo_token_terms on the log-probs of `ids` under logits / temperature."""
    logp = token_logprobs(logits, ids, temperature=temperature, dtype=dtype)
    return grpo_token_terms(logp, advantages, mask=mask, old_logp=old_logp, ref_logp=ref_logp,
                            epsilon_low=epsilon_low, epsilon_high=epsilon_high, beta=beta, **variant)


def linear_token_logprobs(hidden: Tensor, weight: Tensor, ids: Tensor, *, bias: Optional[Tensor] = None,
                          temperature: float = 1.0, return_entropy: bool = False, dtype: torch.dtype = torch.float32,
                          softcap: Optional[float] = None):
    """The same as token_logprobs on logits = hidden @ weight.T + bias, soft-capped to
    softcap * tanh(logits / softcap) when softcap is given (before the temperature, as Gemma 2's head)."""
    logits = hidden.to(dtype) @ weight.to(dtype).T
    if bias is not None:
        logits = logits + bias.to(dtype)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return token_logprobs(logits, ids, temperature=temperature, return_entropy=return_entropy, dtype=dtype)


def high_entropy_mask(entropy: Tensor, mask: Tensor, top_entropy_quantile: float) -> Tensor:
    """The tokens whose entropy is at least the (1 - q) quantile of the masked tokens' entropies."""
    kept = entropy[mask.bool()].float()
    if kept.numel() == 0:
        return torch.zeros_like(mask, dtype=torch.bool)
    threshold = torch.quantile(kept, 1 - top_entropy_quantile)
    return (entropy * mask >= threshold) & mask.bool()


def linear_grpo_loss(hidden: Tensor, weight: Tensor, ids: Tensor, advantages: Tensor, *,
                     mask: Optional[Tensor] = None, old_logp: Optional[Tensor] = None,
                     ref_logp: Optional[Tensor] = None, bias: Optional[Tensor] = None, epsilon_low: float = 0.2,
                     epsilon_high: Optional[float] = None, beta: float = 0.0, temperature: float = 1.0,
                     loss_type: str = "dapo", importance_sampling_level: str = "token",
                     max_completion_length: Optional[int] = None, num_items_in_batch=None,
                     top_entropy_quantile: float = 1.0, dtype: torch.dtype = torch.float32,
                     softcap: Optional[float] = None, **variant) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO loss of one micro-batch, reduced as TRL's loss_type says. `variant`: grpo_token_terms' options
    (delta, use_bias_correction_kl, importance_sampling_ratio, sapo_* and vespo_* settings)."""
    eps_high = epsilon_low if epsilon_high is None else epsilon_high
    m = torch.ones(ids.shape, device=ids.device) if mask is None else mask.float()  # (B, T)
    logp, entropy = linear_token_logprobs(hidden, weight, ids.masked_fill(m == 0, 0), bias=bias,
                                          temperature=temperature, return_entropy=True, dtype=dtype, softcap=softcap)
    entropy_mask = high_entropy_mask(entropy.detach(), m, top_entropy_quantile) if top_entropy_quantile < 1 else None
    terms = grpo_token_terms(logp, advantages, mask=m, old_logp=old_logp, ref_logp=ref_logp, epsilon_low=epsilon_low,
                             epsilon_high=eps_high, beta=beta, loss_type=loss_type, entropy_mask=entropy_mask,
                             importance_sampling_level=importance_sampling_level, **variant)
    per_token, kl = terms["loss"], terms["kl"]
    tokens = m.sum().clamp(min=1.0)
    if loss_type in ("grpo", "sapo"):
        loss = (per_token.sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = per_token.sum() / tokens
    elif loss_type in ("dapo", "cispo", "vespo"):
        loss = per_token.sum() / (tokens if num_items_in_batch is None else num_items_in_batch)
    elif loss_type == "dr_grpo":
        loss = per_token.sum() / (per_token.shape[0] * (max_completion_length or ids.shape[1]))
    elif loss_type == "luspo":
        loss = per_token.sum(-1).mean()
    else:
        raise ValueError(loss_type)

    def masked_mean(x):
        return (x.float() * m).sum() / tokens

    metrics = {
        "kl": masked_mean(kl.detach()), "entropy": masked_mean(entropy.detach()),
        "clip_ratio": masked_mean(terms["is_clipped"]), "clip_ratio_low": masked_mean(terms["is_low_clipped"]),
        "clip_ratio_high": masked_mean(terms["is_high_clipped"]),
    }
    if loss_type == "vespo":
        old = logp.detach() if old_logp is None else old_logp
        phi = vespo_phi(logp.detach() - old, advantages, m, _sequence_shaped(variant.get("importance_sampling_ratio")),
                        **{k[len("vespo_"):]: v for k, v in variant.items() if k.startswith("vespo_")})
        metrics["vespo_phi_mean"] = phi[:, 0].mean()
    if entropy_mask is not None:
        metrics["entropy_mask_ratio"] = masked_mean(entropy_mask)
    return loss, metrics
