"""The host kernel's code paths compute the same bits (optim/host_adamw.py): AVX-512 loops (with VBMI where
the CPU has it, and without), AVX2 loops, scalar loops compiled without AVX, and the native build's scalar
loops, on every entry point: the 8-bit AdamW step (each weight and gradient dtype, stochastic and nearest
rounding, a gradient scale), the fp32 AdamW step with its rounded copy, the quantizer and the gradient's sum
of squares. So a run's numbers do not depend on
which instruction set the CPU has (the tests against bitsandbytes and torch run on each path as well:
conftest.py `simd`)."""

import os

import pytest
import torch

from lowmem_grpo.optim import host_adamw
from tests.optim.conftest import build_for, cpu_flags

bnb = pytest.importorskip("bitsandbytes")

LEVELS = ["native", "avx512", "avx2", "baseline", "scalar"]


def eight_bit_state(n: int) -> dict:
    """Zeroed 8-bit AdamW states of `n` elements in the layout the host kernel takes (bitsandbytes' codes)."""
    blocks = (n + 255) // 256
    return {"state1": torch.zeros(n, dtype=torch.uint8), "state2": torch.zeros(n, dtype=torch.uint8),
            "absmax1": torch.zeros(blocks), "absmax2": torch.zeros(blocks),
            "qmap1": bnb.functional.create_dynamic_map(signed=True),
            "qmap2": bnb.functional.create_dynamic_map(signed=False)}


def _outputs(n: int) -> dict[str, list[torch.Tensor]]:
    """Every entry point's results on fixed inputs of `n` elements, with the library and path in use."""
    out = {}
    for weight in (torch.float32, torch.bfloat16):
        for grad in (torch.float32, torch.bfloat16):
            for stochastic in (True, False):
                gen = torch.Generator().manual_seed(n)
                p, st = torch.randn(n, generator=gen).to(weight), eight_bit_state(n)
                for step in (1, 2, 3):
                    g = (0.01 * torch.randn(n, generator=gen)).to(grad)
                    g[:7] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 3.0, -3.0, 1e-3])[:n].to(grad)
                    assert host_adamw.adamw8bit_step(
                        p, g, st, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=step,
                        grad_scale=0.3 if step == 2 else 1.0, stochastic_rounding=stochastic,
                        generator=torch.Generator().manual_seed(step))
                states = [st[k] for k in ("state1", "state2", "absmax1", "absmax2")]
                out[f"adamw8bit {weight} {grad} {stochastic}"] = [p] + states
        if weight == torch.float32:
            for grad in (torch.float32, torch.bfloat16):
                gen = torch.Generator().manual_seed(n + 1)
                p, m, v = torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)
                upload = torch.empty(n, dtype=torch.bfloat16)
                for step in (1, 2, 3):
                    g = (0.01 * torch.randn(n, generator=gen)).to(grad)
                    assert host_adamw.adamw_step(p, g, m, v, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8,
                                                 weight_decay=0.1, step=step, round_into=upload,
                                                 grad_scale=0.5 if step == 2 else 1.0)
                out[f"adamw {grad}"] = [p, m, v, upload]
    x = torch.randn(n, generator=torch.Generator().manual_seed(n + 2))
    out["quantize"] = list(host_adamw.quantize_blockwise(x, bnb.functional.create_dynamic_map(signed=True)))
    for dtype in (torch.float32, torch.bfloat16):
        total = host_adamw.grad_sum_squares(x.to(dtype))
        out[f"sum of squares {dtype}"] = [torch.tensor(total, dtype=torch.float64)]
    return out


@pytest.mark.parametrize("n", [256 * 70 + 77, 3 * (1 << 16) + 13, 5],
                         ids=["threads_and_tail", "norm_chunks", "tiny"])
def test_every_code_path_computes_the_same_bits(kernel, monkeypatch, n):
    results = {}
    for level in LEVELS:
        library = build_for(level) if level in ("avx512", "avx2", "baseline") else kernel
        monkeypatch.setattr(host_adamw, "_library", library)
        monkeypatch.setattr(host_adamw, "SIMD", level != "scalar")
        results[level] = _outputs(n)
    reference = results["native"]
    for level in LEVELS[1:]:
        for key, tensors in reference.items():
            for i, (a, b) in enumerate(zip(tensors, results[level][key])):
                assert torch.equal(a, b), (level, key, i, int((a != b).sum()))


def test_the_loaded_build_runs_the_loops_of_its_instruction_set(kernel):
    # The native build's loops are the widest this CPU has (here the comparisons above cover two vector widths
    # and the scalar loops where the CPU has AVX-512); a forced -march gets that target's. (The other builds:
    # conftest.build_for.)
    march = os.environ.get("LOWMEM_GRPO_HOST_KERNEL_MARCH", "native")
    if march == "native":
        flags = cpu_flags()
        expected = 16 if {"avx512f", "avx512bw"} <= flags else 8 if {"avx2", "fma"} <= flags else 1
    else:
        expected = {"x86-64": 1, "x86-64-v2": 1, "x86-64-v3": 8, "x86-64-v4": 16}.get(march)
        if expected is None:
            pytest.skip(f"no expectation for -march={march}")
    assert kernel.simd_lanes() == expected
