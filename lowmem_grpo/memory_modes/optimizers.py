"""Optimizer and learning-rate schedule: bitsandbytes 8-bit AdamW by default, torch AdamW selectable."""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from ..config import OptimConfig


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only (not norm gains or biases), the usual rule; tied weights appear once."""
    decay, no_decay = [], []
    for p in model.parameters():  # parameters() yields a tied embedding once, so it gets one update
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(model: nn.Module, cfg: OptimConfig, stochastic_rounding: bool = False,
                    in_backward: bool = False) -> torch.optim.Optimizer:
    """The configured optimizer. `stochastic_rounding` selects the bf16-weight variant (sr_adamw.py);
    `in_backward` steps each parameter inside backward (optimizer_in_backward.py), on host copies with
    `cfg.offload_optimizer` (offload.py)."""
    groups = _param_groups(model, cfg.weight_decay)
    kw = dict(lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon)
    cls = _optimizer_class(cfg.optimizer, stochastic_rounding)
    if in_backward and cfg.offload_optimizer:
        from .offload import OffloadedOptimizerInBackward
        if cfg.optimizer == "adamw":  # on the CPU: torch's fused kernel, on fp32 master weights
            return OffloadedOptimizerInBackward(groups, lambda g: torch.optim.AdamW(g, fused=True, **kw),
                                                cfg.max_grad_norm, defaults=kw, master_fp32=True)
        return OffloadedOptimizerInBackward(groups, lambda g: cls(g, **kw), cfg.max_grad_norm, defaults=kw)
    if in_backward:
        from .optimizer_in_backward import OptimizerInBackward
        return OptimizerInBackward(groups, lambda g: cls(g, **kw), cfg.max_grad_norm, defaults=kw)
    if cfg.offload_optimizer:
        raise ValueError("optim.offload_optimizer needs in_backward=True (config validation says so)")
    return cls(groups, **kw)


def _optimizer_class(name: str, stochastic_rounding: bool):
    if name == "adamw":
        return torch.optim.AdamW
    # On CPUs with AVX512-BF16, importing bitsandbytes probes for a 4-bit GEMM kernel package and warns
    # when it is absent; we use only its 8-bit optimizer, so that warning is noise here.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    try:
        import bitsandbytes as bnb
    except ImportError as e:
        raise ImportError(f"optim.optimizer={name} needs bitsandbytes ({e}); pip install bitsandbytes, "
                          "or set optim.optimizer=adamw (4x the optimizer-state memory)") from None
    paged = name == "paged_adamw_8bit"
    if stochastic_rounding:
        from .sr_adamw import sr_adamw8bit_class
        return sr_adamw8bit_class(paged)
    return bnb.optim.PagedAdamW8bit if paged else bnb.optim.AdamW8bit


def lr_lambda(cfg: OptimConfig, max_steps: int):
    """Multiplier of the peak LR at each step: linear warm-up, then constant / linear / cosine decay to 0."""
    warmup = cfg.warmup_steps if cfg.warmup_steps > 0 else math.ceil(cfg.warmup_ratio * max_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if cfg.lr_scheduler_type == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
        if cfg.lr_scheduler_type == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, max_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, max_steps))
