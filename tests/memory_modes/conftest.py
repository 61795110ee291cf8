"""Fixtures shared by the host kernel's tests (test_host_adamw.py: 8-bit AdamW; test_host_adamw_fp32.py:
fp32 AdamW): the built kernel, and each of its three code paths."""

import os

import pytest

from lowmem_grpo.memory_modes import host_adamw


@pytest.fixture
def kernel():
    lib = host_adamw.library()
    if lib is None:
        pytest.skip(f"the host kernel did not build here: {host_adamw._load_error}")
    return lib


_AVX2_BUILD = {}


@pytest.fixture(params=["native", "avx2", "scalar"])
def simd(request, monkeypatch, kernel):
    """The kernel's three code paths: this CPU's (AVX-512 where it has it), the AVX2 loops (built for
    -march=x86-64-v3: what most desktop CPUs run), the scalar loops (any other CPU)."""
    if request.param == "avx2":
        flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
        if " avx2" not in flags or " fma" not in flags:
            pytest.skip("this CPU cannot run AVX2 code")
        if "lib" not in _AVX2_BUILD:
            _AVX2_BUILD["lib"] = host_adamw._build("x86-64-v3")
        monkeypatch.setattr(host_adamw, "_library", _AVX2_BUILD["lib"])
    monkeypatch.setattr(host_adamw, "SIMD", request.param != "scalar")
    return request.param
