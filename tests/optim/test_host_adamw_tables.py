"""The 8-bit host step's vector loops read bitsandbytes' codes without gathers (optim/host_adamw.cpp): the
quantizer searches a threshold tree instead of indexing the 64 KiB table, and on CPUs with AVX-512 VBMI the
codes are dequantized by byte permutes. Both must give the table's codes and values bit for bit, for any
sorted code, on every code path (conftest.py `simd`)."""

import shutil
import subprocess

import pytest
import torch

from lowmem_grpo.optim import host_adamw
from tests.optim.conftest import cpu_flags

bnb = pytest.importorskip("bitsandbytes")


def _codes() -> dict[str, torch.Tensor]:
    """bitsandbytes' two maps, and sorted codes that exercise the search's edges: a code reaching past [-1, 1]
    (the first grid points already take code 3; the last thresholds are never passed), one with repeated
    values, and one of 256 grid points (ties)."""
    grid = -1.0 + (2.0 * torch.arange(65536, dtype=torch.float32)) / 65535.0
    wide = torch.linspace(-2.5, 2.5, 256)
    repeated = torch.sort(torch.cat([torch.zeros(40), torch.linspace(-1, 1, 216)]).float()).values
    return {"signed": bnb.functional.create_dynamic_map(signed=True).float(),
            "unsigned": bnb.functional.create_dynamic_map(signed=False).float(),
            "wide": wide, "repeated": repeated, "grid": grid[torch.arange(0, 65536, 256)].contiguous()}


def _every_grid_index() -> torch.Tensor:
    """Blocks with absmax 1 whose values reach every index t = ((x + 1) / 2) * 65535 + 0.5 of the quantizer's
    grid: each grid point and the floats either side of it, and the values past +-1 that it clamps."""
    grid = -1.0 + (2.0 * torch.arange(65536, dtype=torch.float32)) / 65535.0
    values = torch.cat([grid, torch.nextafter(grid, torch.full_like(grid, 2.0)),
                        torch.nextafter(grid, torch.full_like(grid, -2.0))]).clamp(-1.0, 1.0)
    t = (((values + 1.0) * 0.5) * 65535.0 + 0.5).to(torch.int32)  # the kernel's fp32 ops, in its order
    assert torch.unique(t).numel() == 65536  # every index of the table is reached
    values = torch.cat([values, torch.tensor([1.5, -1.5, float("nan")])])
    blocks = values.split(255)
    return torch.cat([torch.cat([torch.ones(1), b]) for b in blocks])


