"""Optimizer and learning-rate schedule: bitsandbytes 8-bit AdamW by default, torch AdamW selectable;
transformers' schedules by name."""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from ..config import OptimConfig

BNB_BLOCK, BNB_MIN_8BIT = 256, 4096  # bitsandbytes' 8-bit states: 256-element blocks, tensors >= 4096 elements


def optimizer_state_bytes(sizes: list[int], optimizer: str, weight_bytes: int) -> int:
    """Bytes of the optimizer's states for tensors of these element counts: torch AdamW two moments in the
    weight dtype (`weight_bytes`), the 8-bit AdamWs as bitsandbytes keeps them. The planner's figure
    (memory/plan.py) and the offloaded optimizer's start-up check (offload.py) both read it."""
    if optimizer == "adamw":
        return 2 * weight_bytes * sum(sizes)
    total = 0
    for n in sizes:
        if n >= BNB_MIN_8BIT:
            total += 2 * n + 2 * 4 * -(-n // BNB_BLOCK)  # two uint8 states + two fp32 absmax per block
        else:
            total += 8 * n  # bitsandbytes keeps fp32 states for small tensors
    return total


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
    `cfg.offload_optimizer` keeps states and the update in host RAM (offload.py: gradients sent down from
    backward hooks, summed there over the micro-batches, the global norm, one update per optimizer step;
    the 8-bit optimizers and `adamw` step in host_adamw.py's fused CPU kernels; a tied embedding's head then
    needs `split_tied_head(model, heads)`, which the trainer calls); `in_backward` alone steps each parameter
    inside backward on the device (optimizer_in_backward.py). A model trained on the CPU steps its 8-bit
    states in the same fused kernel (bitsandbytes' own CPU step is ~10x slower; same states, weights within
    an ulp or two: docs/memory-modes.md), and `adamw` in torch's fused CPU AdamW (its for-each-tensor
    default makes temporaries of every tensor's size; the same update within rounding)."""
    groups = _param_groups(model, cfg.weight_decay)
    kw = dict(lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon)
    on_cpu = all(p.device.type == "cpu" for g in groups for p in g["params"])
    cls = _optimizer_class(cfg.optimizer, stochastic_rounding, host_kernel=on_cpu)
    if cfg.offload_optimizer:  # (in_backward or not: offload always sends gradients down from the hooks)
        from .offload import OffloadedOptimizer
        sizes = [p.numel() for g in groups for p in g["params"]]  # the states' host RAM, for the start-up check
        states = optimizer_state_bytes(sizes, cfg.optimizer, 4)  # (torch AdamW's are fp32, as its masters)
        clipped = [p for p in model.parameters() if p.requires_grad]  # the plain path's clip_grad_norm_ order
        if cfg.optimizer == "adamw":  # on the CPU: host_adamw.py's fused kernel (torch's fused AdamW arithmetic,
            from .host_adamw import HostAdamW  # torch's AdamW state format) on fp32 master weights
            return OffloadedOptimizer(groups, lambda g: HostAdamW(g, fused=True, **kw),
                                                cfg.max_grad_norm, defaults=kw, master_fp32=True, state_bytes=states,
                                                norm_order=clipped)
        # on the CPU: the fused 8-bit kernel (host_adamw.py), bitsandbytes' state format
        from .host_adamw import host_adamw8bit_class
        host_cls = host_adamw8bit_class(cfg.optimizer == "paged_adamw_8bit", stochastic_rounding)
        return OffloadedOptimizer(groups, lambda g: host_cls(g, **kw), cfg.max_grad_norm, defaults=kw,
                                            state_bytes=states, norm_order=clipped)
    if cls is torch.optim.AdamW and on_cpu:  # torch's fused CPU step: one pass, no temporaries per tensor
        kw["fused"] = True
    if in_backward:
        from .optimizer_in_backward import OptimizerInBackward
        return OptimizerInBackward(groups, lambda g: cls(g, **kw), cfg.max_grad_norm, defaults=kw)
    return cls(groups, **kw)


def _optimizer_class(name: str, stochastic_rounding: bool, host_kernel: bool = False):
    """The optimizer class for optim.optimizer=`name`; `host_kernel`: the 8-bit ones step CPU tensors in
    host_adamw.py's fused kernel (bitsandbytes' CPU step where it cannot run)."""
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
    if host_kernel:
        from .host_adamw import host_adamw8bit_class
        return host_adamw8bit_class(paged, stochastic_rounding)
    if stochastic_rounding:
        from .sr_adamw import sr_adamw8bit_class
        return sr_adamw8bit_class(paged)
    return bnb.optim.PagedAdamW8bit if paged else bnb.optim.AdamW8bit


def warmup_steps(cfg: OptimConfig, max_steps: int) -> int:
    """transformers' rule: warmup_steps when > 0, else ceil(warmup_ratio x max_steps)."""
    return cfg.warmup_steps if cfg.warmup_steps > 0 else math.ceil(cfg.warmup_ratio * max_steps)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, max_steps: int):
    """transformers.get_scheduler(lr_scheduler_type) with transformers' (and so TRL's) names and semantics:
    optimizer step k (from 0) uses learning_rate x lambda(k), so a warm-up starts at lr 0; `constant`
    has no warm-up (config validation refuses one: use `constant_with_warmup`). Its state_dict holds
    the step count only, so a resumed run continues the same sequence."""
    from transformers import SchedulerType, get_scheduler

    if cfg.lr_scheduler_type not in {t.value for t in SchedulerType}:
        import transformers
        raise ValueError(f"lr_scheduler_type={cfg.lr_scheduler_type} is not in transformers "
                         f"{transformers.__version__}; upgrade transformers or choose another schedule")
    try:
        return get_scheduler(cfg.lr_scheduler_type, optimizer, num_warmup_steps=warmup_steps(cfg, max_steps),
                             num_training_steps=max_steps,
                             scheduler_specific_kwargs=dict(cfg.lr_scheduler_kwargs or {}))
    except (TypeError, ValueError) as e:  # a keyword the schedule does not take, or a required one missing
        raise ValueError(f"lr_scheduler_type={cfg.lr_scheduler_type} with lr_scheduler_kwargs="
                         f"{cfg.lr_scheduler_kwargs}: {e}. See transformers' get_scheduler for each "
                         f"schedule's arguments (e.g. cosine_with_min_lr takes min_lr or min_lr_rate)") from None
