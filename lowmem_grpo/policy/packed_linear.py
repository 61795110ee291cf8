"""Linear weights packed once per rollout into oneDNN's blocked layout, for CPU decoding.

A CPU decode step is GEMM-bound, and torch's F.linear re-lays out each weight for the GEMM on every call.
`packed_linears(model, ...)` packs every nn.Linear's weight (the tied output head's once), or with
`head_only` the output head's alone (the large GEMM whose plain fp32 call is slowest where rows are few),
with torch.ops.mkldnn._reorder_linear_weight and, inside the block, runs those layers through
torch.ops.mkldnn._linear_pointwise on the packed copy. `auto` packs every Linear where this CPU's packed
GEMMs run the model's decode GEMMs >= PACK_MIN_SPEEDUP x F.linear's (`packed_gemm_speedup`, measured once
per process). The weights change after every optimizer step, so the copies are made per rollout and freed
when the block ends. Under bf16 autocast the copies hold bf16 values (rounded as autocast rounds them) and
the layers return bf16, as autocast's linear does. Where the CPU has no oneDNN bf16 GEMM, bf16 values are
packed and multiplied in fp32 (`gemm_dtype`) and each output rounded to bf16 once, as a bf16 F.linear
rounds its fp32 sums. The copies' host bytes while they live: `packed_bytes`. Design notes: docs/rollouts.md
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from collections import Counter
from typing import Iterator, Optional, Union

import torch
from torch import Tensor, nn

log = logging.getLogger(__name__)


def _packed_dtype(weight: Tensor, autocast_bf16: bool) -> torch.dtype:
    return torch.bfloat16 if autocast_bf16 and weight.dtype == torch.float32 else weight.dtype


def gemm_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a packed copy holding `dtype` values is made and multiplied in: fp32 for bf16 values on a
    CPU without oneDNN's bf16 GEMM (the values widened exactly), else `dtype`."""
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return torch.float32
    return dtype


def _linears(model: nn.Module, head_only: bool) -> list[nn.Linear]:
    """The layers packed_linears packs: every nn.Linear, or the output head alone (none where the head is
    no nn.Linear)."""
    if head_only:
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        return [head] if isinstance(head, nn.Linear) else []
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


def pack_problem(model: nn.Module, device: torch.device, autocast_bf16: bool = False,
                 head_only: bool = False) -> Optional[str]:
    """Why the Linear weights of `model` (its output head's, with `head_only`) cannot be packed for decoding
    on `device`, or None."""
    if device.type != "cpu":
        return f"packed weights are a CPU path (device {device.type})"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    if head_only and not _linears(model, True):
        return "the model's output head is no nn.Linear"
    dtypes = {_packed_dtype(m.weight, autocast_bf16) for m in _linears(model, head_only)}
    if not dtypes:
        return "the model has no Linear layers"
    if not dtypes <= {torch.float32, torch.bfloat16}:
        return f"Linear weights of dtype {sorted(map(str, dtypes))} (packing takes fp32 or bf16)"
    return None


_logged: set[str] = set()


# generation.pack_decode_weights=auto packs every Linear where the packed GEMMs of the model's shapes run at
# least this much faster than F.linear's: the copies cost a pass over the weights per rollout and their bytes.
PACK_MIN_SPEEDUP = 1.1
_MEASURED_OUT = 16384  # output rows a shape is measured at (a larger head's time is scaled up from them)


def linear_shapes(model: nn.Module) -> tuple[tuple[int, int, int], ...]:
    """(out, in, count) of every distinct Linear weight shape of `model` (a shared weight counted once)."""
    weights = {id(m.weight): m.weight for m in _linears(model, False)}
    return tuple((o, i, n) for (o, i), n in sorted(Counter(tuple(w.shape) for w in weights.values()).items()))


@functools.lru_cache(maxsize=None)
@torch.no_grad()
@torch.autocast("cpu", enabled=False)
def packed_gemm_speedup(shapes: tuple[tuple[int, int, int], ...], rows: int, dtype: torch.dtype,
                        threads: int) -> float:
    """F.linear's seconds over the packed GEMM's for one decode step's GEMMs: each (out, in, count) shape
    at `rows` rows in `dtype` on random weights (out capped at 16384 rows and the time scaled up; the packed
    GEMM in `gemm_dtype(dtype)`, widening and rounding included), the fastest of 4 alternated calls times
    `count`. About 0.3-0.6 s for SmolLM2-135M on 2 cores; measured
    once per process, shapes, rows, dtype and thread count."""
    g = torch.Generator().manual_seed(0)
    gemm = gemm_dtype(dtype)
    plain = packed = 0.0
    for out, inner, count in shapes:
        measured = min(out, _MEASURED_OUT)
        x = torch.randn(rows, inner, generator=g).to(dtype)
        w = (torch.randn(measured, inner, generator=g) * 0.02).to(dtype)
        p = torch.ops.mkldnn._reorder_linear_weight(w.to(gemm), rows)
        forward = _packed_forward(p, None, dtype, gemm)
        calls = (lambda: nn.functional.linear(x, w), lambda: forward(x))
        best = [float("inf")] * 2
        for _ in range(4):
            for k, call in enumerate(calls):
                start = time.perf_counter()
                call()
                best[k] = min(best[k], time.perf_counter() - start)
        plain += best[0] * count * out / measured
        packed += best[1] * count * out / measured
    return plain / packed


