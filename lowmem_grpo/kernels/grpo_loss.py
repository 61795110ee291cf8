"""The per-token GRPO loss, on log-probs (`grpo_token_terms`) or fused with the log-softmax over logits.

    grpo_token_loss(logits (B, T, V), ids (B, T), advantages (B,) | (B, T), ...) -> GRPOTokenLoss
        loss = policy term of the loss_type (PPO-clip, cispo, sapo; policy_terms) + beta * k3   per token

`grpo_token_terms` is the same arithmetic on per-token vectors, for callers that already hold logp (the
fused lm-head loss uses it). Both compute the derivatives in closed form in the forward; the backward of
grpo_token_loss then writes dlogits in place into the logits buffer as token_logprobs' does. Both take
the loss's settings as one GRPOLossSettings (`settings=`) or as keywords (loss_settings.py).

Design notes: docs/kernels.md
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from ._backend import use_triton
from ._checks import check_float, check_ids, check_mask, check_shape
from .logprobs import _token_logprobs_backward_op, finalize_stats, logits_stats, may_overwrite, new_stats
from .loss_settings import (VARIANT_OF_LOSS_TYPE, GRPOLossSettings, ISLevel, TermParams, Variant,  # noqa: F401
                            check_grpo_hparams, settings_of, term_params)

# The loss settings each op's keyword form accepts (the others do not apply to it).
TERMS_KEYWORDS = ("loss_type", "epsilon_low", "epsilon_high", "beta", "delta", "use_bias_correction_kl",
                  "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg",
                  "vespo_lambda_neg")
TOKEN_LOSS_KEYWORDS = ("loss_type", "epsilon_low", "epsilon_high", "beta", "temperature", "delta",
                       "use_bias_correction_kl", "sapo_temperature_pos", "sapo_temperature_neg")


@dataclass
class GRPOTokenLoss:
    """Per-token results, each (B, T) and zero where the mask is 0."""

    loss: Tensor  # fp32, differentiable w.r.t. logits
    logp: Tensor  # fp32, differentiable w.r.t. logits
    kl: Tensor  # fp32 k3 estimator (0 when no ref_logp), differentiable w.r.t. logits
    is_clipped: Tensor  # bool: the clipped branch of the min is active (no gradient from it)
    is_low_clipped: Tensor  # bool: rho < 1 - epsilon_low and A < 0
    is_high_clipped: Tensor  # bool: rho > 1 + epsilon_high and A > 0


def policy_terms(log_ratio: Tensor, adv: Tensor, logp: Tensor, ref: Optional[Tensor], weight: Optional[Tensor],
                 coef: Optional[Tensor], p: TermParams) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The per-token loss of every variant, the one torch copy of it (the Triton copy is
    grpo_loss_triton.block_terms; both are tested against spec.grpo_token_terms).

        rho = exp(log_ratio)      log_ratio = logp - old (token) or a sequence mean broadcast (GSPO)
        PPO_CLIP  pg = -min(min(rho, delta) A, clip(rho, 1 - eps_low, 1 + eps_high) A)
        CISPO     pg = -sg[min(rho, eps_high)] A logp        SAPO  pg = -sigmoid(tau (rho - 1)) 4 / tau A
        VESPO     pg = -sg[coef] A logp                      (coef: the sequence's phi, vespo_phi)
        pg *= weight (importance-sampling ratio x entropy mask);  kl = k3(ref, logp) (x rho if bias_kl)
        loss = pg + beta kl

    Returns (loss, kl, low, high, dloss, dkl): `low`/`high` flag the clipped regions as TRL counts them
    (cispo: rho > eps_high with A > 0 is `high`), `dloss` = dloss/dlogp and `dkl` = dkl/dlogp in closed form
    where log_ratio = logp - old (the token level). Plain differentiable torch ops, so a caller whose
    log_ratio is not per token (GSPO) lets autograd differentiate `loss` instead."""
    rho = log_ratio.exp()
    no = torch.zeros_like(rho, dtype=torch.bool)
    low, high = no, no
    if p.variant == Variant.CISPO:
        w = rho.clamp(max=p.eps_high)
        pg, dpg = -w.detach() * adv * logp, -w * adv
        high = (rho > p.eps_high) & (adv > 0)
    elif p.variant == Variant.SAPO:
        tau = torch.where(adv > 0, p.sapo_pos, p.sapo_neg)
        s = torch.sigmoid(tau * (rho - 1.0))
        pg, dpg = -(s * 4.0 / tau) * adv, -4.0 * adv * s * (1.0 - s) * rho
    elif p.variant == Variant.VESPO:
        pg, dpg = -coef * adv * logp, -coef * adv
    else:
        clipped = rho.clamp(1.0 - p.eps_low, 1.0 + p.eps_high)
        unclipped = rho.clamp(max=p.delta) if math.isfinite(p.delta) else rho
        low, high = (rho < 1.0 - p.eps_low) & (adv < 0), (rho > 1.0 + p.eps_high) & (adv > 0)
        first = unclipped * adv <= clipped * adv  # the branch the min takes
        pg = -torch.minimum(unclipped * adv, clipped * adv)
        slope = torch.where(first, torch.where(rho <= p.delta, rho, 0.0),
                            torch.where((rho >= 1.0 - p.eps_low) & (rho <= 1.0 + p.eps_high), rho, 0.0))
        dpg = -slope * adv
    if weight is not None:
        pg, dpg = pg * weight, dpg * weight
    if ref is not None:
        d = ref - logp
        e = d.exp()
        kl, dkl = e - d - 1.0, 1.0 - e
        if p.bias_kl:  # d(k3 rho)/dlogp = (dk3 + k3) rho at the token level
            kl, dkl = kl * rho, (dkl + kl) * rho
        loss, dloss = pg + p.beta * kl, dpg + p.beta * dkl
    else:
        loss, dloss = pg, dpg
        kl, dkl = torch.zeros_like(loss), torch.zeros_like(loss)
    return loss, kl, low, high, dloss, dkl


