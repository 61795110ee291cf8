"""Argument checks shared by the ops: each error names the problem and the fix."""

from __future__ import annotations

import torch

from torch._subclasses.fake_tensor import is_fake

from ..ranges import TEMPERATURE
from ._backend import debug_checks

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_float(t: torch.Tensor, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")


def check_temperature(temperature: float) -> float:
    return TEMPERATURE.check(temperature, "temperature")  # the config checks the same rule (ranges.py)


def check_shape(t: torch.Tensor | None, shape: tuple[int, ...], name: str, device: torch.device) -> None:
    if t is None:
        return
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the logits/hidden states are on {device}")


def _tracing(t: torch.Tensor) -> bool:
    return torch.compiler.is_compiling() or is_fake(t)


def check_ids(ids: torch.Tensor, shape: tuple[int, ...], vocab_size: int, device: torch.device,
              mask: torch.Tensor | None = None) -> torch.Tensor:
    """Validate token ids and return them as a flat contiguous int64 tensor. Where the bool `mask`
    is False the ids are padding (often -100 or pad) and are replaced by 0."""
    if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise TypeError(f"ids must be an integer tensor, got {getattr(ids, 'dtype', type(ids).__name__)}")
    check_shape(ids, shape, "ids", device)
    if mask is not None:
        ids = ids.masked_fill(~mask, 0)
    ids = ids.reshape(-1).to(torch.int64).contiguous()
    # Out-of-range ids would read outside the logits row. The check costs a device sync on CUDA,
    # so there it runs only in debug mode (LOWMEM_GRPO_DEBUG=1); it cannot run while tracing.
    if ids.numel() and (ids.device.type == "cpu" or debug_checks()) and not _tracing(ids):
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(
                f"ids must lie in [0, {vocab_size}); found values in [{lo}, {hi}]. "
                "Padding ids such as -100 must be masked (pass mask=...) or replaced by a valid id."
            )
    return ids


def check_mask(mask: torch.Tensor | None, shape: tuple[int, ...], device: torch.device) -> torch.Tensor | None:
    """Return the mask as a bool tensor (accepts bool or 0/1 of any dtype)."""
    if mask is None:
        return None
    check_shape(mask, shape, "mask", device)
    if mask.dtype == torch.bool:
        return mask
    if not _tracing(mask) and ((mask != 0) & (mask != 1)).any():
        raise ValueError("mask must be bool or contain only 0 and 1")
    return mask != 0