@pytest.mark.parametrize("name", list(_codes()))
def test_every_grid_index_gets_the_tables_code_on_every_path(kernel, simd, monkeypatch, name):
    code = _codes()[name]
    x = _every_grid_index()
    ours, absmax = host_adamw.quantize_blockwise(x, code)
    monkeypatch.setattr(host_adamw, "SIMD", False)  # the scalar loop: the 65536-entry table itself
    table, table_absmax = host_adamw.quantize_blockwise(x, code)
    assert torch.equal(absmax, table_absmax)
    assert torch.equal(ours, table), f"{int((ours != table).sum())} of {x.numel()} codes differ"
    if name in ("signed", "unsigned"):
        theirs, _ = torch.ops.bitsandbytes.quantize_blockwise(x, code, 256)
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("name", ["signed", "unsigned", "wide"])
def test_every_code_in_every_lane_dequantizes_as_the_scalar_loop(kernel, simd, monkeypatch, name):
    code = _codes()[name]
    n = 64 * 256 + 77  # every code at every position of a 64-code group; a tail under 64 (zero-padded copy)
    i = torch.arange(n)
    c1 = ((i + i // 64) % 256).to(torch.uint8)
    absmax = torch.rand(2, n // 256 + 1, generator=torch.Generator().manual_seed(3))
    out = []
    for vector in (True, False):
        monkeypatch.setattr(host_adamw, "SIMD", vector and simd != "scalar")
        state = {"state1": c1.clone(), "state2": c1.flip(0).contiguous(), "qmap1": code,
                 "qmap2": code.abs().sort().values, "absmax1": absmax[0].clone(), "absmax2": absmax[1].clone()}
        p = torch.randn(n, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
        g = (0.01 * torch.randn(n, generator=torch.Generator().manual_seed(5))).to(torch.bfloat16)
        assert host_adamw.adamw8bit_step(p, g, state, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                                         step=3, generator=torch.Generator().manual_seed(6))
        out.append([p] + [state[k] for k in ("state1", "state2", "absmax1", "absmax2")])
    for a, b in zip(*out):
        assert torch.equal(a, b), int((a != b).sum())


def _disassembly(path: str) -> str:
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump (binutils) is not installed")
    return subprocess.run([objdump, "-d", "-C", "--no-show-raw-insn", path], capture_output=True, text=True,
                          check=True).stdout


def test_the_8bit_step_has_no_gathers_where_the_cpu_has_avx512_vbmi(kernel, monkeypatch):
    # A gather of 16 table entries costs more than the rest of the step's arithmetic on Zen 4, and more still
    # on Intel CPUs with the Gather Data Sampling microcode fix: with VBMI the loops must not use one.
    monkeypatch.delenv("LOWMEM_GRPO_HOST_KERNEL_MARCH", raising=False)
    if host_adamw._march != "native":
        pytest.skip(f"the loaded build is for -march={host_adamw._march}, not this CPU")
    if not {"avx512f", "avx512bw", "avx512vbmi"} <= cpu_flags():
        pytest.skip("this CPU has no AVX-512 VBMI: its 8-bit step dequantizes by gathers")
    functions, name = {}, None
    for line in _disassembly(kernel._name).splitlines():
        if line.endswith(">:"):
            name = line
        elif name and "gather" in line:
            functions[name] = functions.get(name, 0) + 1
    eight_bit = {f: k for f, k in functions.items() if "adam8bit" in f or "quantize" in f}
    assert not eight_bit, f"gathers in the 8-bit step: {eight_bit}"


def _edge_blocks() -> torch.Tensor:
    """Random blocks at every scale and the edges of the quantizer's input: all-zero blocks, signed zeros,
    subnormal blocks (1 / absmax is inf: the scaled values are +-inf and NaN), values next to +-1, huge and
    infinite values, and NaN lanes (ignored in the absmax; quantized as -1)."""
    gen = torch.Generator().manual_seed(11)
    tiny = torch.finfo(torch.float32).tiny
    scales = torch.logspace(-40, 38, 64).float()[:, None]
    blocks = [torch.randn(64, 256, generator=gen) * scales, torch.zeros(2, 256), -torch.zeros(1, 256),
              torch.randn(4, 256, generator=gen) * tiny * 2.0 ** -10,
              torch.nextafter(torch.ones(2, 256), torch.zeros(2, 256)) * torch.tensor([[1.0], [-1.0]]),
              torch.full((1, 256), 3.0e38), torch.rand(2, 256, generator=gen) - 0.5]
    x = torch.cat(blocks)
    x[-1, ::7] = float("nan")
    x[-2, ::5] = float("inf")
    x[-2, 1::5] = -float("inf")
    x[-3, 3] = tiny * 2.0 ** -20  # a subnormal in a block of larger values
    return torch.cat([x.flatten(), torch.randn(77, generator=gen)])  # and a tail under 256


@pytest.mark.parametrize("name", ["signed", "unsigned", "wide", "repeated"])
def test_random_and_edge_values_get_the_tables_code_on_every_path(kernel, simd, monkeypatch, name):
    code = _codes()[name]
    x = _edge_blocks()
    ours, absmax = host_adamw.quantize_blockwise(x, code)
    monkeypatch.setattr(host_adamw, "SIMD", False)
    table, table_absmax = host_adamw.quantize_blockwise(x, code)
    assert torch.equal(absmax, table_absmax)
    assert torch.equal(ours, table), f"{int((ours != table).sum())} of {x.numel()} codes differ"
    if name in ("signed", "unsigned"):
        finite = torch.isfinite(x).view(-1)[: x.numel() // 256 * 256].view(-1, 256).all(1)  # bitsandbytes' own
        theirs, _ = torch.ops.bitsandbytes.quantize_blockwise(x, code, 256)       # is only defined there
        head = ours[: finite.numel() * 256].view(-1, 256)[finite]
        assert torch.equal(head, theirs[: finite.numel() * 256].view(-1, 256)[finite])