def _torch_token_terms(logp, adv, mask, old, ref, weight, coef, p: TermParams):
    """grpo_token_terms' torch path, token-level ratio: (loss, kl, code, dloss, dkl), zero where the mask is 0."""
    log_ratio = logp - (logp if old is None else old)
    loss, kl, low, high, dloss, dkl = policy_terms(log_ratio, adv, logp, ref, weight, coef, p)
    code = low.to(torch.int8) + 2 * high.to(torch.int8)
    if mask is not None:
        keep = mask.bool()
        loss, kl, dloss, dkl = (torch.where(keep, v, 0.0) for v in (loss, kl, dloss, dkl))
        code = torch.where(keep, code, 0).to(torch.int8)
    return loss, kl, code, dloss, dkl


def sequence_level_terms(logp: Tensor, adv: Tensor, maskf: Tensor, old: Optional[Tensor], ref: Optional[Tensor],
                         weight: Optional[Tensor], coef: Optional[Tensor], p: TermParams
                         ) -> tuple[Tensor, Tensor, Tensor]:
    """GSPO: one ratio per sequence from the mean token log-ratio; (loss, kl, clip code), each (B, T).
    Differentiable w.r.t. logp by autograd (the closed-form derivatives are per token only)."""
    log_ratio = logp - (logp.detach() if old is None else old)
    seq_log_ratio = (log_ratio * maskf).sum(-1) / maskf.sum(-1).clamp(min=1.0)  # (B,)
    loss, kl, low, high, _, _ = policy_terms(seq_log_ratio[:, None], adv, logp, ref, weight, coef, p)
    code = (low.to(torch.int8) + 2 * high.to(torch.int8)).expand_as(maskf) * maskf.to(torch.int8)
    return loss * maskf, kl * maskf, code


# ---- grpo_token_terms: per-token terms on log-probs ---------------------------------------------


