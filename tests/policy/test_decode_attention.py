"""The CPU decode attention (policy/decode_attention.py) against attention computed in float64.

The kernel's vector loops (AVX-512 where the CPU has it, and a build for -march=x86-64-v3: the AVX2 loops)
and its scalar loops all run (`simd`), over the shapes the decode steps give it: the query heads grouped
under each K/V head, the K/V as views of a longer cache, a bool mask with left padding, lengths around the
vector width.
"""

import functools
import json
import os
import platform
import subprocess
import sys

import pytest
import torch

from lowmem_grpo.policy import decode_attention, decode_slots
from lowmem_grpo.policy.decode_attention import cpu_decode_attention, problem

from ..optim.ulp import bf16_ulp


def needs_kernel():
    lib = decode_attention.library()
    if lib is None or lib.decode_attention_lanes() < 8:
        pytest.skip("the decode attention kernel runs on AVX2 and AVX-512 CPUs (it did not build, or this CPU "
                    "has neither)")


@functools.lru_cache(maxsize=None)
def avx2_build():
    """The kernel built for -march=x86-64-v3 (AVX2 + FMA: its 8-lane loops), None where this CPU cannot run it."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return None
    if not {"avx2", "fma", "bmi2"} <= set(line.partition(":")[2].split()):
        return None
    return decode_attention.build("x86-64-v3")


@pytest.fixture(params=["simd", "avx2", "scalar"])
def simd(request, monkeypatch):
    needs_kernel()
    if request.param == "avx2":
        lib = avx2_build()
        if lib is None:
            pytest.skip("this CPU cannot run -march=x86-64-v3 code")
        assert lib.decode_attention_lanes() == 8
        monkeypatch.setattr(decode_attention, "_library", lib)
    monkeypatch.setattr(decode_attention, "SIMD", request.param != "scalar")
    return request.param


def operands(rows, kv_heads, group, length, dim, dtype, seed=0, spare=5):
    """q (rows, kv_heads, group, dim); k, v views of a (rows, kv_heads, length + spare, dim) cache; a mask
    with each row's left padding (row 0 none), so that every row attends to its last positions."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, kv_heads, group, dim, generator=g).to(dtype)
    cache = torch.randn(2, rows, kv_heads, length + spare, dim, generator=g).to(dtype)
    k, v = cache[0, :, :, 2:2 + length], cache[1, :, :, 2:2 + length]
    pad = torch.randint(0, length, (rows,), generator=g)
    pad[0] = 0
    mask = torch.arange(length)[None, :] >= pad[:, None]
    mask &= torch.rand(rows, length, generator=g) > 0.2  # and holes, as a refilled row's padding leaves none
    mask[:, -1] = True
    return q, k, v, mask[:, None, None, :]


def exact(q, k, v, mask, scale):
    """The attention in float64 (a row with nothing to attend gets zeros, as sdpa gives)."""
    scores = torch.einsum("bhgd,bhld->bhgl", q.double(), k.double()) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, -1).nan_to_num(0.0)
    return torch.einsum("bhgl,bhld->bhgd", weights, v.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(5, 3, 3, 37, 64), (3, 2, 7, 16, 128), (4, 1, 1, 1, 64), (2, 2, 2, 17, 80),
                                   (2, 2, 5, 33, 32)], ids=lambda s: "x".join(map(str, s)))
def test_equals_float64_attention_to_rounding(simd, dtype, shape):
    q, k, v, mask = operands(*shape, dtype)
    scale = shape[-1] ** -0.5
    ours = cpu_decode_attention(q, k, v, mask, scale)
    assert ours is not None and ours.dtype == dtype and ours.shape == q.shape
    want = exact(q, k, v, mask, scale)
    if dtype == torch.float32:
        torch.testing.assert_close(ours.double(), want, rtol=0, atol=2e-6)
    else:  # the fp32 result rounded once: within one bf16 ulp of the exact value, or of fp32's sums where
        # they cancel to near 0 (an absolute ~1e-8 here)
        assert ((ours.double() - want).abs() <= bf16_ulp(want.float()).double() + 1e-6).all()


def test_masked_positions_are_never_read(simd):
    q, k, v, mask = operands(4, 2, 3, 40, 64, torch.float32)
    want = cpu_decode_attention(q, k, v, mask, 0.125)
    hidden = ~mask[:, 0, 0, :, None].expand_as(k[:, 0])  # (rows, length, dim)
    for head in range(k.shape[1]):
        k[:, head][hidden] = float("nan")
        v[:, head][hidden] = float("inf")
    assert torch.equal(cpu_decode_attention(q, k, v, mask, 0.125), want)


def test_a_row_with_nothing_to_attend_gets_zeros_as_sdpa_gives(simd):
    q, k, v, mask = operands(3, 2, 2, 20, 64, torch.bfloat16)
    mask[1] = False
    ours = cpu_decode_attention(q, k, v, mask, 0.125)
    theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125)
    assert torch.equal(ours[1], torch.zeros_like(ours[1])) and torch.equal(theirs[1], ours[1])


def test_without_a_mask_every_position_attends(simd):
    q, k, v, _ = operands(3, 2, 3, 24, 64, torch.float32)
    torch.testing.assert_close(cpu_decode_attention(q, k, v, None, 0.125).double(),
                               exact(q, k, v, torch.ones(3, 1, 1, 24, dtype=torch.bool), 0.125), rtol=0, atol=2e-6)


