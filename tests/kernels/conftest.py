import pytest
import torch

from lowmem_grpo.kernels import HAS_TRITON, use_backend
from lowmem_grpo.kernels._backend import interpreter_enabled

# (device, backend) pairs every op test runs on: the torch path always; the Triton path on CPU
# tensors through the interpreter, and on CUDA when a GPU is present. The CUDA pairs carry the `cuda`
# marker: the GPU session selects them with `-m cuda` (tests/test_gpu_session.py checks every CUDA case).
PATHS = [("cpu", "torch")]
if HAS_TRITON and interpreter_enabled():
    PATHS.append(("cpu", "triton"))
if torch.cuda.is_available():
    PATHS.append(("cuda", "torch"))
    if HAS_TRITON:
        PATHS.append(("cuda", "triton"))


@pytest.fixture(params=[pytest.param(path, id=f"{path[0]}-{path[1]}",
                                     marks=[pytest.mark.cuda] if path[0] == "cuda" else [])
                        for path in PATHS])
def device(request):
    """The device to put tensors on, with the kernels backend selected for the test."""
    dev, backend = request.param
    with use_backend(backend):
        yield torch.device(dev)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
