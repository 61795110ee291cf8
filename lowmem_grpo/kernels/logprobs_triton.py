"""Triton kernels for the fused log-softmax-gather (and entropy) over rows of logits.

Per row x = logits / T (fp32 math; the row stays in its own dtype in memory):
  forward   logp = x[y] - lse(x),   H = -sum softmax(x) * log softmax(x)
            online logsumexp over vocab blocks: read N*V elements once, write a few floats per row
            (the naive version reads N*V, writes N*V fp32 log-probs, and reads them back to gather).
  backward  dlogits = (g * (onehot(y) - p) - g_H * p * (log p + H)) / T,   p = exp(x - lse)
            read N*V, write N*V in place into the logits buffer: no second [N, V] tensor.

Both kernels also work on a vocabulary *slice* of a row ([N, n_cols] starting at column
`col_offset`): the forward merges the slice into running statistics, the backward writes the slice
of dlogits. That is how the fused lm-head ops (linear.py) reuse them on one [N, chunk] slice at a time.

The fused head's slices are raw GEMM outputs z: x = cap(z + bias) / T, the bias added in fp32 (`has_bias`)
and cap(u) = c tanh(u / c) when softcap = c > 0; the backward then returns dL/dz. Design notes: docs/kernels.md
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._backend import launch_guard

MAX_BLOCK_V = 4096


@triton.jit
def load_x(row_ptr, bias_ptr, cols, valid, has_bias, softcap, inv_temp):
    """x = cap(z + bias) * inv_temp for the columns `cols` of a row (-inf where not `valid`), fp32.
    bias_ptr points at this slice's first bias entry; read only when has_bias != 0; no cap when softcap == 0."""
    x = tl.load(row_ptr + cols, mask=valid, other=float("-inf")).to(tl.float32)
    if has_bias != 0:
        x += tl.load(bias_ptr + cols, mask=valid, other=0.0)
    if softcap > 0.0:  # c tanh(u / c) = c (2 sigmoid(2 u / c) - 1); columns past the row stay -inf
        x = tl.where(valid, softcap * (2.0 * tl.sigmoid(2.0 * x / softcap) - 1.0), float("-inf"))
    return x * inv_temp


@triton.jit
def row_stats(row_ptr, bias_ptr, y, n_cols, has_bias, softcap, inv_temp, HAS_ENTROPY: tl.constexpr,
              BLOCK_V: tl.constexpr):
    """One pass over a row: m = max x, s = sum exp(x - m), t = sum exp(x - m) * (x - m), and x[y]
    (0 when y is not a column of this row). x = cap(logits + bias) * inv_temp (load_x), in fp32.
    Then lse = m + log s and the entropy H = log s - t / s: taking t about m (not about 0) keeps H
    free of the cancellation between lse and E[x], which are ~10 while H may be ~1e-3."""
    m = float("-inf")
    s = 0.0
    t = 0.0
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = load_x(row_ptr, bias_ptr, cols, cols < n_cols, has_bias, softcap, inv_temp)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        # While every column so far is -inf (banned tokens), m_new is -inf too: shift by 0 instead, so
        # exp never sees -inf - -inf (NaN); s and t stay 0 until a finite column arrives.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        scale = tl.exp(m - m_ref)
        e = tl.exp(x - m_ref)
        if HAS_ENTROPY:
            # re-centre t on m_ref; e == 0 where x == -inf (and s == 0 before the first finite block):
            # select first so that 0 * -inf never forms a NaN
            shift = tl.where(s > 0, m - m_ref, 0.0)
            t = scale * (t + shift * s) + tl.sum(e * tl.where(e > 0, x - m_ref, 0.0), axis=0)
        s = s * scale + tl.sum(e, axis=0)
        m = m_new
    in_row = (y >= 0) & (y < n_cols)
    x_y = tl.where(in_row, load_x(row_ptr, bias_ptr, tl.where(in_row, y, 0), in_row, has_bias, softcap, inv_temp),
                   0.0)
    return m, s, t, x_y


