"""The GRPO loss straight from hidden states: fused lm_head log-probs + per-token loss + reduction.

    linear_grpo_loss(hidden (B, T, H), weight (V, H), ids (B, T), advantages (B,) | (B, T), ...)
        -> (loss 0-dim, metrics dict)

Padding tokens (mask given) are dropped before the head (their rows are gathered away), so they
cost no GEMM work. Gathering them needs the number of kept tokens on the host: a caller that counted
them before the batch went to the GPU passes it (`mask_count`) and the gather is sync-free
(`torch.nonzero_static`); otherwise it is counted here, one device sync per call. The per-token
loss is grpo_token_terms (closed-form gradient) at the token level; GSPO's sequence-level ratio needs a
reduction over each sequence first, so that variant is plain autograd on (B, T) vectors, which are
tiny next to the head.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ._backend import debug_checks
from ._checks import _tracing, check_ids, check_mask, check_shape
from .grpo_loss import Variant, _expand_advantages, per_token_weights, sequence_level_terms, token_terms, vespo_coef
from .linear import check_linear_args, linear_token_logprobs
from .loss_settings import SETTING_NAMES, GRPOLossSettings, ISLevel, LossType, parse_enum, settings_of  # noqa: F401


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
    bias: Optional[Tensor] = None, importance_sampling_ratio: Optional[Tensor] = None, num_items_in_batch=None,
    mask_count: Optional[int] = None, chunk_size: Optional[int] = None, softcap: Optional[float] = None,
    settings: Optional[GRPOLossSettings] = None, **keywords,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO loss of one micro-batch from the decoder's last hidden states; no (B*T, V) tensor exists.

    The loss's settings come as one GRPOLossSettings (`settings=`, checked once where it was built: the
    form for a caller that computes the loss many times) or as its fields by keyword (loss_type default
    "dapo" here; one GRPOLossSettings is built per call); not both.

    Args:
        hidden: (B, T, H) hidden states of the completion positions (the ones predicting `ids`).
        weight: (V, H) lm_head weight (tied embeddings: the embedding matrix; it gets both gradients).
        ids: (B, T) completion token ids.
        advantages: (B,) or (B, T).
        mask: (B, T) completion mask, bool or 0/1 (default: all tokens).
        old_logp / ref_logp: (B, T) sampling-policy / reference log-probs (see grpo_token_loss).
        bias: optional (V,) lm_head bias.
        importance_sampling_ratio: (B,), (B, 1) or (B, T) weights of the policy term for rollouts sampled by
            another engine (TRL's truncated / masked IS ratio; vespo folds it into phi).
        num_items_in_batch: dapo's denominator, a token count over more than this micro-batch, so that
            the losses of accumulated micro-batches sum to one token mean (default: this micro-batch's
            masked tokens). lowmem-grpo's trainer passes the masked tokens of the optimizer step's
            micro-batches; TRL passes the generation batch's count scaled to one step (docs/trl.md).
        chunk_size: vocabulary slice width of the fused head (see linear_token_logprobs).
        softcap: soft-caps the logits, softcap * tanh(logits / softcap), before the temperature (Gemma 2's
            final_logit_softcapping; a property of the head, like bias); None: no cap.
        mask_count: the number of True entries of `mask`, if known on the host (the trainer counts them
            before the micro-batch goes to the GPU): the padding is then dropped without a device sync.
        settings / keywords: loss_type (one of LossType: TRL's names and normalisers; the per-token terms:
            grpo_loss.policy_terms), importance_sampling_level ("token" | "sequence": GSPO), epsilon_low,
            epsilon_high, beta, temperature (as in grpo_token_loss), delta (caps the unclipped ratio of the
            PPO-clip term: INTELLECT-2's two-sided clip), use_bias_correction_kl (k3 times the importance
            ratio, DeepSeek-V3.2), top_entropy_quantile (the policy term on the top-q tokens by entropy only,
            the quantile over this call's masked tokens; 1.0 keeps all), sapo_temperature_pos / _neg,
            vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg (TRL's), max_completion_length
            (dr_grpo's per-sequence denominator; default T). See GRPOLossSettings.

    Returns:
        (loss, metrics): loss is 0-dim fp32, differentiable w.r.t. hidden, weight and bias. metrics
        holds detached 0-dim tensors: kl and entropy (masked token means), clip_ratio,
        clip_ratio_low, clip_ratio_high (fractions of masked tokens clipped; cispo's clip is `high`);
        vespo_phi_mean (vespo: phi's mean over sequences) and entropy_mask_ratio (top_entropy_quantile < 1).
    """
    s = settings_of(settings, keywords, "linear_grpo_loss", SETTING_NAMES, loss_type="dapo")
    s.check_reference(ref_logp)
    p = s.terms
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

    if mask is None:
        mask = torch.ones(B, T, dtype=torch.bool, device=dev)
        logp, entropy = linear_token_logprobs(hidden, weight, flat_ids.view(B, T), bias=bias,
                                              temperature=s.temperature, return_entropy=True, chunk_size=chunk_size,
                                              softcap=softcap)  # (B, T) each
        entropy = entropy.detach()
    else:  # the head runs on the unmasked tokens only
        keep = kept_rows(mask, mask_count)  # (n_kept,)
        kept_logp, kept_entropy = linear_token_logprobs(
            hidden.reshape(B * T, H).index_select(0, keep), weight, flat_ids.index_select(0, keep), bias=bias,
            temperature=s.temperature, return_entropy=True, chunk_size=chunk_size, softcap=softcap)
        zeros = torch.zeros(B * T, dtype=torch.float32, device=dev)
        logp = zeros.index_copy(0, keep, kept_logp).view(B, T)  # (B, T), 0 on padding
        entropy = zeros.index_copy(0, keep, kept_entropy.detach()).view(B, T)
    old = None if old_logp is None else old_logp.to(torch.float32)
    ref = None if ref_logp is None else ref_logp.to(torch.float32)
    maskf = mask.to(torch.float32)
    q = s.top_entropy_quantile
    entropy_mask = high_entropy_mask(entropy, mask, q) if q < 1.0 else None
    coef = None
    if p.variant == Variant.VESPO:
        log_ratio = logp.detach() - (logp.detach() if old is None else old)
        coef = vespo_coef(log_ratio, adv, maskf, importance_sampling_ratio, s)
    if s.importance_sampling_level is ISLevel.TOKEN:
        per_token, kl, code = token_terms(logp, adv, mask, old, ref, importance_sampling_ratio, entropy_mask, s)
    else:
        weight = per_token_weights((B, T), dev, importance_sampling_ratio, entropy_mask, p.variant)
        per_token, kl, code = sequence_level_terms(logp, adv, maskf, old, ref, weight, coef, p)
    loss = reduce_loss(per_token, maskf, s.loss_type, max_completion_length=s.max_completion_length,
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
