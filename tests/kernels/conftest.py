import pytest
import torch

from lowmem_grpo.kernels import HAS_TRITON, use_backend
from lowmem_grpo.kernels._backend import interpreter_enabled

# (device, backend) pairs every op test runs on: the torch path always; the Triton path on CPU
# tensors through the interpreter, and on CUDA when a GPU is present.
PATHS = [("cpu", "torch")]
if HAS_TRITON and interpreter_enabled():
    PATHS.append(("cpu", "triton"))
if torch.cuda.is_available():
    PATHS.append(("cuda", "torch"))
    if HAS_TRITON:
        PATHS.append(("cuda", "triton"))


@pytest.fixture(params=PATHS, ids=[f"{d}-{b}" for d, b in PATHS])
def device(request):
    """The device to put tensors on, with the kernels backend selected for the test."""
    dev, backend = request.param
    with use_backend(backend):
        yield torch.device(dev)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