@torch.library.custom_op("lowmem_grpo::grpo_token_terms", mutates_args=())
def _grpo_token_terms_op(logp: Tensor, adv: Tensor, mask: Optional[Tensor], old: Optional[Tensor],
                         ref: Optional[Tensor], weight: Optional[Tensor], coef: Optional[Tensor], variant: int,
                         eps_low: float, eps_high: float, delta: float, beta: float, bias_kl: bool, sapo_pos: float,
                         sapo_neg: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """All inputs [N] (mask uint8) -> (loss, kl, code int8, dloss/dlogp, dkl/dlogp)."""
    p = TermParams(variant, eps_low, eps_high, delta, beta, bias_kl, sapo_pos, sapo_neg)
    if use_triton(logp):
        from . import grpo_loss_triton

        out = (torch.empty_like(logp), torch.empty_like(logp), torch.empty_like(logp, dtype=torch.int8),
               torch.empty_like(logp), torch.empty_like(logp))
        if logp.numel():
            grpo_loss_triton.grpo_token_terms_launch(logp, adv, mask, old, ref, weight, coef, out, p)
        return out
    return _torch_token_terms(logp, adv, mask, old, ref, weight, coef, p)


@_grpo_token_terms_op.register_fake
def _(logp, adv, mask, old, ref, weight, coef, *scalars):
    e = torch.empty_like
    return e(logp), e(logp), e(logp, dtype=torch.int8), e(logp), e(logp)


def _terms_setup_context(ctx, inputs, output):
    _, _, _, dloss, dkl = output
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(dloss, dkl)


def _terms_backward(ctx, g_loss, g_kl, g_code, g_dloss, g_dkl):
    dloss, dkl = ctx.saved_tensors
    grad = torch.zeros_like(dloss)  # dL/dlogp
    if g_loss is not None:
        grad = grad + g_loss * dloss
    if g_kl is not None:
        grad = grad + g_kl * dkl
    return (grad,) + (None,) * 14


_grpo_token_terms_op.register_autograd(_terms_backward, setup_context=_terms_setup_context)


def per_token_weights(shape: tuple[int, int], device, importance_sampling_ratio: Optional[Tensor],
                      entropy_mask: Optional[Tensor], variant: int) -> Optional[Tensor]:
    """The multiplier of each token's policy-gradient term: the importance-sampling ratio ((B,), (B, 1) or
    (B, T); vespo folds it into phi instead) times the entropy mask; None when neither applies."""
    B, T = shape
    weight = None
    if importance_sampling_ratio is not None and variant != Variant.VESPO:
        ratio = importance_sampling_ratio
        if ratio.dim() == 1:
            ratio = ratio[:, None]
        if ratio.dim() != 2 or ratio.shape[0] != B or ratio.shape[1] not in (1, T):
            raise ValueError(f"importance_sampling_ratio must have shape ({B},), ({B}, 1) or ({B}, {T}), "
                             f"got {tuple(importance_sampling_ratio.shape)}")
        if ratio.device != device:
            raise ValueError(f"importance_sampling_ratio is on {ratio.device}, the log-probs on {device}")
        weight = ratio.to(torch.float32).expand(B, T)
    if entropy_mask is not None:
        weight = entropy_mask.to(torch.float32) if weight is None else weight * entropy_mask
    return None if weight is None else weight.contiguous()


def vespo_coef(log_ratio: Tensor, adv: Tensor, maskf: Tensor, importance_sampling_ratio: Optional[Tensor],
               settings: GRPOLossSettings) -> Tensor:
    """VESPO's phi of each sequence, broadcast to (B, T), no gradient (spec.vespo_phi is the spec).
    `log_ratio` (B, T) = logp - old; `adv` (B, T); k and lambda from the settings' vespo_*."""
    with torch.no_grad():
        floor = math.log(1e-8)
        log_w = (log_ratio.clamp(-20.0, 20.0) * maskf).sum(-1, keepdim=True)  # (B, 1)
        if importance_sampling_ratio is not None:
            ratio = importance_sampling_ratio
            ratio = ratio if ratio.dim() == 2 else ratio[:, None]
            log_w = log_w + ratio.float().log().clamp(floor, 20.0).sum(-1, keepdim=True)
        log_w = log_w.clamp(floor, 20.0)
        k = torch.where(adv >= 0, settings.vespo_k_pos, settings.vespo_k_neg)
        lam = torch.where(adv >= 0, settings.vespo_lambda_pos, settings.vespo_lambda_neg).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * log_w.exp())
        return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).expand_as(adv).contiguous()


