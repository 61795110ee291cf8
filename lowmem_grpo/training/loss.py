"""The GRPO loss of one micro-batch as an nn.Module: decoder -> completion hidden states -> fused head.

A module because data parallelism wraps forwards: DDP all-reduces the gradients of what its forward
used, and FSDP2 gathers a layer's (or the root's) parameters for the duration of a forward. The
fused head reads the output embedding inside this forward, never outside it, so under FSDP2 it sees
the gathered weight (the root's parameters: embeddings, final norm, head), not the local shard.
What the loss is divided and multiplied by, per loss_type: micro_batch.py.

Design notes: docs/training.md, docs/distributed.md
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
from torch import Tensor, nn

from ..config import Config
from ..kernels import GRPOLossSettings, linear_grpo_loss
from ..policy.batch import Batch
from ..policy.logprobs import completion_hidden
from ..policy.model import Head, build_head
from ..policy.packing import Packing
from .activation_offload import offload_activations
from .micro_batch import loss_denominator, step_loss_factor


class PolicyLoss(nn.Module):
    def __init__(self, policy: nn.Module, cfg: Config, *, autocast: bool, pack: Packing,
                 world_size: int = 1, head: Optional[Head] = None):
        super().__init__()
        self.policy = policy
        self.cfg, self.autocast, self.pack, self.world_size = cfg, autocast, pack, world_size
        # The loss's settings, read from the config and checked once, here: forward reads no config field.
        self.settings = loss_settings(cfg)
        self.gradient_accumulation_steps = cfg.train.gradient_accumulation_steps
        self.offload = cfg.model.offload_activations
        # The policy's one head (the trainer's: build_head(policy) if not given). It reads the output
        # embedding's weight when used, so under FSDP2 it sees the gathered one.
        self.head = build_head(policy) if head is None else head
        # model.offload_activations on a CPU device: real host copies (a no-op otherwise). Set only while a
        # memory profile runs (memory/profile.py: profile_trainer), so the CPU's tracked bytes show what a
        # GPU would hold; plain CPU training has no device memory to save and skips the copies.
        self.offload_copy_on_cpu = False

    def forward(self, mb: Batch, num_items: int, scale: float = 1.0, tokens: Optional[int] = None):
        """(loss, metrics) of micro-batch `mb` (on the device). `num_items`: dapo's denominator, the
        completion tokens of the optimizer step summed over ranks. `scale` multiplies the loss (the
        denominators of skipped rows; 0 for a rank that only takes part in the collectives). `tokens`:
        `mb.completion_mask.sum()` if the caller counted it on the host (the head then drops the
        padding without a device sync). The loss's settings are `self.settings`, bound at construction."""
        s = self.settings
        loss_type = s.loss_type.value
        device_type = mb.completion_ids.device.type
        offload = (offload_activations(copy_on_cpu=self.offload_copy_on_cpu) if self.offload
                   else contextlib.nullcontext())
        head = self.head
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=self.autocast), offload:
            hidden = completion_hidden(head, mb, self.pack)  # (b, c, H)
            loss, metrics = linear_grpo_loss(
                hidden, head.weight, mb.completion_ids, mb.advantages, bias=head.bias, softcap=head.softcap,
                mask=mb.completion_mask, old_logp=mb.old_logp, ref_logp=mb.ref_logp,
                importance_sampling_ratio=mb.is_weight, num_items_in_batch=loss_denominator(loss_type, num_items),
                mask_count=tokens, settings=s)
        factor = step_loss_factor(scale, loss_type, self.gradient_accumulation_steps, self.world_size)
        return (loss if factor == 1.0 else loss * factor), loss_metrics(metrics, loss_type)


def loss_settings(cfg: Config) -> GRPOLossSettings:
    """The fused head's loss settings from the config's train and generation sections, checked (TRL's names;
    the config's `epsilon` is the lower clip, epsilon_low)."""
    t, g = cfg.train, cfg.generation
    return GRPOLossSettings(
        loss_type=t.loss_type, importance_sampling_level=t.importance_sampling_level, epsilon_low=t.epsilon,
        epsilon_high=t.epsilon_high, beta=t.beta, temperature=g.temperature, delta=t.delta,
        use_bias_correction_kl=t.use_bias_correction_kl, top_entropy_quantile=t.top_entropy_quantile,
        sapo_temperature_pos=t.sapo_temperature_pos, sapo_temperature_neg=t.sapo_temperature_neg,
        vespo_k_pos=t.vespo_k_pos, vespo_lambda_pos=t.vespo_lambda_pos, vespo_k_neg=t.vespo_k_neg,
        vespo_lambda_neg=t.vespo_lambda_neg, max_completion_length=g.max_completion_length)


def loss_metrics(metrics: dict, loss_type: str) -> dict:
    """The fused head's metrics as TRL logs them per loss type: clip ratios for the PPO-clip types,
    `cispo_clip_ratio` (its upper clip) for cispo, none for sapo and vespo (vespo: `vespo_phi_mean`)."""
    if loss_type in ("grpo", "bnpo", "dapo", "dr_grpo", "luspo"):
        return metrics
    out = {k: v for k, v in metrics.items() if not k.startswith("clip_ratio")}
    if loss_type == "cispo":
        out["cispo_clip_ratio"] = metrics["clip_ratio_high"]
    return out


def importance_sampling_ratio(train_logp: Tensor, sampling_logp: Tensor, mask: Tensor, mode: str,
                              clip_min: Optional[float], clip_max: Optional[float]) -> Tensor:
    """TRL's correction for rollouts sampled by another engine: the ratio of the trained policy's token
    probabilities (`train_logp`, the old log-probs, (B, T)) to the sampler's (`sampling_logp`, (B, T); NaN
    where unknown: ratio 1), per token ((B, T)) or per sequence ((B, 1), the exp of the summed log-ratio),
    clamped into [clip_min, clip_max] (`*_truncate`) or zeroed outside it (`*_mask`). None: no bound.
    The result is linear_grpo_loss's importance_sampling_ratio."""
    diff = torch.nan_to_num((train_logp.float() - sampling_logp.float()) * mask.float(), nan=0.0)
    level, _, action = mode.partition("_")
    if level not in ("token", "sequence") or action not in ("truncate", "mask"):
        raise ValueError(f"unknown importance-sampling mode {mode!r}; valid: token_truncate, token_mask, "
                         "sequence_truncate, sequence_mask")
    ratio = (diff.sum(-1, keepdim=True) if level == "sequence" else diff).exp()
    if action == "truncate":
        return ratio.clamp(min=clip_min, max=clip_max) if (clip_min, clip_max) != (None, None) else ratio
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def importance_sampling_metrics(ratio: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """min / mean / max of the ratio over the masked tokens (per sequence for a (B, 1) ratio), under TRL's
    names (sampling/importance_sampling_ratio/...)."""
    values = ratio[:, 0] if ratio.shape[1] == 1 else ratio[mask.bool()]
    if values.numel() == 0:
        values = torch.ones(1, device=ratio.device)
    name = "sampling/importance_sampling_ratio"
    return {f"{name}/min": values.min(), f"{name}/mean": values.mean(), f"{name}/max": values.max()}
