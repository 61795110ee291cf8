"""Ops 2 and 3: the per-token GRPO loss, on log-probs or fused with the log-softmax over logits.

    grpo_token_loss(logits (B, T, V), ids (B, T), advantages (B,) | (B, T), ...) -> GRPOTokenLoss
        loss = -min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A) + beta * k3   per token

`grpo_token_terms` (op 2) is the same arithmetic on per-token vectors, for callers that already hold
logp (the fused lm-head loss uses it). Both compute the derivatives in closed form in the forward;
the backward of op 3 then writes dlogits in place into the logits buffer like op 1 does.

Design notes: docs/kernels.md
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from ..ranges import BETA, EPSILON_HIGH, EPSILON_LOW
from ._backend import use_triton
from ._checks import check_float, check_ids, check_mask, check_shape, check_temperature
from .logprobs import _token_logprobs_backward_op, finalize_stats, logits_stats, may_overwrite, new_stats


@dataclass
class GRPOTokenLoss:
    """Per-token results, each (B, T) and zero where the mask is 0."""

    loss: Tensor  # fp32, differentiable w.r.t. logits
    logp: Tensor  # fp32, differentiable w.r.t. logits
    kl: Tensor  # fp32 k3 estimator (0 when no ref_logp), differentiable w.r.t. logits
    is_clipped: Tensor  # bool: the clipped branch of the min is active (no gradient from it)
    is_low_clipped: Tensor  # bool: rho < 1 - epsilon_low and A < 0
    is_high_clipped: Tensor  # bool: rho > 1 + epsilon_high and A > 0


def check_grpo_hparams(epsilon_low: float, epsilon_high: Optional[float], beta: float,
                       ref_logp) -> tuple[float, float, float]:
    """The clip ranges and KL coefficient as floats, checked against the ranges the config also checks
    (lowmem_grpo/ranges.py); epsilon_high None means epsilon_low."""
    epsilon_low = EPSILON_LOW.check(epsilon_low, "epsilon_low")
    epsilon_high = epsilon_low if epsilon_high is None else EPSILON_HIGH.check(epsilon_high, "epsilon_high")
    beta = BETA.check(beta, "beta")
    if beta > 0.0 and ref_logp is None:
        raise ValueError(f"beta={beta} > 0 adds a KL penalty and needs ref_logp (reference-model log-probs); "
                         "pass ref_logp=... or set beta=0.0")
    return epsilon_low, epsilon_high, beta


def ppo_clip_k3(log_ratio: Tensor, adv: Tensor, logp: Tensor, ref: Optional[Tensor], *, eps_low: float,
                eps_high: float, beta: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The PPO-clip + k3 per-token math, the one torch copy of it (the Triton copy is
    grpo_loss_triton.grpo_token_terms; both are tested against reference.grpo_token_terms).

        rho  = exp(log_ratio)                     log_ratio = logp - old (token) or a sequence mean (GSPO)
        loss = -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A) + beta k3,  k3 = exp(ref - logp) - (ref - logp) - 1

    Returns (loss, kl, low, high, dloss, dkl): `low`/`high` flag the active clipped branch (bool),
    `dloss` = d clip-term / d log_ratio + beta dk3/dlogp and `dkl` = dk3/dlogp in closed form, which is
    dloss/dlogp where log_ratio = logp - old (the token level). Plain differentiable torch ops, so a
    caller whose log_ratio is not per token (GSPO) lets autograd differentiate `loss` instead."""
    rho = log_ratio.exp()
    low = (rho < 1.0 - eps_low) & (adv < 0)
    high = (rho > 1.0 + eps_high) & (adv > 0)
    loss = -torch.minimum(rho * adv, rho.clamp(1.0 - eps_low, 1.0 + eps_high) * adv)
    dloss = torch.where(low | high, 0.0, -rho * adv)
    if ref is not None:
        d = ref - logp
        e = d.exp()
        kl, dkl = e - d - 1.0, 1.0 - e
        loss, dloss = loss + beta * kl, dloss + beta * dkl
    else:
        kl, dkl = torch.zeros_like(loss), torch.zeros_like(loss)
    return loss, kl, low, high, dloss, dkl


def _torch_token_terms(logp, adv, mask, old, ref, *, eps_low, eps_high, beta):
    """Op 2's torch path, token-level ratio: (loss, kl, code, dloss, dkl), zero where the mask is 0."""
    log_ratio = logp - (logp if old is None else old)
    loss, kl, low, high, dloss, dkl = ppo_clip_k3(log_ratio, adv, logp, ref, eps_low=eps_low, eps_high=eps_high,
                                                  beta=beta)
    code = low.to(torch.int8) + 2 * high.to(torch.int8)
    if mask is not None:
        keep = mask.bool()
        loss, kl, dloss, dkl = (torch.where(keep, v, 0.0) for v in (loss, kl, dloss, dkl))
        code = torch.where(keep, code, 0).to(torch.int8)
    return loss, kl, code, dloss, dkl


