"""A pytest plugin (`-p tests.fake_cuda_plugin`) for collection only: torch reports one CUDA device, so
the suite collects as on a GPU machine (cuda-* fixture ids, cuda-marked tests unskipped). Used by
tests/test_gpu_session.py to see what each GPU-session step selects; nothing it collects can run.

With FAKE_CUDA_COLLECTED=PATH it also writes there, when collection ends, a JSON list with one object per
collected test: "test" (its node id), "cuda_marked" (it carries the `cuda` marker) and "names_cuda"
(what in its parameters names a CUDA device: tests/cuda_names.py)."""

import json
import os

import torch

from tests.cuda_names import cuda_parameters

try:  # imported before the patch: with CUDA "available" it would load its CUDA backend and fail
    import bitsandbytes  # noqa: F401
except ImportError:
    pass

torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1


def pytest_collection_finish(session) -> None:
    path = os.environ.get("FAKE_CUDA_COLLECTED")
    if not path:
        return
    tests = []
    for item in session.items:
        spec = getattr(item, "callspec", None)
        ids = list(getattr(spec, "_idlist", None) or ([spec.id] if spec is not None else []))
        tests.append({"test": item.nodeid, "cuda_marked": item.get_closest_marker("cuda") is not None,
                      "names_cuda": cuda_parameters(spec.params, ids) if spec is not None else []})
    with open(path, "w") as f:
        json.dump(tests, f)
