"""The fused host kernel for bitsandbytes' 8-bit AdamW (optim/host_adamw.py): bitsandbytes' states
and update, its quantizer, unbiased stochastic rounding, the gradient scale, the fallback, and threads."""

import logging
import math
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from lowmem_grpo.native_build import source_tag
from lowmem_grpo.optim import host_adamw
from lowmem_grpo.optim.host_adamw import host_adamw8bit_class
from lowmem_grpo.optim.sr_adamw import sr_adamw8bit_class
from lowmem_grpo.optim.optimizer_in_backward import NORM_CHUNK, fp32_norm_tensor
from tests.optim.ulp import assert_within_one_bf16_ulp, bf16_ulp

bnb = pytest.importorskip("bitsandbytes")
F = bnb.functional

STATE_KEYS = ("state1", "state2", "absmax1", "absmax2")


@pytest.fixture
def correctly_rounded_sqrt(monkeypatch):
    """torch's CPU sqrt (MKL's) is not always correctly rounded, and how often it is not depends on the CPU
    (module `_sqrt_one_ulp_off`); the kernel's is. With this, bitsandbytes' own CPU step computes the kernel's
    arithmetic exactly on any CPU: weights compare bitwise."""
    torch_sqrt = torch.Tensor.sqrt
    monkeypatch.setattr(torch.Tensor, "sqrt", lambda self: torch_sqrt(self.double()).to(self.dtype))


def _sqrt_one_ulp_off(monkeypatch):
    """Make torch's sqrt one fp32 ulp off on every element (up on even positions, down on odd ones): the worst
    a sqrt that is not correctly rounded does. torch's CPU sqrt is MKL's, whose code path MKL picks per CPU;
    measured with torch 2.13 on an Intel Xeon (Sapphire Rapids): one ulp off on 0.7% of fp32 inputs on its
    AVX-512 path, on none on its AVX2 path, on 15% on its SSE4.2 path (MKL_ENABLE_INSTRUCTIONS=...); ~17% was
    measured on an AMD EPYC. So whether the kernel's weights differ from bitsandbytes' at all depends on the
    CPU."""
    torch_sqrt = torch.Tensor.sqrt

    def sqrt(self):
        exact = torch_sqrt(self.double()).to(self.dtype)
        up = torch.arange(exact.numel()).reshape(exact.shape) % 2 == 0
        return torch.where(up, torch.nextafter(exact, torch.full_like(exact, math.inf)),
                           torch.nextafter(exact, torch.zeros_like(exact)))

    monkeypatch.setattr(torch.Tensor, "sqrt", sqrt)


def _fresh_state(n: int) -> dict:
    blocks = (n + 255) // 256
    return {"state1": torch.zeros(n, dtype=torch.uint8), "state2": torch.zeros(n, dtype=torch.uint8),
            "absmax1": torch.zeros(blocks), "absmax2": torch.zeros(blocks),
            "qmap1": F.create_dynamic_map(signed=True), "qmap2": F.create_dynamic_map(signed=False)}


def _bnb_step(p, g, st, step, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, wd=0.01):
    F.optimizer_update_8bit_blockwise("adam", g, p, st["state1"], st["state2"], betas[0], betas[1], 0.0, 0.0, eps,
                                      step, lr, st["qmap1"], st["qmap2"], st["absmax1"], st["absmax2"], wd,
                                      gnorm_scale=1.0)


def _ours_step(p, g, st, step, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, wd=0.01, **kw):
    assert host_adamw.adamw8bit_step(p, g, st, lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=wd,
                                     step=step, **kw)


