"""linear_token_logprobs: the lm_head fused in. Log-probs from hidden states, [N, V] logits a slice at a time.

    linear_token_logprobs(hidden (N, H), weight (V, H), ids (N,)) -> logp (N,)
        = log_softmax(cap(hidden @ weight.T + bias) / T).gather(ids),  cap(z) = c tanh(z / c) or z

Both passes loop over *vocabulary slices* of width `chunk_size`; each slice is one GEMM for all N tokens
into a reused [N, chunk] workspace, then a row kernel over it that adds the bias in fp32 and soft-caps:
  forward   logits_s = h @ W_s^T; merge it into online-softmax statistics (m, s, t, x_y); saves lse (entropy)
  backward  recompute logits_s (or copy the kept one), turn it into dlogits_s in place, then
            dW_s = dlogits_s^T @ h   exact in one GEMM, written once into dW[v0:v1] (weight dtype)
            dh  += dlogits_s @ W_s   accumulated across slices in fp32 [N, H] (each slice's
                                     product leaves the GEMM in the compute dtype)
            db_s = sum_n dlogits_s
The only (V, H) allocation is dW itself, and no (N, V) tensor exists but where the CPU keeps the logits for
the backward (`keep_logits_fits`), which then skips the recompute. Design notes: docs/kernels.md
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ._backend import keep_logits_bytes, workspace_bytes
from ._checks import check_float, check_ids, check_temperature
from .logprobs import finalize_stats, logits_grad_, logits_stats, new_stats


def default_chunk_size(n_rows: int, vocab: int, device_type: str) -> int:
    """Vocabulary slice width so that one [n_rows, chunk] fp32 slice stays within the workspace bound of
    `device_type` ("cpu", "cuda", ...; _backend.workspace_bytes)."""
    chunk = workspace_bytes(device_type) // (4 * max(n_rows, 1))
    return max(1, min(vocab, max(256, chunk // 256 * 256)))


def keep_logits_fits(n_rows: int, vocab: int, element_size: int, device_type: str) -> bool:
    """Whether a differentiated forward keeps its [n_rows, vocab] logits (element_size bytes each) for the
    backward: where they fit the device type's keep bound (_backend.keep_logits_bytes; 0 off the CPU)."""
    return 0 < n_rows * vocab * element_size <= keep_logits_bytes(device_type)


def _slices(vocab: int, chunk: int):
    return [(v0, min(vocab, v0 + chunk)) for v0 in range(0, vocab, chunk)]


def _slice_logits(hidden: Tensor, weight: Tensor, v0: int, v1: int, workspace: Tensor) -> Tensor:
    """hidden @ weight[v0:v1].T into the workspace, in hidden's dtype: [N, v1 - v0] (the bias is the row
    kernels' to add, in fp32)."""
    out = workspace[: hidden.shape[0] * (v1 - v0)].view(hidden.shape[0], v1 - v0)
    w = weight[v0:v1].to(hidden.dtype)  # a no-op unless autocast mixes dtypes (then a [chunk, H] copy)
    return torch.mm(hidden, w.t(), out=out)


def _fp32(bias: Optional[Tensor]) -> Optional[Tensor]:
    return None if bias is None else bias.to(torch.float32).contiguous()  # (V,): a copy only when not fp32


@torch.library.custom_op("lowmem_grpo::linear_token_logprobs", mutates_args=())
def _linear_logprobs_op(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], ids: Tensor, temperature: float,
                        with_entropy: bool, chunk_size: int, softcap: float,
                        keep: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """hidden [N, H], weight [V, H], bias [V] | None, ids [N] -> (logp, lse, entropy, kept): logp, lse and
    entropy [N] fp32; kept: with `keep`, the GEMM's logits [N * V] in hidden's dtype, slice after slice
    (slice [v0, v1) is [N, v1 - v0] at offset N * v0), else empty. softcap: c > 0 soft-caps the logits
    (c tanh(z / c)) before the temperature; 0: no cap."""
    n, vocab = hidden.shape[0], weight.shape[0]
    stats = new_stats(n, hidden.device)
    kept = hidden.new_empty(n * vocab if keep else 0)  # written in place of a workspace when kept
    workspace = None if keep else hidden.new_empty(n * min(chunk_size, vocab))
    bias32 = _fp32(bias)
    with torch.autocast(hidden.device.type, enabled=False):  # dtypes are settled by the caller
        for i, (v0, v1) in enumerate(_slices(vocab, chunk_size)):
            logits = _slice_logits(hidden, weight, v0, v1, kept[n * v0:] if keep else workspace)
            logits_stats(logits, ids, stats, col_offset=v0, inv_temp=1.0 / temperature,
                         accumulate=i > 0, with_entropy=with_entropy, bias=bias32, softcap=softcap)
    lse, logp, entropy = finalize_stats(stats)
    return logp, lse, entropy if with_entropy else torch.zeros_like(lse), kept


