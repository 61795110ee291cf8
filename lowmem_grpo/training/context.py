"""`RolloutContext`: what generating and scoring completions needs, built once by the Trainer and passed
to `make_generation_batch` (generation.py) and `evaluate` (evaluate.py) in place of a long parameter list.

It holds references, not copies: the policy trains in place, and a step mode may give the head a
weight source of its own (step_modes.py); the context sees both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..policy.packing import Packing
from .distributed import World


@dataclass(frozen=True)
class RolloutContext:
    policy: torch.nn.Module  # the causal LM that generates
    tokenizer: Any  # decodes completions for the reward functions (None: a model without one)
    reward_funcs: list  # rewards.RewardFunction objects, with their weights and timeouts
    eos_ids: list[int]  # every token id that ends a completion
    pad_id: int
    device: torch.device  # where rollouts and log-prob passes run
    autocast: bool  # bf16 autocast around the policy's forwards
    head: Any = None  # policy.model.Head for the old log-prob pass (training only)
    reference: Optional[Any] = None  # policy.reference.Reference when beta > 0
    pack: Packing = Packing.OFF  # shared-prompt packing in the log-prob passes (policy/packing.py)
    world: World = field(default_factory=World)  # this process among the torchrun ranks
    engine: Optional[Any] = None  # policy.vllm_engine.VLLMEngine when generation.engine=vllm (training only)
    compact: Optional[Any] = None  # policy.compact.CompactPolicy with generation.rollout_quantization (training)
    streamer: Optional[Any] = None  # policy.streaming.LayerStreamer of the policy's layers (model.offload_weights)
