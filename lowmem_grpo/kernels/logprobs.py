"""token_logprobs: fused log-softmax-gather (+ entropy) on given logits.

    token_logprobs(logits (..., V), ids (...)) -> logp (...) fp32
        = log_softmax(logits.float() / T, -1).gather(-1, ids)

Layers: row kernels (logprobs_triton.py, CUDA) or chunked torch (below, CPU) -> `logits_stats` /
`logits_grad_` dispatchers (also used by the fused lm-head ops) -> torch.library custom ops with
fake and autograd registrations -> the public function.

Memory: forward keeps 3 floats per row (lse, and entropy if asked); backward writes dlogits in place
into the logits buffer when the logits are an intermediate of the graph (the usual `lm_head`
output), so no second [N, V] tensor exists. If the logits are a leaf tensor the gradient goes to a
new buffer instead: overwriting a user's leaf would be a surprise. Any other autograd node that saved
the same logits and runs its backward later gets PyTorch's "modified by an inplace operation" error
rather than silently wrong gradients.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ._backend import use_triton, workspace_bytes
from ._checks import check_float, check_ids, check_temperature

# The fused head's slices are raw GEMM outputs z: the row kernels read x = cap(z + bias) / T, with the bias
# added in fp32 (bias: the full (V,) vector in fp32, indexed from col_offset) and cap(u) = c tanh(u / c) when
# softcap = c > 0 (Gemma 2's final_logit_softcapping); the backward returns dL/dz.
# Online-softmax statistics of x = logits / T per row, each [N] fp32: m (running max),
# s = sum exp(x - m), t = sum exp(x - m) (x - m), x_y = x[id]. lse = m + log s, H = log s - t / s.
Stats = tuple[Tensor, Tensor, Tensor, Tensor]


def _rows_per_chunk(n_cols: int, device_type: str) -> int:
    # the torch path holds at most two fp32 [rows, n_cols] buffers per chunk (and a third transiently)
    return max(1, workspace_bytes(device_type) // (3 * 4 * n_cols))


def _finite_or_zero(m: Tensor) -> Tensor:
    """The shift for exp(x - shift): m itself, or 0 where m is -inf (every column so far banned)."""
    return torch.where(m == float("-inf"), torch.zeros_like(m), m)


def _capped_(z: Tensor, bias: Optional[Tensor], col_offset: int, softcap: float) -> Tensor:
    """z (an fp32 chunk of columns col_offset..) -> cap(z + bias), in place."""
    if bias is not None:
        z.add_(bias[col_offset:col_offset + z.shape[1]])
    if softcap > 0.0:
        z.div_(softcap).tanh_().mul_(softcap)
    return z


def _scaled_copy(chunk: Tensor, bias: Optional[Tensor], col_offset: int, softcap: float, inv_temp: float) -> Tensor:
    """A new fp32 tensor: cap(chunk + bias) * inv_temp. An fp32 chunk with no bias and no cap is scaled in
    one pass (torch.mul), not copied first and scaled in place: the same single rounding, one pass fewer."""
    if chunk.dtype == torch.float32 and bias is None and softcap == 0.0:
        return torch.mul(chunk, inv_temp)
    return _capped_(chunk.to(torch.float32, copy=True), bias, col_offset, softcap).mul_(inv_temp)


def _torch_logits_stats(logits, ids, stats, *, col_offset, inv_temp, accumulate, with_entropy, bias, softcap):
    # Statistics in the form (m = lse, s = 1, t = -H, x_y): the kernel's (m, s, t) with m = lse, so
    # the same merge rule holds, and torch's fused logsumexp / softmax do each chunk in few passes.
    n_rows, n_cols = logits.shape
    step = _rows_per_chunk(n_cols, logits.device.type)
    for r0 in range(0, n_rows, step):
        r = slice(r0, r0 + step)
        x = _scaled_copy(logits[r], bias, col_offset, softcap, inv_temp)
        y = ids[r] - col_offset
        in_row = (y >= 0) & (y < n_cols)
        x_y = torch.where(in_row, x.gather(1, y.clamp(0, n_cols - 1)[:, None])[:, 0], 0.0)  # not -inf * 0
        m = torch.logsumexp(x, dim=1)  # -inf for a row whose columns here are all -inf (banned)
        s = torch.ones_like(m)
        if with_entropy:  # t = sum p log p = -H, with two chunk buffers alive
            log_p = x.sub_(_finite_or_zero(m)[:, None])  # never -inf - -inf: such a row gets t = 0
            p = log_p.exp()
            log_p.clamp_(min=torch.finfo(torch.float32).min)  # banned tokens (-inf): 0 * log p = 0
            t = p.mul_(log_p).sum(dim=1)  # torch's sum is pairwise: accurate over 150k terms
            del p
        else:
            t = torch.zeros_like(m)
        if accumulate:
            m_prev = stats[0][r]
            m_new = torch.maximum(m_prev, m)
            m_ref = _finite_or_zero(m_new)  # both sides all -inf so far: no -inf - -inf
            a, b = (m_prev - m_ref).exp(), (m - m_ref).exp()
            s_prev = stats[1][r]
            # a side without mass (a or b == 0) adds nothing to t, rather than 0 * -inf = NaN
            t = (torch.where(a > 0, a * (stats[2][r] + (m_prev - m_ref) * s_prev), 0.0)
                 + torch.where(b > 0, b * (t + (m - m_ref) * s), 0.0))
            s = s_prev * a + s * b
            x_y = stats[3][r] + x_y
            m = m_new
        for dst, src in zip(stats, (m, s, t, x_y)):
            dst[r] = src
        del x  # free this chunk before the next one is allocated


def _grad_in_place(chunk: Tensor, softcap: float) -> bool:
    """Whether the backward works on an fp32 chunk in place: where its values are not read again (no soft
    cap), the same ops on the same values as on a copy, without the copy in and the copy back."""
    return chunk.dtype == torch.float32 and softcap == 0.0


def _torch_logits_grad_(logits, ids, lse, grad, entropy, grad_entropy, *, col_offset, inv_temp, bias, softcap):
    n_rows, n_cols = logits.shape
    step = _rows_per_chunk(n_cols, logits.device.type)
    for r0 in range(0, n_rows, step):
        r = slice(r0, r0 + step)
        chunk = logits[r]
        # in place, or one bounded fp32 copy, named once: freed by the `del` below before the next is made
        log_p = (_capped_(chunk, bias, col_offset, 0.0).mul_(inv_temp) if _grad_in_place(chunk, softcap)
                 else _scaled_copy(chunk, bias, col_offset, softcap, inv_temp))
        log_p.sub_(lse[r, None])
        g = grad[r]
        if grad_entropy is None:
            dx = log_p.exp_().mul_(-g[:, None])  # -g p, in the chunk's own buffer
        else:  # dH/dx_j = -p_j (log p_j + H): -g p - g_H p (log p + H), two buffers alive
            p = log_p.exp()
            term = log_p.clamp_(min=torch.finfo(torch.float32).min).add_(entropy[r, None])
            term.mul_(p).mul_(grad_entropy[r, None])
            dx = p.mul_(-g[:, None]).sub_(term)
            del term
        y = ids[r] - col_offset
        in_row = (y >= 0) & (y < n_cols)
        dx.scatter_add_(1, y.clamp(0, n_cols - 1)[:, None], (g * in_row)[:, None])
        dx.mul_(inv_temp)
        if softcap > 0.0:  # d cap(u) / du = 1 / cosh(u / c)^2, not 1 - tanh^2 (which cancels where it saturates)
            u = _capped_(logits[r].to(torch.float32, copy=True), bias, col_offset, 0.0)
            dx.mul_(u.div_(softcap).cosh_().reciprocal_().square_())
            del u
        if dx.data_ptr() != chunk.data_ptr():
            chunk.copy_(dx)
        del log_p, dx  # free this chunk before the next one is allocated


def new_stats(n_rows: int, device: torch.device) -> Stats:
    return tuple(torch.empty(n_rows, dtype=torch.float32, device=device) for _ in range(4))


def logits_stats(logits: Tensor, ids: Tensor, stats: Stats, *, col_offset: int = 0,
                 inv_temp: float = 1.0, accumulate: bool = False, with_entropy: bool = False,
                 bias: Optional[Tensor] = None, softcap: float = 0.0) -> None:
    """Online-softmax statistics of x = cap(logits + bias) * inv_temp, `logits` [N, n_cols] a vocab slice
    starting at `col_offset` (bias: (V,) fp32 or None; softcap 0: no cap), written into `stats`, or merged
    into it when `accumulate`."""
    if logits.shape[0] == 0:
        return
    if use_triton(logits):
        from . import logprobs_triton

        logprobs_triton.logits_stats(logits, ids, stats, col_offset=col_offset, inv_temp=inv_temp,
                                     accumulate=accumulate, with_entropy=with_entropy, bias=bias, softcap=softcap)
    else:
        _torch_logits_stats(logits, ids, stats, col_offset=col_offset, inv_temp=inv_temp,
                            accumulate=accumulate, with_entropy=with_entropy, bias=bias, softcap=softcap)


def finalize_stats(stats: Stats) -> tuple[Tensor, Tensor, Tensor]:
    """(lse, logp, entropy) in units of x = logits / T."""
    m, s, t, x_y = stats
    log_s = s.log()
    lse = m + log_s
    return lse, x_y - lse, log_s - t / s


def logits_grad_(logits: Tensor, ids: Tensor, lse: Tensor, grad: Tensor, entropy: Optional[Tensor] = None,
                 grad_entropy: Optional[Tensor] = None, *, col_offset: int = 0, inv_temp: float = 1.0,
                 bias: Optional[Tensor] = None, softcap: float = 0.0) -> None:
    """Overwrite `logits` [N, n_cols] with dL/dlogits given dL/dlogp (and optionally dL/dH), x read as in
    `logits_stats` (so the gradient also is the bias's)."""
    if logits.shape[0] == 0:
        return
    if use_triton(logits):
        from . import logprobs_triton

        logprobs_triton.logits_grad_(logits, ids, lse, grad, entropy, grad_entropy,
                                     col_offset=col_offset, inv_temp=inv_temp, bias=bias, softcap=softcap)
    else:
        _torch_logits_grad_(logits, ids, lse, grad, entropy, grad_entropy, col_offset=col_offset, inv_temp=inv_temp,
                            bias=bias, softcap=softcap)


# ---- torch.library registration -------------------------------------------------------------


@torch.library.custom_op("lowmem_grpo::token_logprobs", mutates_args=())
def _token_logprobs_op(logits: Tensor, ids: Tensor, temperature: float, with_entropy: bool
                       ) -> tuple[Tensor, Tensor, Tensor]:
    """logits [N, V], ids [N] -> (logp, lse, entropy), each [N] fp32 (entropy 0 unless asked)."""
    stats = new_stats(logits.shape[0], logits.device)
    logits_stats(logits, ids, stats, inv_temp=1.0 / temperature, with_entropy=with_entropy)
    lse, logp, entropy = finalize_stats(stats)
    return logp, lse, entropy if with_entropy else torch.zeros_like(lse)


@_token_logprobs_op.register_fake
def _(logits, ids, temperature, with_entropy):
    n = logits.shape[0]
    return tuple(logits.new_empty(n, dtype=torch.float32) for _ in range(3))


@torch.library.custom_op("lowmem_grpo::token_logprobs_backward_", mutates_args=("logits",))
def _token_logprobs_backward_op(logits: Tensor, ids: Tensor, lse: Tensor, grad_logp: Tensor,
                                entropy: Optional[Tensor], grad_entropy: Optional[Tensor],
                                temperature: float) -> None:
    """Overwrite logits [N, V] with dL/dlogits."""
    logits_grad_(logits, ids, lse, grad_logp, entropy, grad_entropy, inv_temp=1.0 / temperature)


@_token_logprobs_backward_op.register_fake
def _(logits, ids, lse, grad_logp, entropy, grad_entropy, temperature):
    return None


def may_overwrite(logits: Tensor) -> bool:
    """Whether backward may write dlogits into `logits`: only when neither it nor the tensor it is a
    view of is a leaf (a user's own tensor or a parameter)."""
    root = logits if logits._base is None else logits._base
    return not root.is_leaf


def _setup_context(ctx, inputs, output):
    logits, ids, temperature, with_entropy = inputs
    _, lse, entropy = output
    ctx.set_materialize_grads(False)  # unused outputs (lse, an unused entropy) arrive as None
    ctx.save_for_backward(logits, ids, lse, entropy)
    ctx.temperature = temperature
    ctx.with_entropy = with_entropy
    ctx.in_place = may_overwrite(logits)


def _backward(ctx, grad_logp, grad_lse, grad_entropy):
    logits, ids, lse, entropy = ctx.saved_tensors
    buf = logits if ctx.in_place else logits.clone()
    grad_logp = torch.zeros_like(lse) if grad_logp is None else grad_logp.float().contiguous()
    if ctx.with_entropy and grad_entropy is not None:
        grad_entropy = grad_entropy.float().contiguous()
    else:
        grad_entropy = None
    _token_logprobs_backward_op(buf, ids, lse, grad_logp, entropy, grad_entropy, ctx.temperature)
    return buf, None, None, None


_token_logprobs_op.register_autograd(_backward, setup_context=_setup_context)


def token_logprobs(logits: Tensor, ids: Tensor, *, temperature: float = 1.0, return_entropy: bool = False):
    """Per-token log-probabilities of `ids` under softmax(logits / temperature).

    Args:
        logits: (..., V) float32, bfloat16 or float16. Never copied to fp32 as a whole.
        ids: (...) integer token ids in [0, V).
        temperature: softmax temperature (> 0).
        return_entropy: also return the entropy of softmax(logits / temperature).

    Returns:
        logp (...) float32, or (logp, entropy) both (...) float32. Differentiable w.r.t. `logits`
        through both outputs. The backward writes dlogits into the logits buffer when `logits` is not
        a leaf tensor (see module docstring).
    """
    check_float(logits, "logits")
    if logits.dim() < 1:
        raise ValueError("logits must have at least one dimension (..., V)")
    temperature = check_temperature(temperature)
    vocab = logits.shape[-1]
    lead = logits.shape[:-1]
    flat_ids = check_ids(ids, lead, vocab, logits.device)
    rows = logits.reshape(-1, vocab)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    logp, _, entropy = _token_logprobs_op(rows, flat_ids, temperature, bool(return_entropy))
    if return_entropy:
        return logp.view(lead), entropy.view(lead)
    return logp.view(lead)