@_linear_logprobs_op.register_fake
def _(hidden, weight, bias, ids, temperature, with_entropy, chunk_size, softcap, keep=False):
    rows = tuple(hidden.new_empty(hidden.shape[0], dtype=torch.float32) for _ in range(3))
    return (*rows, hidden.new_empty(hidden.shape[0] * weight.shape[0] if keep else 0))


@torch.library.custom_op("lowmem_grpo::linear_token_logprobs_backward", mutates_args=())
def _linear_logprobs_backward_op(
    hidden: Tensor, weight: Tensor, bias: Optional[Tensor], ids: Tensor, lse: Tensor, grad_logp: Tensor,
    entropy: Optional[Tensor], grad_entropy: Optional[Tensor], temperature: float, chunk_size: int, softcap: float,
    need_hidden: bool, need_weight: bool, need_bias: bool, kept: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """-> (d hidden [N, H], d weight [V, H], d bias [V]); an empty tensor for each gradient not needed.
    `kept`: the forward's kept logits (its fourth output, with the same chunk_size), each slice copied into
    the workspace instead of recomputed (`kept` is left as it is); None or empty: recompute."""
    n, vocab = hidden.shape[0], weight.shape[0]
    grad_h = torch.zeros(n, hidden.shape[1], dtype=torch.float32, device=hidden.device) if need_hidden else None
    grad_w = torch.empty_like(weight) if need_weight else None
    grad_b = torch.empty(vocab, dtype=torch.float32, device=hidden.device) if need_bias else None
    kept = kept if kept is not None and kept.numel() else None
    if kept is not None and kept.numel() != n * vocab:
        raise ValueError(f"kept logits hold {kept.numel()} elements, not N * V = {n * vocab}")
    workspace = hidden.new_empty(n * min(chunk_size, vocab))
    bias32 = _fp32(bias)
    with torch.autocast(hidden.device.type, enabled=False):
        for v0, v1 in _slices(vocab, chunk_size):
            if kept is not None:  # the forward's slice (a copy: a second backward reads it again), then in place:
                dlogits = workspace[: n * (v1 - v0)].view(n, v1 - v0).copy_(kept[n * v0:n * v1].view(n, v1 - v0))
            else:
                dlogits = _slice_logits(hidden, weight, v0, v1, workspace)  # recompute, then in place:
            logits_grad_(dlogits, ids, lse, grad_logp, entropy, grad_entropy, col_offset=v0,
                         inv_temp=1.0 / temperature, bias=bias32, softcap=softcap)
            if grad_w is not None:
                if grad_w.dtype == hidden.dtype:
                    torch.mm(dlogits.t(), hidden, out=grad_w[v0:v1])
                else:
                    grad_w[v0:v1] = dlogits.t() @ hidden
            if grad_b is not None:
                grad_b[v0:v1] = dlogits.sum(0, dtype=torch.float32)
            if grad_h is not None:
                w = weight[v0:v1].to(hidden.dtype)
                if grad_h.dtype == hidden.dtype:
                    grad_h.addmm_(dlogits, w)
                else:
                    grad_h += dlogits @ w
    # A gradient not needed is an empty tensor, a new one each time: a custom op's outputs may not alias
    # each other (one shared empty tensor fails as soon as two gradients are not needed).
    return (
        hidden.new_empty(0) if grad_h is None else grad_h.to(hidden.dtype),
        hidden.new_empty(0) if grad_w is None else grad_w,
        hidden.new_empty(0) if grad_b is None else grad_b.to(bias.dtype),
    )


@_linear_logprobs_backward_op.register_fake
def _(hidden, weight, bias, ids, lse, grad_logp, entropy, grad_entropy, temperature, chunk_size, softcap,
      need_hidden, need_weight, need_bias, kept=None):
    return (
        torch.empty_like(hidden) if need_hidden else hidden.new_empty(0),
        torch.empty_like(weight) if need_weight else hidden.new_empty(0),
        torch.empty_like(bias) if need_bias else hidden.new_empty(0),
    )


def _setup_context(ctx, inputs, output):
    hidden, weight, bias, ids, temperature, with_entropy, chunk_size, softcap, _keep = inputs
    _, lse, entropy, kept = output
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(kept)
    ctx.save_for_backward(hidden, weight, bias, ids, lse, entropy, kept)
    ctx.temperature, ctx.with_entropy, ctx.chunk_size, ctx.softcap = temperature, with_entropy, chunk_size, softcap


def _backward(ctx, grad_logp, grad_lse, grad_entropy, _grad_kept):
    hidden, weight, bias, ids, lse, entropy, kept = ctx.saved_tensors
    need_h, need_w, need_b = ctx.needs_input_grad[:3]
    grad_logp = torch.zeros_like(lse) if grad_logp is None else grad_logp.float().contiguous()
    if not ctx.with_entropy or grad_entropy is None:
        entropy = grad_entropy = None
    else:
        grad_entropy = grad_entropy.float().contiguous()
    gh, gw, gb = _linear_logprobs_backward_op(
        hidden, weight, bias, ids, lse, grad_logp, entropy, grad_entropy, ctx.temperature, ctx.chunk_size,
        ctx.softcap, need_h, need_w, bool(need_b and bias is not None), kept)
    return (gh if need_h else None, gw if need_w else None, gb if (need_b and bias is not None) else None,
            None, None, None, None, None, None)


_linear_logprobs_op.register_autograd(_backward, setup_context=_setup_context)


def check_linear_args(hidden: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """Validate the head's arguments; return hidden in the dtype the GEMMs run in."""
    check_float(hidden, "hidden")
    check_float(weight, "weight")
    if weight.dim() != 2:
        raise ValueError(f"weight must have shape (V, H), got {tuple(weight.shape)}")
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden size {hidden.shape[-1]} does not match weight (V, H) = {tuple(weight.shape)}")
    if hidden.device != weight.device:
        raise ValueError(f"hidden is on {hidden.device} but weight is on {weight.device}")
    if bias is not None:
        check_float(bias, "bias")
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):  # behave like F.linear under autocast
        return hidden.to(torch.get_autocast_dtype(device_type))
    if hidden.dtype != weight.dtype:
        raise TypeError(f"hidden is {hidden.dtype} but weight is {weight.dtype}: cast one of them, "
                        "or run under torch.autocast to mix them")
    return hidden


def check_softcap(softcap: Optional[float]) -> float:
    """The soft cap as the kernels take it: None -> 0.0 (no cap); otherwise a finite value > 0."""
    if softcap is None:
        return 0.0
    if not (isinstance(softcap, (int, float)) and 0.0 < float(softcap) < float("inf")):
        raise ValueError(f"softcap must be a finite number > 0 (a model config's final_logit_softcapping), or None "
                         f"for no cap; got {softcap!r}")
    return float(softcap)


def linear_token_logprobs(hidden: Tensor, weight: Tensor, ids: Tensor, *, bias: Optional[Tensor] = None,
                          temperature: float = 1.0, return_entropy: bool = False, chunk_size: Optional[int] = None,
                          softcap: Optional[float] = None, keep_logits: Optional[bool] = None):
    """Per-token log-probs of `ids` under softmax(cap(hidden @ weight.T + bias) / temperature).

    Args:
        hidden: (B, T, H) or (N, H) float32/bfloat16/float16: the decoder's last hidden states.
        weight: (V, H) the lm_head / tied embedding weight; same dtype as hidden unless under autocast.
        ids: hidden.shape[:-1] integer ids in [0, V).
        bias: optional (V,) lm_head bias.
        temperature: softmax temperature (> 0).
        return_entropy: also return the entropy of each token's distribution.
        chunk_size: vocabulary slice width; default keeps an fp32 [N, chunk] slice within the workspace
            bound: 256 MiB on a GPU, 8 MiB on the CPU (_backend.workspace_bytes).
        softcap: c soft-caps the logits, cap(z) = c tanh(z / c), before the temperature (Gemma 2's
            final_logit_softcapping); None: no cap. The bias is added to the GEMM's output in fp32.
        keep_logits: whether a forward that will be differentiated keeps its [N, V] logits (in the compute
            dtype) for the backward, which then skips recomputing them; None: where they fit the device's
            keep bound (`keep_logits_fits`: 256 MiB on the CPU, never on a GPU). Same result either way.

    Returns:
        logp shaped like ids, fp32 (or (logp, entropy)). Differentiable w.r.t. hidden, weight and bias
        (entropy too). Peak extra memory: one [N, chunk] slice (the [N, V] logits when kept), an fp32 [N, H]
        accumulator and dW; on CPU also the fp32 row-chunk temporaries of the torch path (together within
        the workspace bound).
    """
    hidden = check_linear_args(hidden, weight, bias)
    if hidden.dim() not in (2, 3):
        raise ValueError(f"hidden must have shape (B, T, H) or (N, H), got {tuple(hidden.shape)}")
    temperature = check_temperature(temperature)
    cap = check_softcap(softcap)
    lead, vocab = hidden.shape[:-1], weight.shape[0]
    flat_ids = check_ids(ids, lead, vocab, hidden.device)
    rows = hidden.reshape(-1, hidden.shape[-1]).contiguous()
    chunk = default_chunk_size(rows.shape[0], vocab, rows.device.type) if chunk_size is None else int(chunk_size)
    if chunk < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    differentiated = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (rows, weight, bias))
    if keep_logits is None:
        keep_logits = keep_logits_fits(rows.shape[0], vocab, rows.element_size(), rows.device.type)
    keep = bool(keep_logits) and differentiated
    logp, _, entropy, _ = _linear_logprobs_op(rows, weight, bias, flat_ids, temperature, bool(return_entropy), chunk,
                                              cap, keep)
    if return_entropy:
        return logp.view(lead), entropy.view(lead)
    return logp.view(lead)
