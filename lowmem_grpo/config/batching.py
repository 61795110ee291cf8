"""How completions are grouped: generation batch -> micro-batches -> optimizer steps (TRL's arithmetic).

`batch_plan(cfg, world_size)` derives a `BatchPlan` from train.per_device_train_batch_size,
gradient_accumulation_steps, steps_per_generation or generation_batch_size, num_iterations and
generation.num_generations, or raises a ConfigError naming the setting to change. With several ranks
(torchrun) the generation batch spans them all and each rank generates whole groups. `steps_for_epochs`
counts the optimizer steps of num_train_epochs.

Design notes: docs/config.md
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import ConfigError
from .schema import Config


@dataclass(frozen=True)
class BatchPlan:
    """How completions are grouped: generation batch -> micro-batches -> optimizer steps.

    With several ranks (torchrun) the generation batch spans them all, as in TRL; each rank generates
    `completions_per_rank` of it, whole groups of num_generations."""

    generation_batch_size: int  # completions sampled together, over all ranks (a multiple of G)
    prompts_per_generation: int  # over all ranks
    micro_batches_per_generation: int  # steps_per_generation (per rank)
    steps_per_generation_batch: int  # optimizer steps taken on one generation batch (x num_iterations)
    needs_old_logprobs: bool  # the policy moves while the batch is still in use
    world_size: int = 1

    @property
    def completions_per_rank(self) -> int:
        return self.generation_batch_size // self.world_size

    @property
    def prompts_per_rank(self) -> int:
        return self.prompts_per_generation // self.world_size


def batch_plan(cfg: Config, world_size: int = 1) -> BatchPlan:
    t, g = cfg.train, cfg.generation
    spg = t.steps_per_generation
    gbs = t.generation_batch_size
    per_step = t.per_device_train_batch_size * world_size  # completions of one micro-batch on every rank
    ranks = f" x {world_size} ranks" if world_size > 1 else ""
    if gbs is not None and spg is not None:
        raise ConfigError("set generation_batch_size or steps_per_generation, not both (TRL's rule)")
    if gbs is None:
        spg = t.gradient_accumulation_steps if spg is None else spg
        gbs = per_step * spg
    elif gbs % per_step:
        raise ConfigError(f"generation_batch_size ({gbs}) must be a multiple of per_device_train_batch_size "
                          f"({t.per_device_train_batch_size}){ranks}")
    else:
        spg = gbs // per_step
    if gbs % g.num_generations:
        raise ConfigError(f"the generation batch ({gbs} completions = per_device_train_batch_size{ranks} x "
                          f"steps_per_generation) must be a multiple of num_generations ({g.num_generations})")
    if world_size > 1 and (gbs // world_size) % g.num_generations:
        raise ConfigError(f"each rank generates whole groups: per_device_train_batch_size x steps_per_generation "
                          f"({gbs // world_size} completions per rank) must be a multiple of num_generations "
                          f"({g.num_generations}); raise steps_per_generation or per_device_train_batch_size")
    if spg % t.gradient_accumulation_steps:
        raise ConfigError(f"steps_per_generation ({spg}) must be a multiple of gradient_accumulation_steps "
                          f"({t.gradient_accumulation_steps})")
    steps = (spg // t.gradient_accumulation_steps) * t.num_iterations
    return BatchPlan(gbs, gbs // g.num_generations, spg, steps, steps > 1, world_size)


def steps_for_epochs(epochs: float, plan: BatchPlan, num_prompts: int) -> int:
    """Optimizer steps in `epochs` passes over `num_prompts` training prompts, counted as TRL (transformers'
    Trainer over TRL's RepeatSampler) does: whole generation batches per epoch (a last, partial one is not
    drawn), each giving plan.steps_per_generation_batch optimizer steps; ceil of the product."""
    batches = num_prompts // plan.prompts_per_generation
    if batches == 0:
        raise ConfigError(f"num_train_epochs={epochs}: {num_prompts} training prompts do not fill one generation "
                          f"batch ({plan.prompts_per_generation} prompts); add prompts, lower the generation batch "
                          "(per_device_train_batch_size, steps_per_generation) or set max_steps")
    return max(1, math.ceil(epochs * batches * plan.steps_per_generation_batch))
