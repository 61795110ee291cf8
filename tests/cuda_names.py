"""What in a test's parameters names a CUDA device: the rule tests/test_gpu_session.py holds every collected
test to (one that names one is marked `cuda`), read by tests/fake_cuda_plugin.py."""

import re

import torch

_CUDA_NAME = re.compile(r"cuda(:\d+)?")


def names_cuda_device(value: object) -> bool:
    """Whether a parameter value is, or holds, a CUDA device: a torch.device of type cuda, a string
    "cuda" or "cuda:N", or a tuple, list or dict holding one."""
    if isinstance(value, torch.device):
        return value.type == "cuda"
    if isinstance(value, str):
        return _CUDA_NAME.fullmatch(value) is not None
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return any(names_cuda_device(v) for v in value)
    return False


def id_names_cuda(part: str) -> bool:
    """Whether one parameter id names a CUDA device: "cuda", "cuda:0", "cuda-triton", "bf16_cuda"; a path
    ("/a/wt-cuda-x/r.yaml", a folder's name) never does."""
    return "/" not in part and any(_CUDA_NAME.fullmatch(t) for t in re.split(r"[-_\s]", part))


def cuda_parameters(params: dict, ids: list[str]) -> list[str]:
    """What names a CUDA device in a test's parameters (`params`: name -> value) and their ids."""
    found = [f"{name}={value!r}" for name, value in params.items() if names_cuda_device(value)]
    return found + [f"id {part}" for part in ids if id_names_cuda(part)]
