"""Fixtures shared by the host kernel's tests (test_host_adamw.py: 8-bit AdamW; test_host_adamw_fp32.py:
fp32 AdamW; test_host_adamw_levels.py: its code paths): the built kernel, each of its code paths, and what
torch's own CPU kernels round like on this machine.

Nothing here assumes an instruction set. The kernel's code paths are built for the -march each needs and run
where this CPU can; the whole suite also runs on one forced path with LOWMEM_GRPO_HOST_KERNEL_MARCH
(x86-64-v4: AVX-512 loops, x86-64-v3: AVX2, x86-64: scalar loops only). Comparisons with torch and
bitsandbytes bit for bit hold where torch's CPU kernels fuse the multiply-adds the kernel fuses (its AVX2 and
AVX-512 code, ATEN_CPU_CAPABILITY=avx2/avx512); `torch_fuses` probes that and skips them, with the reason,
where torch rounds twice (an x86 CPU without AVX2, or ATEN_CPU_CAPABILITY=default)."""

import platform

import pytest
import torch

from lowmem_grpo.optim import host_adamw


@pytest.fixture
def kernel():
    lib = host_adamw.library()
    if lib is None:
        pytest.skip(f"the host kernel did not build here: {host_adamw._load_error}")
    return lib


def cpu_flags() -> set[str]:
    """The instruction-set flags of this CPU (/proc/cpuinfo), empty where unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return set()
    return set(line.partition(":")[2].split())


# The kernel's code paths besides the native build: -march, the lanes its loops take, the CPU flags it needs.
# "avx512": AVX-512 without VBMI (Skylake-X): the 8-bit step dequantizes by gathers, not byte permutes.
BUILDS = {"avx512": ("x86-64-v4", 16, {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}),
          "avx2": ("x86-64-v3", 8, {"avx2", "fma", "bmi2"}), "baseline": ("x86-64", 1, set())}
_built: dict[str, object] = {}


def build_for(level: str):
    """The kernel built for `level` (BUILDS), once per session; skips where this CPU cannot run it."""
    march, lanes, needs = BUILDS[level]
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"-march={march} is an x86-64 target; this CPU is {platform.machine()}")
    missing = needs - cpu_flags()
    if missing:
        pytest.skip(f"this CPU cannot run -march={march} code (no {', '.join(sorted(missing))})")
    if level not in _built:
        _built[level] = host_adamw._build(march)
    lib = _built[level]
    assert lib.simd_lanes() == lanes, (level, lib.simd_lanes())  # the build runs the loops it is meant to
    return lib


@pytest.fixture(params=["native", "avx512", "avx2", "baseline", "scalar"])
def simd(request, monkeypatch, kernel):
    """The kernel's code paths: the native build (this CPU's: AVX-512 loops where it has them, AVX2 on most
    desktop CPUs), the AVX-512 loops without VBMI (-march=x86-64-v4), the AVX2 loops (-march=x86-64-v3),
    the scalar loops compiled without AVX (-march=x86-64: what a CPU without AVX2 or an ARM CPU runs), and
    the native build's scalar loops."""
    if request.param in BUILDS:
        monkeypatch.setattr(host_adamw, "_library", build_for(request.param))
    monkeypatch.setattr(host_adamw, "SIMD", request.param != "scalar")
    return request.param


def torch_rounds_like_the_kernel() -> bool:
    """Whether torch's CPU kernels here compute `add_(x, alpha=)` and `addcmul_` with one rounding (a fused
    multiply-add), as the host kernel does. On inputs where one rounding and two differ: -1 + x * x, with
    x = 1 + 2**-12, is 2**-11 + 2**-24 rounded once and 2**-11 rounded twice (64 elements: torch's vector
    loop)."""
    x = 1.0 + 2.0 ** -12
    minus_one, xs = torch.full((64,), -1.0), torch.full((64,), x)
    once = 2.0 ** -11 + 2.0 ** -24
    return bool((minus_one.clone().add_(xs, alpha=x) == once).all()
                and (minus_one.clone().addcmul_(xs, xs) == once).all())


@pytest.fixture
def torch_fuses():
    """Skip, with the reason, a comparison with torch or bitsandbytes bit for bit where torch's CPU kernels
    round a multiply-add twice (the kernel follows torch's AVX2/AVX-512 code, which rounds it once)."""
    if not torch_rounds_like_the_kernel():
        pytest.skip(f"torch's CPU kernels here (capability {torch.backends.cpu.get_cpu_capability()}) round "
                    "a * b + c twice, the host kernel once (as torch's AVX2/AVX-512 code): results may "
                    "differ in the last bit; the tests named *_any_cpu state the bound that holds here")