def auto_packing_forced() -> Optional[bool]:
    """generation.pack_decode_weights=auto as LOWMEM_GRPO_PACK_DECODE=1/0 decides it without measuring (the
    test suite sets 0), or None where it is unset."""
    forced = os.environ.get("LOWMEM_GRPO_PACK_DECODE")
    return None if forced not in ("0", "1") else forced == "1"


def _packing_pays(model: nn.Module, rows: int, autocast_bf16: bool) -> bool:
    """generation.pack_decode_weights=auto on a CPU where packing is possible: whether it pays here
    (`auto_packing_forced`, else measured)."""
    if (forced := auto_packing_forced()) is not None:
        return forced
    dtype = _packed_dtype(next(m.weight for m in _linears(model, False)), autocast_bf16)
    threads = torch.get_num_threads()
    speedup = packed_gemm_speedup(linear_shapes(model), min(max(rows, 1), 64), dtype, threads)
    pays = speedup >= PACK_MIN_SPEEDUP
    message = (f"generation.pack_decode_weights auto: packed weights {'on' if pays else 'off'} (this CPU's "
               f"packed {str(dtype).removeprefix('torch.')} GEMMs ran the decode's at {speedup:.2f}x F.linear's "
               f"with {threads} threads; on from {PACK_MIN_SPEEDUP:.2f}x)")
    if message not in _logged:
        _logged.add(message)
        log.info(message)
    return pays


def use_packed(model: nn.Module, wanted: Union[bool, str], device: torch.device,
               autocast_bf16: bool = False, rows: int = 64) -> Union[bool, str]:
    """generation.pack_decode_weights (false, true: every Linear, "head", or "auto") as `sample`'s packed:
    `wanted` where `pack_problem` finds nothing, else False (the reason logged once). auto: True on a CPU
    where packing is possible and pays for a decode of `rows` rows (`_packing_pays`), else False (silently:
    nothing was asked for)."""
    if wanted == "auto":
        if device.type != "cpu" or pack_problem(model, device, autocast_bf16):
            return False
        return _packing_pays(model, rows, autocast_bf16)
    problem = pack_problem(model, device, autocast_bf16, head_only=wanted == "head") if wanted else None
    if problem and problem not in _logged:
        _logged.add(problem)
        log.warning("generation.pack_decode_weights: decoding with the weights as they are: %s", problem)
    return wanted if problem is None else False


def packed_bytes(model: nn.Module, autocast_bf16: bool = False, head_only: bool = False) -> int:
    """Host bytes of the packed copies `packed_linears` makes of `model`'s Linear weights (the output head's
    alone with `head_only`; a weight shared by several layers counted once) in `gemm_dtype`, the bias copies
    (under autocast, or widened) included."""
    seen: dict[int, int] = {}
    for m in _linears(model, head_only):
        for p in (m.weight, m.bias):
            if p is not None and id(p) not in seen:
                values = _packed_dtype(p, autocast_bf16)
                gemm = gemm_dtype(values)
                copied = p is m.weight or values != p.dtype or gemm != p.dtype
                seen[id(p)] = p.numel() * gemm.itemsize if copied else 0
    return sum(seen.values())


def _packed_forward(weight: Tensor, bias: Optional[Tensor], dtype: torch.dtype, gemm: torch.dtype):
    """The layer's forward on a packed copy in `gemm` of `dtype` values: inputs rounded to `dtype` (as autocast
    rounds them) and widened to `gemm`, the output in `dtype`. Where `gemm` is `dtype` the input is converted
    only when its dtype differs (a `.to` that returns its input still costs a dispatch, ~2 us, and a decode
    step makes ~200 layer calls)."""
    linear = torch.ops.mkldnn._linear_pointwise.default
    if gemm == dtype:
        return lambda x: linear(x if x.dtype == dtype else x.to(dtype), weight, bias, "none", [], "")
    return lambda x: linear(x.to(dtype).to(gemm), weight, bias, "none", [], "").to(dtype)


@contextlib.contextmanager
def packed_linears(model: nn.Module, batch_hint: int, autocast_bf16: bool = False,
                   head_only: bool = False) -> Iterator[int]:
    """Inside the block every nn.Linear of `model` (its output head alone, with `head_only`) runs on a
    packed copy of its weight; yields the copies' bytes. `batch_hint`: the rows a decode step runs (oneDNN
    picks the blocking for it; any row count works). Only for inference (no autograd through the packed
    op): callers run it under no_grad. Raises ValueError where `pack_problem` names a reason."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    problem = pack_problem(model, device, autocast_bf16, head_only)
    if problem:
        raise ValueError(f"packed decode weights: {problem}; set generation.pack_decode_weights=false")
    made: dict[int, Tensor] = {}  # one packed copy of a weight that two layers share (tied head)
    swapped = []
    with torch.no_grad():
        for m in _linears(model, head_only):
            dtype = _packed_dtype(m.weight, autocast_bf16)
            gemm = gemm_dtype(dtype)
            if id(m.weight) not in made:
                made[id(m.weight)] = torch.ops.mkldnn._reorder_linear_weight(
                    m.weight.detach().to(dtype).to(gemm), batch_hint)
            bias = None if m.bias is None else m.bias.detach().to(dtype).to(gemm)
            swapped.append((m, m.__dict__.get("forward")))
            m.forward = _packed_forward(made[id(m.weight)], bias, dtype, gemm)
    try:
        yield packed_bytes(model, autocast_bf16, head_only)
    finally:
        for m, before in swapped:
            if before is None:
                del m.forward
            else:
                m.forward = before
        made.clear()