def grpo_token_terms(logp: Tensor, advantages: Tensor, *, mask: Optional[Tensor] = None,
                     old_logp: Optional[Tensor] = None, ref_logp: Optional[Tensor] = None,
                     importance_sampling_ratio: Optional[Tensor] = None, entropy_mask: Optional[Tensor] = None,
                     settings: Optional[GRPOLossSettings] = None, **keywords) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token GRPO loss of any loss_type from log-probs (token-level ratio): all tensors shaped like logp (fp32).

    `settings` (a GRPOLossSettings), or its fields as keywords (loss_type default "grpo" here; the names in
    TERMS_KEYWORDS), pick the per-token term (grpo / bnpo / dapo / dr_grpo / luspo share PPO-clip; cispo, sapo,
    vespo; see policy_terms), `delta` (caps the unclipped ratio), `use_bias_correction_kl` (k3 times the
    ratio). The settings' temperature and max_completion_length do not apply (logp is given, nothing is
    reduced); importance_sampling_level "sequence" and top_entropy_quantile < 1 are refused (linear_grpo_loss
    computes them). `importance_sampling_ratio` ((B,), (B, 1) or like logp) and `entropy_mask` multiply the
    policy term. vespo needs logp (B, T) (phi is per sequence).
    Returns (loss, kl, clip_code) with clip_code int8: 0 none, 1 low-clipped, 2 high-clipped.
    Differentiable w.r.t. `logp` (old/ref/advantages are constants)."""
    s = settings_of(settings, keywords, "grpo_token_terms", TERMS_KEYWORDS, loss_type="grpo")
    _check_per_token(s, "grpo_token_terms")
    s.check_reference(ref_logp)
    return token_terms(logp, advantages, mask, old_logp, ref_logp, importance_sampling_ratio, entropy_mask, s)


def token_terms(logp: Tensor, advantages: Tensor, mask: Optional[Tensor], old_logp: Optional[Tensor],
                ref_logp: Optional[Tensor], importance_sampling_ratio: Optional[Tensor], entropy_mask: Optional[Tensor],
                s: GRPOLossSettings) -> tuple[Tensor, Tensor, Tensor]:
    """grpo_token_terms once its settings are checked (linear_grpo_loss calls it with its entropy mask)."""
    p = s.terms
    shape, dev = logp.shape, logp.device
    for name, t in (("advantages", advantages), ("old_logp", old_logp), ("ref_logp", ref_logp),
                    ("entropy_mask", entropy_mask)):
        check_shape(t, shape, name, dev)
    mask = check_mask(mask, shape, dev)
    weight = coef = None
    if importance_sampling_ratio is not None or entropy_mask is not None or p.variant == Variant.VESPO:
        if logp.dim() != 2:
            raise ValueError(f"importance_sampling_ratio, entropy_mask and loss_type='vespo' need logp shaped "
                             f"(B, T), got {tuple(shape)}")
        weight = per_token_weights(shape, dev, importance_sampling_ratio, entropy_mask, p.variant)
        if p.variant == Variant.VESPO:
            maskf = torch.ones(shape, device=dev) if mask is None else mask.float()
            old = logp.detach() if old_logp is None else old_logp.float()
            coef = vespo_coef(logp.detach() - old, advantages.float(), maskf, importance_sampling_ratio, s)

    def flat(t):
        return None if t is None else t.reshape(-1).to(torch.float32).contiguous()

    loss, kl, code, _, _ = _grpo_token_terms_op(
        flat(logp), flat(advantages), None if mask is None else mask.reshape(-1).to(torch.uint8).contiguous(),
        flat(old_logp), flat(ref_logp), flat(weight), flat(coef), *p.op_args())
    return loss.view(shape), kl.view(shape), code.view(shape)


# ---- grpo_token_loss: logits -> per-token loss in one row kernel ------------------------------


@torch.library.custom_op("lowmem_grpo::grpo_token_loss", mutates_args=())
def _grpo_token_loss_op(logits: Tensor, ids: Tensor, adv: Tensor, mask: Optional[Tensor], old: Optional[Tensor],
                        ref: Optional[Tensor], weight: Optional[Tensor], temperature: float, variant: int,
                        eps_low: float, eps_high: float, delta: float, beta: float, bias_kl: bool, sapo_pos: float,
                        sapo_neg: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """logits [N, V], the rest [N] -> (loss, logp, kl, code, dloss, dkl, lse), all [N]."""
    n = logits.shape[0]
    p = TermParams(variant, eps_low, eps_high, delta, beta, bias_kl, sapo_pos, sapo_neg)
    if use_triton(logits):
        from . import grpo_loss_triton

        f = torch.empty(n, dtype=torch.float32, device=logits.device)
        outputs = (f, torch.empty_like(f), torch.empty_like(f), torch.empty(n, dtype=torch.int8, device=f.device),
                   torch.empty_like(f), torch.empty_like(f), torch.empty_like(f))
        if n:
            grpo_loss_triton.grpo_row_launch(logits, ids, adv, mask, old, ref, weight, outputs,
                                             inv_temp=1.0 / temperature, p=p)
        loss, logp, kl, code, dloss, dkl, lse = outputs
        return loss, logp, kl, code, dloss, dkl, lse
    stats = new_stats(n, logits.device)
    logits_stats(logits, ids, stats, inv_temp=1.0 / temperature)
    lse, logp, _ = finalize_stats(stats)
    loss, kl, code, dloss, dkl = _torch_token_terms(logp, adv, mask, old, ref, weight, None, p)
    if mask is not None:
        keep = mask.bool()
        logp, lse = torch.where(keep, logp, 0.0), torch.where(keep, lse, 0.0)
    return loss, logp, kl, code, dloss, dkl, lse


@_grpo_token_loss_op.register_fake
def _(logits, ids, adv, mask, old, ref, weight, *scalars):
    n = logits.shape[0]
    f = [logits.new_empty(n, dtype=torch.float32) for _ in range(7)]
    f[3] = logits.new_empty(n, dtype=torch.int8)
    return tuple(f)


def _loss_setup_context(ctx, inputs, output):
    logits, ids, _, mask, _, _, _, temperature = inputs[:8]
    _, _, _, _, dloss, dkl, lse = output
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(logits, ids, mask, dloss, dkl, lse)
    ctx.temperature = temperature
    ctx.in_place = may_overwrite(logits)


def _loss_backward(ctx, g_loss, g_logp, g_kl, *unused):
    logits, ids, mask, dloss, dkl, lse = ctx.saved_tensors
    grad = torch.zeros_like(lse)  # total dL/dlogp per token
    if g_loss is not None:
        grad = grad + g_loss * dloss
    if g_kl is not None:
        grad = grad + g_kl * dkl
    if g_logp is not None:
        grad = grad + (g_logp if mask is None else torch.where(mask.bool(), g_logp, 0.0))
    buf = logits if ctx.in_place else logits.clone()
    _token_logprobs_backward_op(buf, ids, lse, grad.contiguous(), None, None, ctx.temperature)
    return (buf,) + (None,) * 15


_grpo_token_loss_op.register_autograd(_loss_backward, setup_context=_loss_setup_context)


def grpo_token_loss(logits: Tensor, ids: Tensor, advantages: Tensor, *, mask: Optional[Tensor] = None,
                    old_logp: Optional[Tensor] = None, ref_logp: Optional[Tensor] = None,
                    importance_sampling_ratio: Optional[Tensor] = None, entropy_mask: Optional[Tensor] = None,
                    settings: Optional[GRPOLossSettings] = None, **keywords) -> GRPOTokenLoss:
    """Per-token GRPO loss (policy term + k3 KL) straight from logits, in one pass over each row.

    Args:
        logits: (B, T, V) float32/bfloat16/float16. Never copied to fp32; dlogits are written into it
            in backward when it is not a leaf (see logprobs.py).
        ids: (B, T) sampled token ids in [0, V) (free where mask is 0).
        advantages: (B,) per sequence or (B, T) per token.
        mask: (B, T) bool or 0/1; masked tokens cost nothing and get zero outputs and gradient.
        old_logp: (B, T) log-probs of the sampling policy; None means logp.detach() (rho == 1).
        ref_logp: (B, T) reference log-probs; required when beta > 0.
        importance_sampling_ratio, entropy_mask: as in grpo_token_terms.
        settings: a GRPOLossSettings; or its fields as keywords (loss_type default "grpo" here; the names in
            TOKEN_LOSS_KEYWORDS): epsilon_low / epsilon_high (clip range [1 - eps_low, 1 + eps_high]),
            beta (weight of the k3 KL penalty), temperature (the logits are divided by it), loss_type, delta,
            use_bias_correction_kl, sapo_*: as in grpo_token_terms. loss_type 'vespo' (a per-sequence
            weight) is not computed here; max_completion_length does not apply.

    Returns:
        GRPOTokenLoss with (B, T) fields loss, logp, kl (fp32, differentiable w.r.t. logits) and
        is_clipped / is_low_clipped / is_high_clipped (bool).
    """
    check_float(logits, "logits")
    if logits.dim() != 3:
        raise ValueError(f"logits must have shape (B, T, V), got {tuple(logits.shape)}")
    s = settings_of(settings, keywords, "grpo_token_loss", TOKEN_LOSS_KEYWORDS, loss_type="grpo")
    _check_per_token(s, "grpo_token_loss")
    s.check_reference(ref_logp)
    p = s.terms
    if p.variant == Variant.VESPO:
        raise ValueError("loss_type='vespo' weighs each sequence by phi of its whole log-ratio, which this "
                         "per-row op does not see: use grpo_token_terms on the log-probs, or linear_grpo_loss")
    B, T, V = logits.shape
    dev = logits.device
    mask = check_mask(mask, (B, T), dev)
    flat_ids = check_ids(ids, (B, T), V, dev, mask=mask)
    adv = _expand_advantages(advantages, B, T, dev)
    for name, t in (("old_logp", old_logp), ("ref_logp", ref_logp), ("entropy_mask", entropy_mask)):
        check_shape(t, (B, T), name, dev)
    weight = per_token_weights((B, T), dev, importance_sampling_ratio, entropy_mask, p.variant)

    def flat(t):
        return None if t is None else t.reshape(-1).to(torch.float32).contiguous()

    rows = logits.reshape(B * T, V)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    loss, logp, kl, code, _, _, _ = _grpo_token_loss_op(
        rows, flat_ids, adv.reshape(-1), None if mask is None else mask.reshape(-1).to(torch.uint8).contiguous(),
        flat(old_logp), flat(ref_logp), flat(weight), s.temperature, *p.op_args())
    code = code.view(B, T)
    return GRPOTokenLoss(loss=loss.view(B, T), logp=logp.view(B, T), kl=kl.view(B, T),
                         is_clipped=code != 0, is_low_clipped=code == 1, is_high_clipped=code == 2)


def _check_per_token(settings: GRPOLossSettings, op: str) -> None:
    """The per-token ops see no sequence and no entropy: refuse the settings that need them."""
    if settings.importance_sampling_level is not ISLevel.TOKEN:
        raise ValueError(f"{op} computes a token-level ratio; importance_sampling_level="
                         f"'{settings.importance_sampling_level.value}' needs each sequence's mean: use "
                         "linear_grpo_loss, or settings with importance_sampling_level='token'")
    if settings.top_entropy_quantile < 1.0:
        raise ValueError(f"{op} sees no entropies; top_entropy_quantile={settings.top_entropy_quantile} needs "
                         "them: pass entropy_mask=... (linear_grpo_loss computes it), or settings with "
                         "top_entropy_quantile=1.0")


def _expand_advantages(advantages: Tensor, B: int, T: int, device: torch.device) -> Tensor:
    """(B,) or (B, T) advantages -> contiguous fp32 (B, T)."""
    if not isinstance(advantages, Tensor):
        raise TypeError(f"advantages must be a tensor, got {type(advantages).__name__}")
    if advantages.shape == (B,):
        advantages = advantages[:, None].expand(B, T)
    elif advantages.shape != (B, T):
        raise ValueError(f"advantages must have shape ({B},) or ({B}, {T}), got {tuple(advantages.shape)}")
    if advantages.device != device:
        raise ValueError(f"advantages is on {advantages.device} but the logits/hidden states are on {device}")
    return advantages.to(torch.float32).contiguous()
