"""Tolerance rule: an op computed in dtype D must be as close to the fp32 spec (lowmem_grpo/kernels/spec.py) as
the spec itself computed in D is (plus a small floor for fp32, where that distance is 0)."""

import torch

from lowmem_grpo.kernels import get_backend
from lowmem_grpo.kernels._backend import interpreter_enabled


def max_abs_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach().double() - b.detach().double()).abs().max().item() if a.numel() else 0.0


def interpreter_rounding_ulps(t: torch.Tensor) -> int:
    """The Triton interpreter truncates fp32 -> bf16/fp16 stores where GPUs round to nearest, so an
    interpreted kernel's low-precision outputs may sit one ulp further from the truth."""
    interpreted = get_backend() == "triton" and t.device.type == "cpu" and interpreter_enabled()
    return 1 if interpreted and t.dtype in (torch.bfloat16, torch.float16) else 0


def _ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    mantissa = {torch.bfloat16: 7, torch.float16: 10}[dtype]
    exponent = torch.floor(torch.log2(x.abs().clamp(min=torch.finfo(dtype).tiny)))
    return torch.pow(2.0, exponent - mantissa)


def assert_as_close_as_low_precision(actual, ref32, ref_low=None, *, floor: float = 2e-5, factor: float = 1.0,
                                     name: str = "value"):
    """max |actual - ref32| <= factor * max |ref_low - ref32| + floor * max(1, max |ref32|)."""
    assert actual.shape == ref32.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(ref32.shape)}"
    if not actual.numel():
        return
    diff = (actual.detach().double() - ref32.detach().double()).abs()
    ulps = interpreter_rounding_ulps(actual)
    if ulps:
        diff = (diff - ulps * _ulp(ref32.detach().double(), actual.dtype)).clamp(min=0)
    err = diff.max().item()
    ref_err = 0.0 if ref_low is None else max_abs_err(ref_low, ref32)
    scale = max(1.0, ref32.detach().abs().max().item())
    bound = factor * ref_err + floor * scale
    assert err <= bound, f"{name}: max error {err:.3e} > bound {bound:.3e} (spec in low precision: {ref_err:.3e})"