def test_the_thread_count_does_not_change_the_bits(simd):
    q, k, v, mask = operands(16, 3, 3, 70, 64, torch.bfloat16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_decode_attention(q, k, v, mask, 0.125)
        torch.set_num_threads(max(2, before))
        assert torch.equal(cpu_decode_attention(q, k, v, mask, 0.125), one)
    finally:
        torch.set_num_threads(before)


def test_the_kernel_runs_on_the_openmp_runtime_torch_loaded():
    """Where torch's wheel ships `libgomp.so.1` (torch 2.13's CPU wheels), the OpenMP build links that one:
    the kernel runs on it, and no second runtime is loaded."""
    needs_kernel()
    torch_gomp = os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp.so.1")
    if not os.path.exists(torch_gomp) or not decode_attention.openmp_runtimes():
        pytest.skip("torch brings no libgomp.so.1 here, or /proc/self/maps cannot be read")
    if os.environ.get("LOWMEM_GRPO_DECODE_ATTENTION_OPENMP", "1") == "0":
        pytest.skip("LOWMEM_GRPO_DECODE_ATTENTION_OPENMP=0")
    script = ("import json, torch\nfrom lowmem_grpo.policy import decode_attention as d\n"
              "print(json.dumps([d.library().decode_attention_openmp(), sorted(d.openmp_runtimes())]))")
    # a process of its own: what this one has loaded before (other tests' libraries) does not count
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    openmp, runtimes = json.loads(done.stdout.strip().splitlines()[-1])
    assert openmp == 1 and len(runtimes) == 1 and os.path.samefile(runtimes[0], torch_gomp), (openmp, runtimes)


def test_openmp_and_its_own_threads_give_the_same_bits(monkeypatch):
    needs_kernel()
    try:
        builds = {True: decode_attention.build(openmp=True)}
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"the compiler does not build with OpenMP here ({type(e).__name__})")
    builds[False] = decode_attention.build(openmp=False)
    assert [lib.decode_attention_openmp() for lib in builds.values()] == [1, 0]
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # (the kernel is handed this count)
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v, mask = operands(16, 3, 3, 70, 64, dtype)
        out = {}
        for openmp, lib in builds.items():
            monkeypatch.setattr(decode_attention, "_library", lib)
            out[openmp] = cpu_decode_attention(q, k, v, mask, 0.125)
        assert torch.equal(out[True], out[False])


def test_what_it_does_not_take_is_named_and_left_to_sdpa(monkeypatch):
    q, k, v, mask = operands(2, 2, 2, 8, 64, torch.float32)
    assert "fp32 or bf16" in problem(q.half(), k.half(), v.half(), mask)
    assert "multiple of 16" in problem(q[..., :40], k[..., :40], v[..., :40], mask)
    assert "bool mask" in problem(q, k, v, torch.zeros(2, 1, 1, 8))
    assert "contiguous last dimension" in problem(q, torch.randn(2, 2, 64, 8).transpose(2, 3), v, mask)
    assert "autograd" in problem(q.requires_grad_(), k, v, mask)
    assert cpu_decode_attention(q, k, v, torch.zeros(2, 1, 1, 8), 0.125) is None
    monkeypatch.setattr(decode_attention, "_library", None)
    monkeypatch.setattr(decode_attention, "_load_error", "LOWMEM_GRPO_DECODE_ATTENTION=0")
    assert "LOWMEM_GRPO_DECODE_ATTENTION=0" in problem(q.detach(), k, v, mask)


def test_grouped_decode_attention_runs_the_kernel_and_equals_sdpa(monkeypatch):
    needs_kernel()
    q, k, v, mask = operands(4, 2, 3, 30, 64, torch.float32)
    query = q.reshape(4, 6, 1, 64)  # (B, heads, 1, D): heads 0-2 read K/V head 0, as repeat_kv orders them
    calls = []
    real = decode_slots.cpu_decode_attention
    monkeypatch.setattr(decode_slots, "cpu_decode_attention", lambda *a: calls.append(1) or real(*a))
    ours, _ = decode_slots.grouped_decode_attention(None, query, k, v, mask)
    assert calls == [1]
    monkeypatch.setattr(decode_slots, "cpu_decode_attention", lambda *a: None)  # sdpa
    theirs, _ = decode_slots.grouped_decode_attention(None, query, k, v, mask)
    assert ours.shape == (4, 1, 6, 64)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-6)


@pytest.mark.parametrize("dim", [64, 128, 80])
def test_under_bf16_autocast_fp32_keys_are_read_as_bf16_as_sdpa_reads_them(simd, dim):
    # the cache under autocast: the rotary embedding returns fp32 queries and keys, the values stay bf16
    q, k, v, mask = operands(4, 2, 3, 37, dim, torch.float32)
    v = v.to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = cpu_decode_attention(q, k, v, mask, dim ** -0.5)
        theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=dim ** -0.5)
        assert "autocast" in problem(q, k, v.float(), mask)  # sdpa would round fp32 values: not taken
    assert ours is not None and ours.dtype == theirs.dtype == torch.bfloat16
    want = exact(q.to(torch.bfloat16), k.to(torch.bfloat16), v, mask, dim ** -0.5)  # what autocast computes
    assert ((ours.double() - want).abs() <= bf16_ulp(want.float()).double() + 1e-6).all()
    assert problem(q, k, v, mask) is not None  # without autocast, mixed dtypes are sdpa's
