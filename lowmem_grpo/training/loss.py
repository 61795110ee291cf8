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
from typing import Optional

import torch
from torch import nn

from ..config import Config
from ..kernels import linear_grpo_loss
from ..policy.batch import Batch
from ..policy.logprobs import completion_hidden
from ..policy.model import Head
from ..policy.packing import Packing
from .activation_offload import offload_activations
from .micro_batch import loss_denominator, loss_factor


class PolicyLoss(nn.Module):
    def __init__(self, policy: nn.Module, cfg: Config, *, autocast: bool, pack: Packing,
                 world_size: int = 1):
        super().__init__()
        self.policy = policy
        self.cfg, self.autocast, self.pack, self.world_size = cfg, autocast, pack, world_size
        # Head reads the output embedding's weight when used, so under FSDP2 it sees the gathered one.
        self.head = Head(decoder=getattr(policy, policy.base_model_prefix), output=policy.get_output_embeddings())
        # model.offload_activations on a CPU device: real host copies (a no-op otherwise). Set only while a
        # memory profile runs (memory/profile.py: profile_trainer), so the CPU's tracked bytes show what a
        # GPU would hold; plain CPU training has no device memory to save and skips the copies.
        self.offload_copy_on_cpu = False

    def forward(self, mb: Batch, num_items: int, scale: float = 1.0, tokens: Optional[int] = None):
        """(loss, metrics) of micro-batch `mb` (on the device). `num_items`: dapo's denominator, the
        completion tokens of the optimizer step summed over ranks. `scale` multiplies the loss (the
        denominators of skipped rows; 0 for a rank that only takes part in the collectives). `tokens`:
        `mb.completion_mask.sum()` if the caller counted it on the host (the head then drops the
        padding without a device sync)."""
        t, g = self.cfg.train, self.cfg.generation
        device_type = mb.completion_ids.device.type
        offload = (offload_activations(copy_on_cpu=self.offload_copy_on_cpu) if self.cfg.model.offload_activations
                   else contextlib.nullcontext())
        head = self.head
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=self.autocast), offload:
            hidden = completion_hidden(head, mb, self.pack)  # (b, c, H)
            loss, metrics = linear_grpo_loss(
                hidden, head.weight, mb.completion_ids, mb.advantages, bias=head.bias,
                mask=mb.completion_mask, old_logp=mb.old_logp, ref_logp=mb.ref_logp,
                epsilon_low=t.epsilon, epsilon_high=t.epsilon_high, beta=t.beta, temperature=g.temperature,
                loss_type=t.loss_type, importance_sampling_level=t.importance_sampling_level,
                max_completion_length=g.max_completion_length,
                num_items_in_batch=loss_denominator(t.loss_type, num_items), mask_count=tokens, delta=t.delta,
                use_bias_correction_kl=t.use_bias_correction_kl, top_entropy_quantile=t.top_entropy_quantile,
                sapo_temperature_pos=t.sapo_temperature_pos, sapo_temperature_neg=t.sapo_temperature_neg,
                vespo_k_pos=t.vespo_k_pos, vespo_lambda_pos=t.vespo_lambda_pos, vespo_k_neg=t.vespo_k_neg,
                vespo_lambda_neg=t.vespo_lambda_neg)
        factor = loss_factor(scale, t, self.world_size)  # micro_batch.py: per loss_type
        return (loss if factor == 1.0 else loss * factor), metrics