def _crafted(qmap: torch.Tensor) -> torch.Tensor:
    """Blocks of 256 with absmax 1 (one element 1.0): every code, the midpoint between each pair of
    neighbouring codes (a tie), the floats just either side of it; then a zero block, a block of negatives
    scaled by 3, and a tail of 77."""
    code = qmap.float()
    mid = 0.5 * (code[:-1] + code[1:])
    values = torch.cat([code, mid, torch.nextafter(mid, torch.full_like(mid, 2.0)),
                        torch.nextafter(mid, torch.full_like(mid, -2.0)), torch.tensor([0.0, -0.0, 1e-30, -1e-30])])
    values = values[(values >= -1) & (values <= 1)]
    blocks = []
    for i in range(0, values.numel(), 255):
        chunk = values[i:i + 255]
        blocks.append(torch.cat([torch.ones(1), chunk, torch.zeros(255 - chunk.numel())]))
    blocks.append(torch.zeros(256))  # absmax 0
    blocks.append(-3.0 * torch.rand(256, generator=torch.Generator().manual_seed(0)))
    blocks.append(torch.randn(77, generator=torch.Generator().manual_seed(1)))  # a tail block
    return torch.cat(blocks)


@pytest.mark.parametrize("signed", [True, False], ids=["qmap1_signed", "qmap2_unsigned"])
def test_quantizer_equals_bitsandbytes_on_crafted_values(kernel, simd, signed):
    qmap = F.create_dynamic_map(signed=signed)
    x = _crafted(qmap)
    if not signed:
        x = x.abs()  # the second moment is never negative
    for values in (x, x[:5], x[:256 + 77]):  # also one tensor smaller than a block, and a tail
        ours, ours_absmax = host_adamw.quantize_blockwise(values, qmap)
        theirs, theirs_absmax = torch.ops.bitsandbytes.quantize_blockwise(values, qmap, 256)
        assert torch.equal(ours_absmax, theirs_absmax)
        assert torch.equal(ours, theirs), f"{int((ours != theirs).sum())} codes differ"


def test_a_value_on_the_midpoint_of_two_codes_takes_the_lower(kernel, simd):
    # bitsandbytes' CPU quantizer rounds x / absmax to a grid of 65536 points, then takes the nearest code, the
    # lower one when the grid point is exactly halfway. A code made of grid points has such midpoints.
    grid = -1.0 + (2.0 * torch.arange(65536, dtype=torch.float32)) / 65535.0  # its grid, in fp32 as there
    code = grid[torch.arange(0, 65536, 256)].contiguous()
    mids = 0.5 * (code[:-1] + code[1:])
    on_grid = torch.isin(mids, grid)
    assert on_grid.sum() > 10  # ties exist for this code
    x = torch.cat([torch.ones(1), mids[on_grid]])
    x = torch.cat([x, torch.zeros(-x.numel() % 256)])
    ours, _ = host_adamw.quantize_blockwise(x, code)
    theirs, _ = torch.ops.bitsandbytes.quantize_blockwise(x, code, 256)
    assert torch.equal(ours, theirs)
    lower = torch.searchsorted(code, mids[on_grid], right=False) - 1  # the code below each midpoint
    assert torch.equal(ours[1:1 + lower.numel()].long(), lower)


def test_simd_and_scalar_loops_round_with_the_same_noise(kernel, monkeypatch):
    n = 256 * 5 + 45
    g = (0.01 * torch.randn(n, generator=torch.Generator().manual_seed(0))).to(torch.bfloat16)
    out = []
    for simd in (True, False):
        monkeypatch.setattr(host_adamw, "SIMD", simd)
        p, st = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16), _fresh_state(n)
        torch.manual_seed(0)
        for step in (1, 2):
            _ours_step(p, g, st, step)
        out.append((p, st))
    assert torch.equal(out[0][0], out[1][0])
    for key in STATE_KEYS:
        assert torch.equal(out[0][1][key], out[1][1][key]), key


