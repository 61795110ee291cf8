"""Host RAM a run keeps on purpose, per category, for the planner (plan.py).

`host_categories` counts the reference model, the offloaded optimizer (states, weight copy, gradient buffer)
and the offloaded activations, with the same arithmetic as the code that allocates them (host_arena.py
`arena_bytes`); `pinned_host_categories` names the page-locked ones. plan() adds the reward models and
vLLM on a CPU (reward_plan.py, vllm_plan.py).

Design notes: docs/planner.md
"""

from __future__ import annotations

from typing import Union

import torch

from ..config import Config, GenerationConfig
from ..host_arena import arena_bytes, round_up
from ..optim.offload import staging_bytes
from ..optim.optimizers import optimizer_state_bytes
from ..policy.packed_linear import auto_packing_forced, gemm_dtype
from .arch import Arch


def host_categories(cfg: Config, arch: Arch, offloaded_activations: int = 0, device: str = "cuda",
                    gradients_once: bool = False) -> dict:
    """Host RAM the run keeps on purpose, per category (module docstring).

    The offloaded optimizer's weight copy (unless fp32 masters) and gradient buffer are one block of
    host memory laid out as host_arena.py lays it out, its alignment and page rounding
    included, and the tied head's buffer another: the two categories sum to the bytes the run pins,
    to the byte (tests/memory/test_host_ram_plan.py checks it against the real optimizer). The
    streamed reference model on a GPU is one block too (policy/reference.py)."""
    wb = 2 if cfg.model.precision == "bf16_sr" else 4
    host = {}
    if cfg.train.beta > 0:
        streamed = device != "cpu" and cfg.train.reference_compute != "cpu"  # auto streams on a GPU
        host["reference model"] = arena_bytes(wb * n for n in arch.tensor_sizes) if streamed else wb * arch.params
    if cfg.optim.offload_optimizer:  # torch AdamW steps fp32 masters (optim/offload.py)
        master = 4 if cfg.optim.optimizer == "adamw" else wb
        host["optimizer states"] = optimizer_state_bytes(arch.tensor_sizes, cfg.optim.optimizer, master)
        copies = [wb * n for n in arch.tensor_sizes] if master == wb else []  # in the block, in its order
        block = arena_bytes(copies + [wb * n for n in arch.tensor_sizes] + [4 * len(arch.tensor_sizes)])
        host["weights copy"] = sum(round_up(c) for c in copies) if copies else master * arch.params
        host["gradient buffer"] = block - (host["weights copy"] if copies else 0)  # + norm slots, page tail
        if arch.tied:  # the tied head's contribution, its own block
            host["gradient buffer"] += arena_bytes([wb * arch.vocab * arch.hidden])
        # later micro-batches' gradients arrive through the staging ring; none do where every gradient is
        # summed on the device and sent once (`gradients_once`: the layer-major backward with the head's too)
        if cfg.train.gradient_accumulation_steps > 1 and not gradients_once:
            host["gradient buffer"] += staging_bytes()
    if offloaded_activations:
        host["activations (offloaded)"] = offloaded_activations
    return {k: int(v) for k, v in host.items()}


def pinned_host_categories(cfg: Config, device: str = "cuda") -> list[str]:
    """The host categories that are page-locked (they cannot swap): on a GPU, the buffers that cross PCIe
    asynchronously. The fp32 masters and the optimizer states are ordinary memory."""
    if device == "cpu":
        return []
    pinned = []
    if cfg.train.beta > 0 and cfg.train.reference_compute != "cpu":  # streamed: auto on a GPU
        pinned.append("reference model")
    if cfg.optim.offload_optimizer:  # the weight copy unless it is an fp32 master of bf16 weights
        master_of_bf16 = cfg.optim.optimizer == "adamw" and cfg.model.precision == "bf16_sr"
        pinned += ["gradient buffer"] if master_of_bf16 else ["weights copy", "gradient buffer"]
    if cfg.model.offload_activations:
        pinned.append("activations (offloaded)")
    return pinned


def planned_packing(generation: GenerationConfig) -> Union[bool, str]:
    """generation.pack_decode_weights as the planner counts it: auto, which measures the running CPU when a
    rollout starts, as true (the larger case) unless LOWMEM_GRPO_PACK_DECODE decides it."""
    setting = generation.pack_decode_weights
    return setting if setting != "auto" else auto_packing_forced() is not False


def packed_decode_bytes(arch: Arch, compute_bytes: int, setting: Union[bool, str] = True) -> int:
    """Host bytes of generation.pack_decode_weights' copies (policy/packed_linear.py: packed_bytes) under
    `setting` (true: every Linear weight once; "head": the output head's alone), in the dtype the packed GEMM
    runs in: the decode's compute dtype (`compute_bytes`: 2 under bf16 weights or autocast), widened to fp32
    where the running CPU has no oneDNN bf16 GEMM (`gemm_dtype`). The weight matrices are the tensors larger
    than one hidden vector; the input embedding is one of them but no Linear unless the head shares it (tied).
    Biases, copied only under autocast, are not counted (hidden-sized vectors: under 0.1% of the weights)."""
    if compute_bytes == 2:
        compute_bytes = gemm_dtype(torch.bfloat16).itemsize
    if setting == "head":
        return compute_bytes * arch.vocab * arch.hidden
    matrices = sum(n for n in arch.tensor_sizes if n > arch.hidden)
    return compute_bytes * (matrices - (0 if arch.tied else arch.vocab * arch.hidden))
