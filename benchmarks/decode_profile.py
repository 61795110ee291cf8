"""Where a decode step's time goes, and the GEMM-only bound it is held to (used by rollout_speed.py).

`gemm_bound(model, rows, dtype)`: one decode step's bare GEMMs, every Linear layer's weight (the output
head's included, once per step as with logits_to_keep=1) times a (rows, in_features) input through
torch.matmul, in fp32 or bf16 (with `packed`, the same GEMMs on weights packed once into oneDNN's layout,
as generation.pack_decode_weights runs them, bf16 widened to fp32 where the CPU has no bf16 GEMM): the
seconds of the fastest of `repeats` steps. rows / seconds is the tokens/s a decode loop could reach if
GEMMs were all it did; a path's tokens/s over it is its "fraction of the GEMM bound".
`profile_parts(fn, model)`: torch.profiler over fn(), its ops' self CPU time split into GEMM (mm, addmm,
matmul, linear, the packed oneDNN/MKL linears), attention (sdpa and its kernels), the model's other ops
(norms, rotary, activations, cache writes: ops inside a model forward), sampling and loop (ops outside the
model forward: logits processing, the draw, slot bookkeeping), and what no op covers (Python, waits).
`op_census(fn, model)`: the dispatcher ops fn() runs (after autograd and composite ops are resolved, as a
TorchDispatchMode sees them), per decode step's forward (a forward of one input column) by kind and name,
and per step outside the forward; a step's cost per op is what no faster GEMM removes.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lowmem_grpo.policy.packed_linear import gemm_dtype

GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "mkldnn::_linear_pointwise",
            "mkl::_mkl_linear", "aten::_mkldnn_linear", "aten::mkldnn_linear"}
FORWARD_LABEL = "## model forward"


def linear_shapes(model) -> list[tuple[int, int]]:
    """(out_features, in_features) of every Linear layer the decode step runs once per step."""
    return [(m.out_features, m.in_features) for m in model.modules() if isinstance(m, torch.nn.Linear)]


@torch.no_grad()
def gemm_bound(model, rows: int, dtype: torch.dtype, repeats: int = 3, packed: bool = False) -> float:
    """Seconds of one decode step's bare GEMMs at `rows` rows in `dtype` (the fastest of `repeats`);
    `packed`: through oneDNN's packed weights (torch.ops.mkldnn._linear_pointwise) in packed_linear.gemm_dtype,
    the widening of bf16 inputs and the rounding of outputs included where that is fp32."""
    shapes = linear_shapes(model)
    weights = [torch.randn(o, i, dtype=dtype) * 0.02 for o, i in shapes]  # (out, in), as nn.Linear holds them
    inputs = {i: torch.randn(rows, i, dtype=dtype) for _, i in shapes}
    if packed:
        wide = gemm_dtype(dtype)
        weights = [(w.shape[1], torch.ops.mkldnn._reorder_linear_weight(w.to(wide), rows)) for w in weights]
        gemm = lambda inner, p: torch.ops.mkldnn._linear_pointwise(inputs[inner].to(wide), p, None, "none", [],
                                                                   "").to(dtype)
    else:
        weights = [(w.shape[1], w) for w in weights]
        gemm = lambda inner, w: torch.matmul(inputs[inner], w.t())
    best = float("inf")
    for _ in range(repeats + 1):  # the first call warms up
        t0 = time.perf_counter()
        for inner, w in weights:
            gemm(inner, w)
        best = min(best, time.perf_counter() - t0)
    return best


def step_gflop(model, rows: int) -> float:
    return sum(2 * rows * o * i for o, i in linear_shapes(model)) / 1e9


def profile_parts(fn: Callable[[], object], model) -> dict[str, float]:
    """Seconds of fn() by part: gemm, attention, model_other, sampling_loop, untraced (wall minus ops)."""
    from torch.profiler import ProfilerActivity, profile, record_function
    entered = []
    pre = model.register_forward_pre_hook(lambda *_: entered.append(record_function(FORWARD_LABEL).__enter__()))
    post = model.register_forward_hook(lambda *_: entered.pop().__exit__(None, None, None))
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            fn()
            wall = time.perf_counter() - t0
    finally:
        pre.remove()
        post.remove()
    parts = dict.fromkeys(("gemm", "attention", "model_other", "sampling_loop"), 0.0)
    for e in prof.events():
        if e.name == FORWARD_LABEL:
            continue
        seconds = e.self_cpu_time_total / 1e6
        parent, in_forward = e.cpu_parent, False
        while parent is not None and not in_forward:
            in_forward, parent = parent.name == FORWARD_LABEL, parent.cpu_parent
        if e.name in GEMM_OPS:
            parts["gemm"] += seconds
        elif "scaled_dot_product" in e.name or "flash_attention" in e.name:
            parts["attention"] += seconds
        else:
            parts["model_other" if in_forward else "sampling_loop"] += seconds
    parts["untraced"] = max(wall - sum(parts.values()), 0.0)
    parts["wall"] = wall
    return parts


VIEW_OPS = {"view", "reshape", "_reshape_alias", "slice", "select", "transpose", "unsqueeze", "squeeze", "expand",
            "as_strided", "narrow", "permute", "alias", "t", "split", "unbind", "_unsafe_view", "detach"}


class _Counting(TorchDispatchMode):
    """Counts each op by name into `step` while a decode forward runs, else into `other`."""

    def __init__(self):
        super().__init__()
        self.step, self.other, self.in_step = Counter(), Counter(), False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        (self.step if self.in_step else self.other)[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def op_census(fn: Callable[[], object], model) -> dict:
    """The ops of fn()'s decode steps: {"steps", "per_step", "per_layer" (per_step over the decoder layers: the
    embedding, final norm and head included), "by_kind" (gemm, view, other per step), "by_name" (per step, most
    first), "outside_forward_per_step"}. A decode step is a forward of the model whose input_ids (or
    inputs_embeds) have one column; prefills and sampling are counted outside."""
    counting, steps = _Counting(), [0]

    def enter(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        ids = ids if ids is not None else kwargs.get("inputs_embeds")
        counting.in_step = ids is not None and ids.shape[1] == 1
        steps[0] += counting.in_step

    def leave(*_):
        counting.in_step = False

    pre = model.register_forward_pre_hook(enter, with_kwargs=True)
    post = model.register_forward_hook(leave)
    try:
        with counting:
            fn()
    finally:
        pre.remove()
        post.remove()
    n, layers = max(steps[0], 1), model.config.get_text_config().num_hidden_layers
    gemm_names = {op.split("::")[-1] for op in GEMM_OPS}
    kinds = Counter()
    for name, count in counting.step.items():
        kinds["gemm" if name in gemm_names else "view" if name in VIEW_OPS else "other"] += count / n
    total = sum(counting.step.values()) / n
    return {"steps": steps[0], "per_step": total, "per_layer": total / layers, "by_kind": dict(kinds),
            "by_name": {k: v / n for k, v in counting.step.most_common()},
            "outside_forward_per_step": sum(counting.other.values()) / n}