def sequence_level_terms(logp: Tensor, adv: Tensor, maskf: Tensor, old: Optional[Tensor], ref: Optional[Tensor],
                         eps_low: float, eps_high: float, beta: float) -> tuple[Tensor, Tensor, Tensor]:
    """GSPO: one ratio per sequence from the mean token log-ratio; (loss, kl, clip code), each (B, T).
    Differentiable w.r.t. logp by autograd (the closed-form derivatives are per token only)."""
    log_ratio = logp - (logp.detach() if old is None else old)
    seq_log_ratio = (log_ratio * maskf).sum(-1) / maskf.sum(-1).clamp(min=1.0)  # (B,)
    loss, kl, low, high, _, _ = ppo_clip_k3(seq_log_ratio[:, None], adv, logp, ref,  # ratio broadcast over tokens
                                            eps_low=eps_low, eps_high=eps_high, beta=beta)
    code = (low.to(torch.int8) + 2 * high.to(torch.int8)) * maskf.to(torch.int8)
    return loss * maskf, kl * maskf, code


# ---- op 2: per-token terms on log-probs ---------------------------------------------------------


@torch.library.custom_op("lowmem_grpo::grpo_token_terms", mutates_args=())
def _grpo_token_terms_op(logp: Tensor, adv: Tensor, mask: Optional[Tensor], old: Optional[Tensor],
                         ref: Optional[Tensor], eps_low: float, eps_high: float, beta: float
                         ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """All inputs [N] (mask uint8) -> (loss, kl, code int8, dloss/dlogp, dkl/dlogp)."""
    if use_triton(logp):
        from . import grpo_loss_triton

        out = (torch.empty_like(logp), torch.empty_like(logp), torch.empty_like(logp, dtype=torch.int8),
               torch.empty_like(logp), torch.empty_like(logp))
        if logp.numel():
            grpo_loss_triton.grpo_token_terms_launch(logp, adv, mask, old, ref, out,
                                                     eps_low=eps_low, eps_high=eps_high, beta=beta)
        return out
    return _torch_token_terms(logp, adv, mask, old, ref, eps_low=eps_low, eps_high=eps_high, beta=beta)


@_grpo_token_terms_op.register_fake
def _(logp, adv, mask, old, ref, eps_low, eps_high, beta):
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
    return grad, None, None, None, None, None, None, None


_grpo_token_terms_op.register_autograd(_terms_backward, setup_context=_terms_setup_context)


def grpo_token_terms(logp: Tensor, advantages: Tensor, *, mask: Optional[Tensor] = None,
                     old_logp: Optional[Tensor] = None, ref_logp: Optional[Tensor] = None,
                     epsilon_low: float = 0.2, epsilon_high: Optional[float] = None, beta: float = 0.0
                     ) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token GRPO loss from log-probs: all arguments share logp's shape (fp32).

    Returns (loss, kl, clip_code) with clip_code int8: 0 none, 1 low-clipped, 2 high-clipped.
    Differentiable w.r.t. `logp` (old/ref/advantages are constants)."""
    epsilon_low, epsilon_high, beta = check_grpo_hparams(epsilon_low, epsilon_high, beta, ref_logp)
    shape, dev = logp.shape, logp.device
    for name, t in (("advantages", advantages), ("old_logp", old_logp), ("ref_logp", ref_logp)):
        check_shape(t, shape, name, dev)
    mask = check_mask(mask, shape, dev)

    def flat(t):
        return None if t is None else t.reshape(-1).to(torch.float32).contiguous()

    loss, kl, code, _, _ = _grpo_token_terms_op(
        flat(logp), flat(advantages), None if mask is None else mask.reshape(-1).to(torch.uint8).contiguous(),
        flat(old_logp), flat(ref_logp), epsilon_low, epsilon_high, beta)
    return loss.view(shape), kl.view(shape), code.view(shape)


# ---- op 3: logits -> per-token loss in one row kernel ---------------------------------------


@torch.library.custom_op("lowmem_grpo::grpo_token_loss", mutates_args=())
def _grpo_token_loss_op(logits: Tensor, ids: Tensor, adv: Tensor, mask: Optional[Tensor], old: Optional[Tensor],
                        ref: Optional[Tensor], temperature: float, eps_low: float, eps_high: float, beta: float
                        ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """logits [N, V], the rest [N] -> (loss, logp, kl, code, dloss, dkl, lse), all [N]."""
    n = logits.shape[0]
    if use_triton(logits):
        from . import grpo_loss_triton

        f = torch.empty(n, dtype=torch.float32, device=logits.device)
        outputs = (f, torch.empty_like(f), torch.empty_like(f), torch.empty(n, dtype=torch.int8, device=f.device),
                   torch.empty_like(f), torch.empty_like(f), torch.empty_like(f))
        if n:
            grpo_loss_triton.grpo_row_launch(logits, ids, adv, mask, old, ref, outputs, inv_temp=1.0 / temperature,
                                             eps_low=eps_low, eps_high=eps_high, beta=beta)
        loss, logp, kl, code, dloss, dkl, lse = outputs
        return loss, logp, kl, code, dloss, dkl, lse
    stats = new_stats(n, logits.device)
    logits_stats(logits, ids, stats, inv_temp=1.0 / temperature)
    lse, logp, _ = finalize_stats(stats)
    loss, kl, code, dloss, dkl = _torch_token_terms(logp, adv, mask, old, ref,
                                                    eps_low=eps_low, eps_high=eps_high, beta=beta)
    if mask is not None:
        keep = mask.bool()
        logp, lse = torch.where(keep, logp, 0.0), torch.where(keep, lse, 0.0)
    return loss, logp, kl, code, dloss, dkl, lse


@_grpo_token_loss_op.register_fake
def _(logits, ids, adv, mask, old, ref, temperature, eps_low, eps_high, beta):
    n = logits.shape[0]
    f = [logits.new_empty(n, dtype=torch.float32) for _ in range(7)]
    f[3] = logits.new_empty(n, dtype=torch.int8)
    return tuple(f)


def _loss_setup_context(ctx, inputs, output):
    logits, ids, _, mask, _, _, temperature, _, _, _ = inputs
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
    return (buf,) + (None,) * 9


_grpo_token_loss_op.register_autograd(_loss_backward, setup_context=_loss_setup_context)


def grpo_token_loss(logits: Tensor, ids: Tensor, advantages: Tensor, *, mask: Optional[Tensor] = None,
                    old_logp: Optional[Tensor] = None, ref_logp: Optional[Tensor] = None,
                    epsilon_low: float = 0.2, epsilon_high: Optional[float] = None, beta: float = 0.0,
                    temperature: float = 1.0) -> GRPOTokenLoss:
    """Per-token GRPO (PPO-clip + k3 KL) loss straight from logits, in one pass over each row.

    Args:
        logits: (B, T, V) float32/bfloat16/float16. Never copied to fp32; dlogits are written into it
            in backward when it is not a leaf (see logprobs.py).
        ids: (B, T) sampled token ids in [0, V) (free where mask is 0).
        advantages: (B,) per sequence or (B, T) per token.
        mask: (B, T) bool or 0/1; masked tokens cost nothing and get zero outputs and gradient.
        old_logp: (B, T) log-probs of the sampling policy; None means logp.detach() (rho == 1).
        ref_logp: (B, T) reference log-probs; required when beta > 0.
        epsilon_low / epsilon_high: clip range [1 - eps_low, 1 + eps_high]; eps_high None = eps_low.
        beta: weight of the k3 KL penalty.
        temperature: logits are divided by it before the softmax.

    Returns:
        GRPOTokenLoss with (B, T) fields loss, logp, kl (fp32, differentiable w.r.t. logits) and
        is_clipped / is_low_clipped / is_high_clipped (bool).
    """
    check_float(logits, "logits")
    if logits.dim() != 3:
        raise ValueError(f"logits must have shape (B, T, V), got {tuple(logits.shape)}")
    temperature = check_temperature(temperature)
    epsilon_low, epsilon_high, beta = check_grpo_hparams(epsilon_low, epsilon_high, beta, ref_logp)
    B, T, V = logits.shape
    dev = logits.device
    mask = check_mask(mask, (B, T), dev)
    flat_ids = check_ids(ids, (B, T), V, dev, mask=mask)
    adv = _expand_advantages(advantages, B, T, dev)
    for name, t in (("old_logp", old_logp), ("ref_logp", ref_logp)):
        check_shape(t, (B, T), name, dev)

    def flat(t):
        return None if t is None else t.reshape(-1).to(torch.float32).contiguous()

    rows = logits.reshape(B * T, V)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    loss, logp, kl, code, _, _, _ = _grpo_token_loss_op(
        rows, flat_ids, adv.reshape(-1), None if mask is None else mask.reshape(-1).to(torch.uint8).contiguous(),
        flat(old_logp), flat(ref_logp), temperature, epsilon_low, epsilon_high, beta)
    code = code.view(B, T)
    return GRPOTokenLoss(loss=loss.view(B, T), logp=logp.view(B, T), kl=kl.view(B, T),
                         is_clipped=code != 0, is_low_clipped=code == 1, is_high_clipped=code == 2)


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
