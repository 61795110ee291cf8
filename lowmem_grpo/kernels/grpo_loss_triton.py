"""Triton kernels for the per-token GRPO loss.

Per token (logp = log-prob of the sampled token, old/ref = stored log-probs, A = advantage), the
policy term of the variant (grpo_loss.policy_terms states them all; this is its Triton copy) times the
per-token weight, plus beta * k3 (times rho when bias-corrected), k3 = exp(ref - logp) - (ref - logp) - 1.
The closed-form derivatives are written in the forward, so the backward is one multiply per token
(plus, for the row kernel, the dlogits pass of logprobs_triton.logits_grad_kernel).

Two kernels, both on `block_terms`: `grpo_token_kernel` on per-token vectors (grpo_token_terms, for
callers that already hold logp), and `grpo_row_kernel`, which also does the log-softmax-gather over the
logits row (grpo_token_loss) so the logits are read once and nothing of size V is written.
Clip codes: 0 = not clipped, 1 = low-clipped (rho < 1 - eps_low, A < 0), 2 = high-clipped.
"""

from __future__ import annotations

import warnings

import triton
import triton.language as tl

from ._backend import launch_guard
from .logprobs_triton import block_config, row_stats

TOKEN_BLOCK = 1024  # tokens per program of grpo_token_kernel
TOKEN_WARPS = 4


@triton.jit
def block_terms(tokens, params, HAS_REF: tl.constexpr):
    """(loss, k3, dloss/dlogp, dk3/dlogp, clip code) for one token or a block of tokens.

    tokens = (logp, old, ref, adv, weight, coef), values or blocks of one shape; params = TermParams.op_args()
    = (variant, eps_low, eps_high, delta, beta, bias_kl, sapo_pos, sapo_neg). `variant` as grpo_loss.Variant
    (0 PPO-clip, 1 cispo, 2 sapo, 3 vespo with `coef` = phi), a runtime value: every variant's few flops are
    computed and one is selected, so one compiled kernel serves them all."""
    logp, old, ref, adv, weight, coef = tokens
    variant, eps_low, eps_high, delta, beta, bias_kl, sapo_pos, sapo_neg = params
    rho = tl.exp(logp - old)
    # PPO-clip, the unclipped ratio capped at delta (inf: no cap)
    clipped = tl.minimum(tl.maximum(rho, 1.0 - eps_low), 1.0 + eps_high)
    unclipped = tl.minimum(rho, delta)
    first = unclipped * adv <= clipped * adv  # the branch the min takes
    ppo = -tl.minimum(unclipped * adv, clipped * adv)
    slope = tl.where(first, tl.where(rho <= delta, rho, 0.0),
                     tl.where((rho >= 1.0 - eps_low) & (rho <= 1.0 + eps_high), rho, 0.0))
    # cispo: the clipped ratio as a constant weight of logp
    w = tl.minimum(rho, eps_high)
    # sapo: a sigmoid gate, temperature by the advantage's sign
    tau = tl.where(adv > 0.0, sapo_pos, sapo_neg)
    s = tl.sigmoid(tau * (rho - 1.0))
    loss = tl.where(variant == 0, ppo, tl.where(variant == 1, -w * adv * logp,
                    tl.where(variant == 2, -(s * 4.0 / tau) * adv, -coef * adv * logp)))
    dloss = tl.where(variant == 0, -slope * adv, tl.where(variant == 1, -w * adv,
                     tl.where(variant == 2, -4.0 * adv * s * (1.0 - s) * rho, -coef * adv)))
    loss = loss * weight
    dloss = dloss * weight
    low = (variant == 0) & (rho < 1.0 - eps_low) & (adv < 0.0)
    high = tl.where(variant == 1, (rho > eps_high) & (adv > 0.0), (variant == 0) & (rho > 1.0 + eps_high) & (adv > 0.0))
    if HAS_REF:
        d = ref - logp
        e = tl.exp(d)
        kl = e - d - 1.0
        dkl = 1.0 - e
        dkl = tl.where(bias_kl != 0, (dkl + kl) * rho, dkl)  # d(k3 rho)/dlogp
        kl = tl.where(bias_kl != 0, kl * rho, kl)
        loss += beta * kl
        dloss += beta * dkl
    else:
        kl = rho * 0.0
        dkl = rho * 0.0
    code = low.to(tl.int8) + 2 * high.to(tl.int8)
    return loss, kl, dloss, dkl, code


