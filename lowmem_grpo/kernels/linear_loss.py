"""The GRPO loss straight from hidden states: fused lm_head log-probs + per-token loss + reduction.

    linear_grpo_loss(hidden (B, T, H), weight (V, H), ids (B, T), advantages (B,) | (B, T), ...)
        -> (loss 0-dim, metrics dict)

Padding tokens (mask given) are dropped before the head (their rows are gathered away), so they
cost no GEMM work. Gathering them needs the number of kept tokens on the host: a caller that counted
them before the batch went to the GPU passes it (`mask_count`) and the gather is sync-free
(`torch.nonzero_static`); otherwise it is counted here, one device sync per call. The per-token
loss is op 2 (closed-form gradient) at the token level; GSPO's sequence-level ratio needs a
reduction over each sequence first, so that variant is plain autograd on (B, T) vectors, which are
tiny next to the head.
"""

from __future__ import annotations

from enum import Enum
from typing import Optional, Type, TypeVar

import torch
from torch import Tensor

from ._backend import debug_checks
from ._checks import _tracing, check_ids, check_mask, check_shape
from .grpo_loss import (Variant, _expand_advantages, grpo_token_terms, per_token_weights, sequence_level_terms,
                        term_params, vespo_coef)
from .linear import check_linear_args, linear_token_logprobs


class LossType(str, Enum):
    """How per-token losses are reduced over one micro-batch (TRL's `loss_type`)."""

    GRPO = "grpo"  # mean over sequences of each sequence's token mean
    BNPO = "bnpo"  # token mean over this micro-batch
    DAPO = "dapo"  # token sum / num_items_in_batch (the caller's global token count; default: this micro-batch's)
    DR_GRPO = "dr_grpo"  # token sum / (num_sequences * max_completion_length)
    CISPO = "cispo"  # clipped, detached ratio times logp; normalised as dapo
    SAPO = "sapo"  # a sigmoid gate in place of the clip; normalised as grpo
    LUSPO = "luspo"  # PPO-clip; each sequence's token sum, mean over sequences (its length weighs it)
    VESPO = "vespo"  # a detached per-sequence gamma weight times logp; normalised as dapo


class ISLevel(str, Enum):
    """Where the importance ratio lives (TRL's `importance_sampling_level`)."""

    TOKEN = "token"  # rho_t = exp(logp_t - old_t)
    SEQUENCE = "sequence"  # GSPO: rho_i = exp(mean_t (logp_t - old_t)) for every token of sequence i


E = TypeVar("E", bound=Enum)


def parse_enum(cls: Type[E], value, name: str) -> E:
    try:
        return cls(value)
    except ValueError:
        valid = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"unknown {name} {value!r}; valid: {valid}") from None


def _masked_mean(x: Tensor, maskf: Tensor) -> Tensor:
    return (x * maskf).sum() / maskf.sum().clamp(min=1.0)


def reduce_loss(per_token: Tensor, maskf: Tensor, loss_type: LossType, *, max_completion_length: Optional[int] = None,
                num_items_in_batch=None) -> Tensor:
    """Reduce (B, T) per-token losses over mask (B, T) float as `loss_type` says."""
    total = per_token * maskf
    if loss_type in (LossType.GRPO, LossType.SAPO):
        return (total.sum(-1) / maskf.sum(-1).clamp(min=1.0)).mean()
    if loss_type is LossType.BNPO:
        return total.sum() / maskf.sum().clamp(min=1.0)
    if loss_type is LossType.LUSPO:
        return total.sum(-1).mean()
    if loss_type in (LossType.DAPO, LossType.CISPO, LossType.VESPO):
        denominator = maskf.sum().clamp(min=1.0) if num_items_in_batch is None else num_items_in_batch
        return total.sum() / denominator
    length = per_token.shape[1] if max_completion_length is None else max_completion_length
    return total.sum() / (per_token.shape[0] * length)


def kept_rows(mask: Tensor, mask_count: Optional[int] = None) -> Tensor:
    """(n_kept,) int64: the flat indices where the bool `mask` is True, in order (`mask.nonzero()`).

    `mask_count`, the number of them when the caller knows it on the host, makes it sync-free on CUDA
    (`nonzero()` reads the count back from the device, a pipeline drain). A wrong count would gather
    the wrong rows: it is checked on the CPU, and on CUDA in debug mode (LOWMEM_GRPO_DEBUG=1) only."""
    flat = mask.reshape(-1)
    if mask_count is None:
        return flat.nonzero().squeeze(1)  # a sync on CUDA, for callers that do not know the count
    if (mask.device.type == "cpu" or debug_checks()) and not _tracing(mask):
        actual = int(flat.sum())
        if actual != mask_count:
            raise ValueError(f"mask_count={mask_count} but the mask has {actual} True entries: pass the mask's "
                             "own count (e.g. int(mask.sum()) before moving it to the GPU), or leave it None")
    return torch.nonzero_static(flat, size=mask_count).squeeze(1)


