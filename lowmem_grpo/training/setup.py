"""Set-up steps of the trainer that stand alone: the training device, where reward models run, and the
seeds every random stream starts from."""

from __future__ import annotations

import random

import numpy as np
import torch


def pick_device(name: str) -> torch.device:
    """The training device. A CUDA device also becomes the current one: Triton kernels, bitsandbytes
    and the side streams of the memory modes run on the current device, not on their tensors'."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"train.device={name} but this torch build sees no CUDA GPU; set train.device=cpu")
        index = torch.cuda.current_device() if device.index is None else device.index
        if index >= torch.cuda.device_count():
            raise RuntimeError(f"train.device={name} but this machine has {torch.cuda.device_count()} CUDA "
                               f"device(s); use cuda:0 .. cuda:{torch.cuda.device_count() - 1}")
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
    return device


def reward_model_placement(setting: str, device: torch.device) -> str:
    """Where reward models run: the setting, or for auto, cpu on a CPU run and stream on a GPU (`lowmem-grpo
    train` resolves auto before this, to gpu where the planner finds room: memory/fit.py)."""
    if setting != "auto":
        return setting
    return "cpu" if device.type == "cpu" else "stream"


def seed_everything(seed: int) -> None:
    """Python's, NumPy's and torch's global generators, from one seed."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