@triton.jit
def grpo_token_kernel(
    logp_ptr, adv_ptr, mask_ptr, old_ptr, ref_ptr, weight_ptr, coef_ptr,  # inputs [N]
    loss_ptr, kl_ptr, code_ptr, dloss_ptr, dkl_ptr,  # outputs [N]
    n_tokens,  # sizes
    variant: tl.int32, eps_low: tl.float32, eps_high: tl.float32, delta: tl.float32, beta: tl.float32,  # constants
    bias_kl: tl.int32, sapo_pos: tl.float32, sapo_neg: tl.float32,
    HAS_MASK: tl.constexpr, HAS_OLD: tl.constexpr, HAS_REF: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    HAS_COEF: tl.constexpr, BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < n_tokens
    logp = tl.load(logp_ptr + offs, mask=valid, other=0.0)
    adv = tl.load(adv_ptr + offs, mask=valid, other=0.0)
    old = tl.load(old_ptr + offs, mask=valid, other=0.0) if HAS_OLD else logp
    ref = tl.load(ref_ptr + offs, mask=valid, other=0.0) if HAS_REF else logp
    weight = tl.load(weight_ptr + offs, mask=valid, other=0.0) if HAS_WEIGHT else logp * 0.0 + 1.0
    coef = tl.load(coef_ptr + offs, mask=valid, other=0.0) if HAS_COEF else logp * 0.0
    loss, kl, dloss, dkl, code = block_terms((logp, old, ref, adv, weight, coef),
                                             (variant, eps_low, eps_high, delta, beta, bias_kl, sapo_pos, sapo_neg),
                                             HAS_REF)
    if HAS_MASK:
        keep = tl.load(mask_ptr + offs, mask=valid, other=0) != 0
        loss = tl.where(keep, loss, 0.0)
        kl = tl.where(keep, kl, 0.0)
        dloss = tl.where(keep, dloss, 0.0)
        dkl = tl.where(keep, dkl, 0.0)
        code = tl.where(keep, code, 0)
    tl.store(loss_ptr + offs, loss, mask=valid)
    tl.store(kl_ptr + offs, kl, mask=valid)
    tl.store(code_ptr + offs, code, mask=valid)
    tl.store(dloss_ptr + offs, dloss, mask=valid)
    tl.store(dkl_ptr + offs, dkl, mask=valid)


@triton.jit
def grpo_row_kernel(
    logits_ptr, ids_ptr, adv_ptr, mask_ptr, old_ptr, ref_ptr, weight_ptr,  # inputs: logits [N, V], the rest [N]
    loss_ptr, logp_ptr, kl_ptr, code_ptr, dloss_ptr, dkl_ptr, lse_ptr,  # outputs [N]
    stride_row, n_cols,  # strides and sizes
    inv_temp: tl.float32, variant: tl.int32, eps_low: tl.float32, eps_high: tl.float32, delta: tl.float32,
    beta: tl.float32, bias_kl: tl.int32, sapo_pos: tl.float32, sapo_neg: tl.float32,  # constants
    HAS_MASK: tl.constexpr, HAS_OLD: tl.constexpr, HAS_REF: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    if HAS_MASK:
        if tl.load(mask_ptr + row) == 0:  # padding: skip the row, outputs are 0
            tl.store(loss_ptr + row, 0.0)
            tl.store(logp_ptr + row, 0.0)
            tl.store(kl_ptr + row, 0.0)
            tl.store(code_ptr + row, tl.zeros([], dtype=tl.int8))
            tl.store(dloss_ptr + row, 0.0)
            tl.store(dkl_ptr + row, 0.0)
            tl.store(lse_ptr + row, 0.0)
            return
    y = tl.load(ids_ptr + row)
    m, s, t, x_y = row_stats(logits_ptr + row * stride_row, logits_ptr, y, n_cols, 0, 0.0, inv_temp, False,
                             BLOCK_V)  # given logits: no bias, no cap
    lse = m + tl.log(s)
    logp = x_y - lse
    old = tl.load(old_ptr + row) if HAS_OLD else logp
    ref = tl.load(ref_ptr + row) if HAS_REF else logp
    weight = tl.load(weight_ptr + row) if HAS_WEIGHT else 1.0
    adv = tl.load(adv_ptr + row)
    loss, kl, dloss, dkl, code = block_terms((logp, old, ref, adv, weight, 0.0),
                                             (variant, eps_low, eps_high, delta, beta, bias_kl, sapo_pos, sapo_neg),
                                             HAS_REF)
    tl.store(loss_ptr + row, loss)
    tl.store(logp_ptr + row, logp)
    tl.store(kl_ptr + row, kl)
    tl.store(code_ptr + row, code)
    tl.store(dloss_ptr + row, dloss)
    tl.store(dkl_ptr + row, dkl)
    tl.store(lse_ptr + row, lse)


def grpo_token_terms_launch(logp, adv, mask, old, ref, weight, coef, outputs, p):
    """outputs = (loss, kl, code, dloss, dkl), all [N]; mask is uint8 or None; p: loss_settings.TermParams."""
    loss, kl, code, dloss, dkl = outputs
    n = logp.numel()
    grid = (triton.cdiv(n, TOKEN_BLOCK),)
    with launch_guard(logp):
        grpo_token_kernel[grid](
            logp, adv, logp if mask is None else mask, logp if old is None else old, logp if ref is None else ref,
            logp if weight is None else weight, logp if coef is None else coef,
            loss, kl, code, dloss, dkl, n, int(p.variant), p.eps_low, p.eps_high, p.delta, p.beta, int(p.bias_kl),
            p.sapo_pos, p.sapo_neg, HAS_MASK=mask is not None, HAS_OLD=old is not None, HAS_REF=ref is not None,
            HAS_WEIGHT=weight is not None, HAS_COEF=coef is not None, BLOCK=TOKEN_BLOCK, num_warps=TOKEN_WARPS,
        )


def grpo_row_launch(logits, ids, adv, mask, old, ref, weight, outputs, *, inv_temp, p):
    """outputs = (loss, logp, kl, code, dloss, dkl, lse), all [N]; logits [N, V]; p: loss_settings.TermParams."""
    n_rows, n_cols = logits.shape
    block, warps = block_config(n_cols)
    with launch_guard(logits):
        grpo_row_kernel[(n_rows,)](
            logits, ids, adv, adv if mask is None else mask, adv if old is None else old, adv if ref is None else ref,
            adv if weight is None else weight,
            *outputs, logits.stride(0), n_cols, inv_temp, int(p.variant), p.eps_low, p.eps_high, p.delta, p.beta,
            int(p.bias_kl), p.sapo_pos, p.sapo_neg, HAS_MASK=mask is not None, HAS_OLD=old is not None,
            HAS_REF=ref is not None, HAS_WEIGHT=weight is not None, BLOCK_V=block, num_warps=warps,
        )


def __getattr__(name: str):
    """The per-token function's old name, `grpo_token_terms` (the torch op's name too), warns and gives
    `block_terms`."""
    if name == "grpo_token_terms":
        warnings.warn("lowmem_grpo.kernels.grpo_loss_triton.grpo_token_terms is deprecated: the Triton per-token "
                      "function is grpo_loss_triton.block_terms (lowmem_grpo.kernels.grpo_token_terms is the op)",
                      DeprecationWarning, stacklevel=2)
        return block_terms
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