@pytest.mark.parametrize("n", [256 * 9 + 77, 256 * 16, 4096 + 3], ids=["tail", "whole_blocks", "just_8bit"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_fp32_weights_step_exactly_as_bitsandbytes(kernel, torch_fuses, simd, correctly_rounded_sqrt, n,
                                                   grad_dtype):
    torch.manual_seed(0)
    ours, theirs = torch.randn(n), None
    theirs = ours.clone()
    st_ours, st_theirs = _fresh_state(n), _fresh_state(n)
    for step in range(1, 5):
        g = (0.01 * torch.randn(n)).to(grad_dtype)
        if step == 1:
            g[: 2 * 256] = 0  # all-zero blocks: absmax 0 after the step
        _ours_step(ours, g, st_ours, step)
        _bnb_step(theirs, g, st_theirs, step)
        for key in STATE_KEYS:
            assert torch.equal(st_ours[key], st_theirs[key]), (step, key)
        assert torch.equal(ours, theirs), (step, int((ours != theirs).sum()))


@pytest.mark.parametrize("sqrt", ["torch", "one_ulp_off"])
def test_whatever_torch_sqrt_rounds_only_the_weights_move_and_by_an_ulp(kernel, torch_fuses, monkeypatch,
                                                                         sqrt):
    # The documented tolerance: torch's sqrt is the one op the kernel does not reproduce; it enters only the
    # weight update, so the states stay bitwise equal and the weights within 2 fp32 ulps of the weight plus
    # of the update's size (|update| <= ~lr; a 1-ulp denominator moves it by an ulp of itself). The bound
    # holds with torch's sqrt as this CPU computes it (which may round as the kernel's everywhere: then the
    # weights are equal) and with a sqrt one ulp off on every element, where the weights must differ.
    if sqrt == "one_ulp_off":
        _sqrt_one_ulp_off(monkeypatch)
    torch.manual_seed(0)
    n = 256 * 40 + 5
    ours = torch.randn(n)
    theirs = ours.clone()
    st_ours, st_theirs = _fresh_state(n), _fresh_state(n)
    for step in range(1, 4):
        g = 0.01 * torch.randn(n)
        _ours_step(ours, g, st_ours, step)
        _bnb_step(theirs, g, st_theirs, step)
    for key in STATE_KEYS:
        assert torch.equal(st_ours[key], st_theirs[key]), key
    lr = 1e-3
    bound = 2 * torch.finfo(torch.float32).eps * (theirs.abs() + 3 * lr)
    assert ((ours - theirs).abs() <= bound).all()
    if sqrt == "one_ulp_off":
        assert not torch.equal(ours, theirs)  # the bound is met where the sqrt results do differ


def test_one_step_is_within_a_code_and_two_ulps_of_bitsandbytes_any_cpu(kernel, simd):
    # The bound that holds whatever torch's CPU kernels round like (fused multiply-adds or not, any sqrt
    # within an ulp): from the same state, one step of ours and of bitsandbytes' own CPU path. m and v may
    # differ by an fp32 ulp, so each block's absmax by an ulp of itself and each code by at most one place (a
    # value on the other side of a boundary of the 65536-point grid); the weights within 2 fp32 ulps of the
    # weight plus of the update's size.
    torch.manual_seed(0)
    n = 256 * 24 + 77
    p, st = torch.randn(n), _fresh_state(n)
    for step in range(1, 4):  # states away from zero
        _ours_step(p, 0.01 * torch.randn(n), st, step)
    ours, theirs = p.clone(), p.clone()
    st_ours, st_theirs = ({k: v.clone() for k, v in st.items()} for _ in range(2))
    g = 0.01 * torch.randn(n)
    _ours_step(ours, g, st_ours, 4)
    _bnb_step(theirs, g, st_theirs, 4)
    eps = torch.finfo(torch.float32).eps
    for key in ("absmax1", "absmax2"):
        assert ((st_ours[key] - st_theirs[key]).abs() <= eps * st_theirs[key]).all()
    for key in ("state1", "state2"):
        assert (st_ours[key].int() - st_theirs[key].int()).abs().max() <= 1, key
    bound = 2 * eps * (theirs.abs() + 3 * 1e-3)
    assert ((ours - theirs).abs() <= bound).all()


def test_bf16_weights_land_within_one_ulp_of_bitsandbytes_fp32_step(kernel, torch_fuses, simd):
    # One update from the same bf16 start: bitsandbytes' fp32 step on the widened weights, ours on the bf16
    # weights with stochastic rounding: same states, weights within one bf16 ulp.
    torch.manual_seed(0)
    n = 256 * 12 + 31
    ours = torch.randn(n).to(torch.bfloat16)
    st_ours, st_theirs = _fresh_state(n), _fresh_state(n)
    for step in range(1, 4):
        theirs = ours.float()
        g = (0.01 * torch.randn(n)).to(torch.bfloat16)
        _ours_step(ours, g, st_ours, step, lr=1e-2)
        _bnb_step(theirs, g, st_theirs, step, lr=1e-2)
        assert_within_one_bf16_ulp(theirs, ours, f"step {step}")
        for key in STATE_KEYS:
            assert torch.equal(st_ours[key], st_theirs[key]), (step, key)


def test_bf16_weights_without_stochastic_rounding_step_as_bitsandbytes(kernel, torch_fuses, simd,
                                                                        correctly_rounded_sqrt):
    # stochastic_rounding=False: round to nearest even, as bitsandbytes' own step on bf16 weights does
    torch.manual_seed(0)
    n = 256 * 6 + 100
    ours = torch.randn(n).to(torch.bfloat16)
    theirs = ours.clone()
    st_ours, st_theirs = _fresh_state(n), _fresh_state(n)
    for step in range(1, 4):
        g = (0.01 * torch.randn(n)).to(torch.bfloat16)
        _ours_step(ours, g, st_ours, step, lr=1e-2, stochastic_rounding=False)
        _bnb_step(theirs, g, st_theirs, step, lr=1e-2)
        assert torch.equal(ours, theirs), step
    for key in STATE_KEYS:
        assert torch.equal(st_ours[key], st_theirs[key]), key


def test_stochastic_rounding_is_unbiased(kernel, simd):
    # Every element takes the same fp32 update (same weight, gradient, zero states), which falls between
    # two bf16 neighbours a < x < b: each result is a or b, and over N elements x R rounds the mean is x
    # within 5 standard deviations, sd = sqrt((x - a)(b - x) / (N R)).
    n, rounds = 4096, 50
    start = torch.full((n,), 1.5, dtype=torch.bfloat16)
    g = torch.full((n,), 1e-3, dtype=torch.bfloat16)
    exact = start.float()
    _bnb_step(exact, g, _fresh_state(n), 1, lr=1e-3, wd=0.0)
    x = float(exact[0])  # 1.5 - 1e-3: between 1.4921875 and 1.5, bf16's spacing in [1, 2) being 2**-7
    a = float((exact[:1].view(torch.int32) & -65536).view(torch.float32))  # truncated to bf16
    b = a + float(bf16_ulp(torch.tensor(a)))
    assert a < x < b  # the update is not a bf16 value: it has to be rounded
    torch.manual_seed(0)
    results = []
    for _ in range(rounds):
        p = start.clone()
        _ours_step(p, g, _fresh_state(n), 1, lr=1e-3, wd=0.0)
        results.append(p.float())
    r = torch.stack(results)
    assert set(r.unique().tolist()) == {a, b}
    sd = math.sqrt((x - a) * (b - x) / r.numel())
    assert abs(float(r.double().mean()) - x) < 5 * sd, (float(r.double().mean()), x, sd)
    assert 0.05 < float((r == b).double().mean()) < 0.95  # both neighbours are taken, not one always


def test_rounding_noise_follows_the_seed_not_the_thread_count(kernel, simd):
    n = 256 * 300 + 9  # over 64 blocks: the kernel splits it across threads
    g = (0.01 * torch.randn(n, generator=torch.Generator().manual_seed(0))).to(torch.bfloat16)
    start = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    threads = torch.get_num_threads()
    out = {}
    try:
        for t, seed in ((threads, 0), (1, 0), (threads, 1)):
            torch.set_num_threads(t)
            torch.manual_seed(seed)
            p, st = start.clone(), _fresh_state(n)
            for step in (1, 2):
                _ours_step(p, g, st, step)
            out[(t, seed)] = (p, st)
    finally:
        torch.set_num_threads(threads)
    (p0, st0), (p1, st1), (p2, _) = out[(threads, 0)], out[(1, 0)], out[(threads, 1)]
    assert torch.equal(p0, p1)
    for key in STATE_KEYS:
        assert torch.equal(st0[key], st1[key]), key
    assert not torch.equal(p0, p2)  # another seed, other noise


def _params(dtype, seed=0, shapes=((64, 96), (300,))):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]


def _step_all(opt, params, grads):
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.step()


def test_optimizer_state_dict_loads_either_way(kernel, torch_fuses, correctly_rounded_sqrt):
    # Our class and bitsandbytes' AdamW8bit share the state format: a state saved by one continues in the
    # other exactly (fp32 weights; the 300-element tensor keeps fp32 states, as in bitsandbytes).
    torch.manual_seed(0)
    grads = [[0.01 * torch.randn(64, 96), 0.01 * torch.randn(300)] for _ in range(4)]
    classes = {"ours": host_adamw8bit_class(), "bnb": bnb.optim.AdamW8bit}
    for first, second in (("ours", "bnb"), ("bnb", "ours")):
        a_params, b_params = _params(torch.float32), _params(torch.float32)
        a = classes[first](a_params, lr=1e-3, min_8bit_size=4096)
        for g in grads[:2]:
            _step_all(a, a_params, g)
        b = classes[second](b_params, lr=1e-3, min_8bit_size=4096)
        with torch.no_grad():
            for pa, pb in zip(a_params, b_params):
                pb.copy_(pa)
        b.load_state_dict(a.state_dict())
        assert b.state[b_params[0]]["state1"].dtype == torch.uint8
        assert b.state[b_params[1]]["state1"].dtype == torch.float32
        for g in grads[2:]:
            _step_all(a, a_params, g)
            _step_all(b, b_params, g)
        for pa, pb in zip(a_params, b_params):
            assert torch.equal(pa, pb), (first, second)
            for key in a.state[pa]:
                va, vb = a.state[pa][key], b.state[pb][key]
                assert torch.equal(va, vb) if torch.is_tensor(va) else va == vb, (first, second, key)


@pytest.mark.parametrize("fused", [True, False], ids=["kernel", "fallback"])
def test_grad_scale_equals_a_premultiplied_gradient(monkeypatch, fused):
    if fused and host_adamw.library() is None:
        pytest.skip(f"the host kernel did not build here: {host_adamw._load_error}")
    if not fused:
        monkeypatch.setattr(host_adamw, "_library", None)
        monkeypatch.setattr(host_adamw, "_load_error", "off in this test")
    cls = host_adamw8bit_class()
    scaled_params, premultiplied_params = _params(torch.float32), _params(torch.float32)
    scaled = cls(scaled_params, lr=1e-3, min_8bit_size=4096)
    premultiplied = cls(premultiplied_params, lr=1e-3, min_8bit_size=4096)
    torch.manual_seed(0)
    for step in range(3):
        grads = [0.01 * torch.randn(64, 96), 0.01 * torch.randn(300)]
        coef = 0.3 if step != 1 else 1.0
        scaled.param_groups[0]["grad_scale"] = coef
        _step_all(scaled, scaled_params, grads)
        assert scaled.param_groups[0]["grad_scale"] == 1.0  # used up by the step
        _step_all(premultiplied, premultiplied_params, [g * coef for g in grads])
    for a, b in zip(scaled_params, premultiplied_params):
        assert torch.equal(a, b)


def test_a_failed_build_warns_once_and_steps_as_sr_adamw(monkeypatch, caplog):
    def no_compiler(march="native"):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(host_adamw, "_build", no_compiler)
    monkeypatch.setattr(host_adamw, "_library", None)
    monkeypatch.setattr(host_adamw, "_load_error", None)
    ours_params, sr_params = _params(torch.bfloat16), _params(torch.bfloat16)
    ours = host_adamw8bit_class()(ours_params, lr=1e-3, min_8bit_size=4096)
    sr = sr_adamw8bit_class()(sr_params, lr=1e-3, min_8bit_size=4096)
    grads = [(0.01 * torch.randn(64, 96)).to(torch.bfloat16), (0.01 * torch.randn(300)).to(torch.bfloat16)]
    with caplog.at_level(logging.WARNING, logger=host_adamw.__name__):
        for opt, params in ((ours, ours_params), (sr, sr_params)):
            torch.manual_seed(3)
            for _ in range(2):
                _step_all(opt, params, grads)
    warnings = [r for r in caplog.records if r.name == host_adamw.__name__]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "Ninja is required" in warnings[0].getMessage() and "pip install ninja" in warnings[0].getMessage()
    for a, b in zip(ours_params, sr_params):
        assert torch.equal(a, b)


def test_kernel_status_says_the_native_kernel_is_loaded(kernel):
    status = host_adamw.kernel_status(require=True)
    assert status.native and status.reason == ""
    assert status.path is not None and Path(status.path).is_file()
    assert status.simd_lanes == kernel.simd_lanes() in (1, 8, 16)
    assert status.march == os.environ.get("LOWMEM_GRPO_HOST_KERNEL_MARCH", "native")
    assert status.threads == torch.get_num_threads()
    assert str(status).startswith("host optimizer kernel: native")
    # the build is named after its sources: another checkout's kernel in the same cache is another build
    flags = [f if f != "-march=native" else f"-march={status.march}" for f in host_adamw.CFLAGS]
    assert source_tag([*host_adamw.SOURCES, *host_adamw.HEADERS], flags) in Path(status.path).name


def test_kernel_status_after_a_failed_build_gives_the_reason_and_raises_on_request(monkeypatch, caplog):
    def broken_build(march="native"):  # what cpp_extension raises when the compiler fails (its output kept)
        raise RuntimeError("Error building extension 'lowmem_grpo_host_adamw_x':\n"
                           "[1/2] c++ -c host_adamw.cpp\n"
                           "host_adamw.cpp:40:10: fatal error: immintrin.h: No such file or directory\n"
                           "ninja: build stopped: subcommand failed.")

    monkeypatch.setattr(host_adamw, "_build", broken_build)
    monkeypatch.setattr(host_adamw, "_library", None)
    monkeypatch.setattr(host_adamw, "_load_error", None)
    with caplog.at_level(logging.WARNING, logger=host_adamw.__name__):
        status = host_adamw.kernel_status()
        assert host_adamw.kernel_status() == status  # the same answer; no second build, no second warning
        with pytest.raises(host_adamw.HostKernelUnavailable, match="immintrin.h: No such file") as raised:
            host_adamw.kernel_status(require=True)
    assert not status.native and status.simd_lanes == 0 and status.path is None
    assert "fatal error: immintrin.h" in status.reason and "pip install ninja" in status.reason
    assert "FALLBACK" in str(raised.value)
    assert len([r for r in caplog.records if r.name == host_adamw.__name__]) == 1


def test_kernel_status_when_switched_off(monkeypatch):
    monkeypatch.setenv("LOWMEM_GRPO_HOST_KERNEL", "0")
    monkeypatch.setattr(host_adamw, "_library", None)
    monkeypatch.setattr(host_adamw, "_load_error", None)
    status = host_adamw.kernel_status()
    assert not status.native and "LOWMEM_GRPO_HOST_KERNEL=0" in status.reason
    with pytest.raises(host_adamw.HostKernelUnavailable, match="LOWMEM_GRPO_HOST_KERNEL=0"):
        host_adamw.kernel_status(require=True)


def test_grad_sum_squares_in_fp32_chunks_whatever_the_threads(kernel):
    g = torch.randn(3 * (1 << 16) + 5, generator=torch.Generator().manual_seed(0))
    exact = float(g.double().pow(2).sum())
    threads = torch.get_num_threads()
    try:
        totals = set()
        for t in (1, threads):
            torch.set_num_threads(t)
            for x in (g, g.to(torch.bfloat16)):
                totals.add((x.dtype, host_adamw.grad_sum_squares(x)))
    finally:
        torch.set_num_threads(threads)
    assert len(totals) == 2  # one value per dtype: the thread count changes nothing
    assert host_adamw.grad_sum_squares(g) == pytest.approx(exact, rel=1e-5)


def test_grad_norm_is_the_kernels_above_one_chunk_and_the_plain_paths_below(kernel):
    # Above one fp32_norm_tensor chunk the kernel's pass; up to it (and for a strided tensor) the chunks,
    # which for one chunk are torch's vector_norm: what clip_grad_norm_ takes.
    g = torch.randn(NORM_CHUNK + 1000, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    norm = host_adamw.grad_norm(g)
    assert norm.dtype == torch.float32 and norm.dim() == 0
    assert float(norm) == float(torch.tensor(math.sqrt(host_adamw.grad_sum_squares(g)), dtype=torch.float32))
    assert float(norm) == pytest.approx(float(g.double().norm()), rel=1e-5)
    for small in (g[:NORM_CHUNK], g[::2]):
        assert torch.equal(host_adamw.grad_norm(small), fp32_norm_tensor(small))
    assert torch.equal(host_adamw.grad_norm(g[:1000]), torch.linalg.vector_norm(g[:1000], dtype=torch.float32))


def test_the_kernel_releases_the_gil(kernel, monkeypatch):
    # The offloaded update may run on a worker thread beside autograd: while the kernel computes, other
    # Python threads must run. The main thread stamps the time on each turn of a loop. Had a kernel call held
    # the GIL, no stamp could fall inside it: the longest stamp-free gap would cover the whole call.
    spans = []

    class Timed:  # the library, with each kernel call's start and end recorded
        def __getattr__(self, name):
            return getattr(kernel, name)

        def adamw8bit_step(self, *args):
            t0 = time.perf_counter()
            rc = kernel.adamw8bit_step(*args)
            spans.append((t0, time.perf_counter()))
            return rc

    monkeypatch.setattr(host_adamw, "_library", Timed())
    n = 8 << 20
    p, g, st = torch.randn(n), 0.01 * torch.randn(n), _fresh_state(n)
    stamps = []
    done = threading.Event()

    def worker():
        for step in range(1, 4):
            _ours_step(p, g, st, step)
        done.set()

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core for the kernel, one for this thread
    try:
        t = threading.Thread(target=worker)
        t.start()
        while not done.is_set():
            stamps.append(time.perf_counter())
        t.join()
    finally:
        torch.set_num_threads(threads)
    stamps = torch.tensor(stamps, dtype=torch.float64)
    for a, b in spans:
        inside = stamps[(stamps > a) & (stamps < b)]
        edges = torch.cat([torch.tensor([a], dtype=torch.float64), inside, torch.tensor([b], dtype=torch.float64)])
        assert edges.diff().max() < 0.5 * (b - a), (float(edges.diff().max()), b - a, inside.numel())


@pytest.mark.slow
def test_large_tensor_steps_exactly_as_bitsandbytes(kernel, torch_fuses, correctly_rounded_sqrt):
    n = (1 << 24) + 1000  # 16.8M elements (an embedding's size), split across threads
    torch.manual_seed(0)
    ours = torch.randn(n)
    theirs = ours.clone()
    st_ours, st_theirs = _fresh_state(n), _fresh_state(n)
    for step in (1, 2):
        g = 0.01 * torch.randn(n)
        _ours_step(ours, g, st_ours, step)
        _bnb_step(theirs, g, st_theirs, step)
    for key in STATE_KEYS:
        assert torch.equal(st_ours[key], st_theirs[key]), key
    assert torch.equal(ours, theirs)


@pytest.mark.cuda
def test_cuda_parameters_take_bitsandbytes_own_path():
    # The kernel is for host tensors; on CUDA the class steps exactly as sr_adamw's (bitsandbytes' kernel +
    # the chunked stochastic rounding), with the same generator state.
    torch.manual_seed(0)
    base = torch.randn(5, 4 * 256 + 3, device="cuda").to(torch.bfloat16)
    ours, theirs = torch.nn.Parameter(base.clone()), torch.nn.Parameter(base.clone())
    opt_ours = host_adamw8bit_class()([ours], lr=1e-3, min_8bit_size=1)
    opt_theirs = sr_adamw8bit_class()([theirs], lr=1e-3, min_8bit_size=1)
    for _ in range(3):
        g = (0.01 * torch.randn_like(base, dtype=torch.float32)).to(torch.bfloat16)
        for opt, p in ((opt_ours, ours), (opt_theirs, theirs)):
            p.grad = g.clone()
            torch.manual_seed(1)
            opt.step()
    torch.cuda.synchronize()
    assert torch.equal(ours, theirs)
    for key in STATE_KEYS:
        assert torch.equal(opt_ours.state[ours][key], opt_theirs.state[theirs][key]), key
