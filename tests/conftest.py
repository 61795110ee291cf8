"""Test set-up: on a machine without CUDA, Triton kernels run in its interpreter on CPU tensors.

TRITON_INTERPRET must be set before the kernels are defined (triton.jit reads it at decoration
time), so it is set here, before any test module imports lowmem_grpo.kernels.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