def linear_grpo_loss(
    hidden: Tensor, weight: Tensor, ids: Tensor, advantages: Tensor, *,
    mask: Optional[Tensor] = None, old_logp: Optional[Tensor] = None, ref_logp: Optional[Tensor] = None,
    bias: Optional[Tensor] = None, epsilon_low: float = 0.2, epsilon_high: Optional[float] = None,
    beta: float = 0.0, temperature: float = 1.0, loss_type: str = "dapo", importance_sampling_level: str = "token",
    max_completion_length: Optional[int] = None, num_items_in_batch=None, chunk_size: Optional[int] = None,
    mask_count: Optional[int] = None, delta: Optional[float] = None, use_bias_correction_kl: bool = False,
    importance_sampling_ratio: Optional[Tensor] = None, top_entropy_quantile: float = 1.0,
    sapo_temperature_pos: float = 1.0, sapo_temperature_neg: float = 1.05, vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0, vespo_k_neg: float = 3.0, vespo_lambda_neg: float = 2.0,
    softcap: Optional[float] = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO loss of one micro-batch from the decoder's last hidden states; no (B*T, V) tensor exists.

    Args:
        hidden: (B, T, H) hidden states of the completion positions (the ones predicting `ids`).
        weight: (V, H) lm_head weight (tied embeddings: the embedding matrix; it gets both gradients).
        ids: (B, T) completion token ids.
        advantages: (B,) or (B, T).
        mask: (B, T) completion mask, bool or 0/1 (default: all tokens).
        old_logp / ref_logp: (B, T) sampling-policy / reference log-probs (see grpo_token_loss).
        bias: optional (V,) lm_head bias.
        epsilon_low, epsilon_high, beta, temperature: as in grpo_token_loss.
        loss_type: one of LossType (TRL's names and normalisers; the per-token terms: grpo_loss.policy_terms).
        importance_sampling_level: "token" | "sequence" (GSPO).
        delta: caps the unclipped ratio of the PPO-clip term (INTELLECT-2's two-sided clip); None: no cap.
        use_bias_correction_kl: multiply k3 by the importance ratio (DeepSeek-V3.2), differentiated.
        importance_sampling_ratio: (B,), (B, 1) or (B, T) weights of the policy term for rollouts sampled by
            another engine (TRL's truncated / masked IS ratio; vespo folds it into phi).
        top_entropy_quantile: keep the policy term on the top-q tokens by entropy only (quantile over this
            call's masked tokens); 1.0 keeps all.
        sapo_temperature_pos / _neg, vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg: TRL's.
        max_completion_length: dr_grpo's per-sequence denominator (default T).
        num_items_in_batch: dapo's denominator, a token count over more than this micro-batch, so that
            the losses of accumulated micro-batches sum to one token mean (default: this micro-batch's
            masked tokens). lowmem-grpo's trainer passes the masked tokens of the optimizer step's
            micro-batches; TRL passes the generation batch's count scaled to one step (docs/trl.md).
        chunk_size: vocabulary slice width of the fused head (see linear_token_logprobs).
        softcap: soft-caps the logits, softcap * tanh(logits / softcap), before the temperature (Gemma 2's
            final_logit_softcapping); None: no cap.
        mask_count: the number of True entries of `mask`, if known on the host (the trainer counts them
            before the micro-batch goes to the GPU): the padding is then dropped without a device sync.

    Returns:
        (loss, metrics): loss is 0-dim fp32, differentiable w.r.t. hidden, weight and bias. metrics
        holds detached 0-dim tensors: kl and entropy (masked token means), clip_ratio,
        clip_ratio_low, clip_ratio_high (fractions of masked tokens clipped; cispo's clip is `high`);
        vespo_phi_mean (vespo: phi's mean over sequences) and entropy_mask_ratio (top_entropy_quantile < 1).
    """
    loss_type = parse_enum(LossType, loss_type, "loss_type")
    level = parse_enum(ISLevel, importance_sampling_level, "importance_sampling_level")
    p = term_params(loss_type.value, epsilon_low, epsilon_high, beta, ref_logp, delta=delta,
                    use_bias_correction_kl=use_bias_correction_kl, sapo_temperature_pos=sapo_temperature_pos,
                    sapo_temperature_neg=sapo_temperature_neg)
    if not 0.0 <= top_entropy_quantile <= 1.0:
        raise ValueError(f"top_entropy_quantile must be in [0, 1], got {top_entropy_quantile}")
    hidden = check_linear_args(hidden, weight, bias)
    if hidden.dim() != 3:
        raise ValueError(f"hidden must have shape (B, T, H), got {tuple(hidden.shape)}")
    B, T, H = hidden.shape
    dev = hidden.device
    mask = check_mask(mask, (B, T), dev)
    flat_ids = check_ids(ids, (B, T), weight.shape[0], dev, mask=mask)
    adv = _expand_advantages(advantages, B, T, dev)
    for name, t in (("old_logp", old_logp), ("ref_logp", ref_logp)):
        check_shape(t, (B, T), name, dev)
    if num_items_in_batch is not None and not num_items_in_batch > 0:
        raise ValueError(f"num_items_in_batch must be > 0, got {num_items_in_batch}")
    if max_completion_length is not None and not max_completion_length > 0:
        raise ValueError(f"max_completion_length must be > 0, got {max_completion_length}")

    if mask is None:
        mask = torch.ones(B, T, dtype=torch.bool, device=dev)
        logp, entropy = linear_token_logprobs(hidden, weight, flat_ids.view(B, T), bias=bias, temperature=temperature,
                                              return_entropy=True, chunk_size=chunk_size,
                                              softcap=softcap)  # (B, T) each
        entropy = entropy.detach()
    else:  # the head runs on the unmasked tokens only
        keep = kept_rows(mask, mask_count)  # (n_kept,)
        kept_logp, kept_entropy = linear_token_logprobs(
            hidden.reshape(B * T, H).index_select(0, keep), weight, flat_ids.index_select(0, keep), bias=bias,
            temperature=temperature, return_entropy=True, chunk_size=chunk_size, softcap=softcap)
        zeros = torch.zeros(B * T, dtype=torch.float32, device=dev)
        logp = zeros.index_copy(0, keep, kept_logp).view(B, T)  # (B, T), 0 on padding
        entropy = zeros.index_copy(0, keep, kept_entropy.detach()).view(B, T)
    old = None if old_logp is None else old_logp.to(torch.float32)
    ref = None if ref_logp is None else ref_logp.to(torch.float32)
    maskf = mask.to(torch.float32)
    entropy_mask = high_entropy_mask(entropy, mask, top_entropy_quantile) if top_entropy_quantile < 1.0 else None
    coef = None
    if p.variant == Variant.VESPO:
        log_ratio = logp.detach() - (logp.detach() if old is None else old)
        coef = vespo_coef(log_ratio, adv, maskf, importance_sampling_ratio, k_pos=vespo_k_pos,
                          lambda_pos=vespo_lambda_pos, k_neg=vespo_k_neg, lambda_neg=vespo_lambda_neg)
    variant = dict(loss_type=loss_type.value, delta=delta, use_bias_correction_kl=use_bias_correction_kl,
                   sapo_temperature_pos=sapo_temperature_pos, sapo_temperature_neg=sapo_temperature_neg,
                   vespo_k_pos=vespo_k_pos, vespo_lambda_pos=vespo_lambda_pos, vespo_k_neg=vespo_k_neg,
                   vespo_lambda_neg=vespo_lambda_neg)
    if level is ISLevel.TOKEN:
        per_token, kl, code = grpo_token_terms(logp, adv, mask=mask, old_logp=old, ref_logp=ref,
                                               epsilon_low=epsilon_low, epsilon_high=epsilon_high, beta=beta,
                                               importance_sampling_ratio=importance_sampling_ratio,
                                               entropy_mask=entropy_mask, **variant)
    else:
        weight = per_token_weights((B, T), dev, importance_sampling_ratio, entropy_mask, p.variant)
        per_token, kl, code = sequence_level_terms(logp, adv, maskf, old, ref, weight, coef, p)
    loss = reduce_loss(per_token, maskf, loss_type, max_completion_length=max_completion_length,
                       num_items_in_batch=num_items_in_batch)
    metrics = {
        "kl": _masked_mean(kl.detach(), maskf),
        "entropy": _masked_mean(entropy, maskf),
        "clip_ratio": _masked_mean((code != 0).float(), maskf),
        "clip_ratio_low": _masked_mean((code == 1).float(), maskf),
        "clip_ratio_high": _masked_mean((code == 2).float(), maskf),
    }
    if coef is not None:
        metrics["vespo_phi_mean"] = coef[:, 0].mean() if coef.numel() else coef.sum()
    if entropy_mask is not None:
        metrics["entropy_mask_ratio"] = _masked_mean(entropy_mask.float(), maskf)
    return loss, metrics


def high_entropy_mask(entropy: Tensor, mask: Tensor, top_entropy_quantile: float) -> Tensor:
    """(B, T) bool: the masked tokens whose entropy is at least the (1 - q) quantile of the masked tokens'
    entropies (TRL's top_entropy_quantile, over this call's tokens); no token when none is masked in."""
    kept = entropy[mask]
    if kept.numel() == 0:
        return torch.zeros_like(mask)
    threshold = torch.quantile(kept.float(), 1.0 - top_entropy_quantile)
    return (entropy * mask >= threshold) & mask
