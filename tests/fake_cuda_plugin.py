"""A pytest plugin (`-p tests.fake_cuda_plugin`) for collection only: torch reports one CUDA device, so
the suite collects as on a GPU machine (cuda-* fixture ids, cuda-marked tests unskipped). Used by
tests/test_gpu_session.py to see what each GPU-session step selects; nothing it collects can run."""

import torch

try:  # imported before the patch: with CUDA "available" it would load its CUDA backend and fail
    import bitsandbytes  # noqa: F401
except ImportError:
    pass

torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