@triton.jit
def logits_stats_kernel(
    logits_ptr, ids_ptr,  # data: logits [N, n_cols] (unit column stride), ids [N] int64
    bias_ptr,  # (V,) fp32 bias, read from col_offset on when has_bias != 0
    m_ptr, s_ptr, t_ptr, xy_ptr,  # running statistics [N] fp32: read if ACCUMULATE, always written
    stride_row, n_cols, col_offset,  # strides and sizes (col_offset: first vocab id of this slice)
    has_bias, softcap: tl.float32, inv_temp: tl.float32,  # constants (typed fp32: never specialised to fp64)
    ACCUMULATE: tl.constexpr, HAS_ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    y = tl.load(ids_ptr + row) - col_offset
    m, s, t, x_y = row_stats(logits_ptr + row * stride_row, bias_ptr + col_offset, y, n_cols, has_bias, softcap,
                             inv_temp, HAS_ENTROPY, BLOCK_V)
    if ACCUMULATE:  # merge with the statistics of the slices before this one
        m_prev = tl.load(m_ptr + row)
        m_new = tl.maximum(m_prev, m)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # both sides all -inf so far: no NaN
        a = tl.exp(m_prev - m_ref)
        b = tl.exp(m - m_ref)
        s_prev = tl.load(s_ptr + row)
        if HAS_ENTROPY:  # a side without mass (a or b == 0) adds nothing, not 0 * -inf
            t_prev = tl.load(t_ptr + row)
            t = (tl.where(a > 0, a * (t_prev + (m_prev - m_ref) * s_prev), 0.0)
                 + tl.where(b > 0, b * (t + (m - m_ref) * s), 0.0))
        s = s_prev * a + s * b
        x_y = tl.load(xy_ptr + row) + x_y
        m = m_new
    tl.store(m_ptr + row, m)
    tl.store(s_ptr + row, s)
    if HAS_ENTROPY:
        tl.store(t_ptr + row, t)
    tl.store(xy_ptr + row, x_y)


@triton.jit
def logits_grad_kernel(
    logits_ptr, ids_ptr,  # data: logits [N, n_cols], overwritten in place with dlogits; ids [N]
    bias_ptr,  # (V,) fp32 bias, read from col_offset on when has_bias != 0
    lse_ptr, grad_ptr, ent_ptr, grad_ent_ptr,  # per row fp32: lse, dL/dlogp, entropy, dL/dH
    stride_row, n_cols, col_offset,  # strides and sizes
    has_bias, softcap: tl.float32, inv_temp: tl.float32,  # constants
    HAS_ENT_GRAD: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    g = tl.load(grad_ptr + row)
    skip = g == 0.0
    if HAS_ENT_GRAD:
        g_ent = tl.load(grad_ent_ptr + row)
        ent = tl.load(ent_ptr + row)
        skip = skip & (g_ent == 0.0)
    if skip:  # masked or unused row: its gradient is zero, write it without reading the row
        for start in range(0, n_cols, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            tl.store(row_ptr + cols, tl.zeros([BLOCK_V], dtype=row_ptr.dtype.element_ty), mask=cols < n_cols)
        return
    lse = tl.load(lse_ptr + row)
    y = tl.load(ids_ptr + row) - col_offset
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        valid = cols < n_cols
        x = load_x(row_ptr, bias_ptr + col_offset, cols, valid, has_bias, 0.0, 1.0)  # z + bias
        dcap = tl.full([BLOCK_V], 1.0, tl.float32)  # d cap(u) / du
        if softcap > 0.0:  # tanh(a / 2) = 2 sigmoid(a) - 1, d/du c tanh(u / c) = 4 sigmoid(a) sigmoid(-a)
            a = 2.0 * x / softcap
            sig = tl.sigmoid(a)
            dcap = 4.0 * sig * tl.sigmoid(-a)  # not 1 - tanh^2, which cancels where the cap saturates
            x = tl.where(valid, softcap * (2.0 * sig - 1.0), float("-inf"))
        x = x * inv_temp
        p = tl.exp(x - lse)
        dx = tl.where(cols == y, g, 0.0) - g * p
        if HAS_ENT_GRAD:  # dH/dx_j = -p_j * (log p_j + H)
            dx -= g_ent * p * tl.where(p > 0, x - lse + ent, 0.0)
        dx *= inv_temp * dcap
        tl.store(row_ptr + cols, dx.to(row_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=valid)


def block_config(n_cols: int) -> tuple[int, int]:
    """(BLOCK_V, num_warps) for rows of n_cols elements: the one rule every row-kernel launcher uses."""
    block = min(triton.next_power_of_2(n_cols), MAX_BLOCK_V)
    return block, (8 if block >= 2048 else 4)


def block_configs() -> list[tuple[int, int]]:
    """Every (BLOCK_V, num_warps) that block_config can return, smallest block first: what ahead-of-time
    compilation (aot.py) compiles. block_config sees n_cols only through next_power_of_2, capped at
    MAX_BLOCK_V, so the powers of two 1 .. MAX_BLOCK_V stand for every row width (a fused-head slice can
    be as narrow as 1 column: chunk_size=1, or the last slice of a vocabulary)."""
    return sorted({block_config(1 << k) for k in range(MAX_BLOCK_V.bit_length())})


def logits_stats(
    logits: torch.Tensor, ids: torch.Tensor, stats: tuple[torch.Tensor, ...],
    *, col_offset: int, inv_temp: float, accumulate: bool, with_entropy: bool, bias: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> None:
    """Fill (or merge into) stats = (m, s, t, x_y) for the rows of `logits` [N, n_cols]."""
    n_rows, n_cols = logits.shape
    block, warps = block_config(n_cols)
    m, s, t, x_y = stats
    with launch_guard(logits):
        logits_stats_kernel[(n_rows,)](
            logits, ids, m if bias is None else bias, m, s, t, x_y, logits.stride(0), n_cols, col_offset,
            int(bias is not None), softcap, inv_temp,
            ACCUMULATE=accumulate, HAS_ENTROPY=with_entropy, BLOCK_V=block, num_warps=warps,
        )


def logits_grad_(
    logits: torch.Tensor, ids: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor,
    entropy: torch.Tensor | None, grad_entropy: torch.Tensor | None, *, col_offset: int, inv_temp: float,
    bias: torch.Tensor | None = None, softcap: float = 0.0,
) -> None:
    """Overwrite `logits` [N, n_cols] with dL/dlogits."""
    n_rows, n_cols = logits.shape
    block, warps = block_config(n_cols)
    has_ent = grad_entropy is not None
    with launch_guard(logits):
        logits_grad_kernel[(n_rows,)](
            logits, ids, lse if bias is None else bias, lse, grad, entropy if has_ent else lse,
            grad_entropy if has_ent else grad, logits.stride(0), n_cols, col_offset, int(bias is not None), softcap,
            inv_temp,
            HAS_ENT_GRAD=has_ent, BLOCK_V=block, num_warps=warps,
        )
