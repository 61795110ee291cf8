"""The fused host kernel for fp32 AdamW (optim/host_adamw.py `HostAdamW`, `adamw_step`): torch AdamW's
arithmetic and state format, the bf16 gradient read as it is, the clip inside the pass, the rounded upload
copy, torch's path for what the kernel does not do, and the fallback without the compiled kernel."""

import copy
import logging

import pytest
import torch

from lowmem_grpo.optim import host_adamw
from lowmem_grpo.optim.host_adamw import HostAdamW
from tests.optim.conftest import torch_rounds_like_the_kernel

STATES = ("exp_avg", "exp_avg_sq")
TORCH_TAIL = 16  # torch's fused CPU AdamW (AVX-512) does the last n % 16 elements in its scalar loop


@pytest.fixture
def no_kernel(monkeypatch):
    monkeypatch.setattr(host_adamw, "_library", None)
    monkeypatch.setattr(host_adamw, "_load_error", "off in this test")


def _pair(n_or_shapes, seed=0, **kw):
    """(params, torch.optim.AdamW(fused=True), params, HostAdamW (fused=True for torch's path)) from one start."""
    shapes = n_or_shapes if isinstance(n_or_shapes, list) else [(n_or_shapes,)]
    g = torch.Generator().manual_seed(seed)
    start = [torch.randn(s, generator=g) for s in shapes]
    ours = [torch.nn.Parameter(t.clone()) for t in start]
    theirs = [torch.nn.Parameter(t.clone()) for t in start]
    return theirs, torch.optim.AdamW(theirs, fused=True, **kw), ours, HostAdamW(ours, fused=True, **kw)


def _assert_close(ours, theirs, what, rel=1e-6):
    """Every element within `rel` of the tensor's largest magnitude (an element near zero may differ by an
    ulp of its neighbours' size: the update's rounding, not its own)."""
    ours, theirs = ours.detach(), theirs.detach()
    err = float((ours - theirs).abs().max() / theirs.abs().max())
    assert err <= rel, f"{what}: relative error {err:.3g}"


@pytest.mark.parametrize("n", [16 * 1000 + 7, 3 * (1 << 14) + 5, 11], ids=["tail", "threads", "tiny"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_steps_as_torch_fused_adamw(kernel, torch_fuses, simd, n, grad_dtype):
    # torch's fused CPU AdamW op for op: bitwise equal except in the last n % 16 elements, which torch's
    # kernel does in a scalar loop that rounds v * beta2 before adding (1 - beta2) g^2 (one fp32 ulp of v
    # there, at most); those within 1e-6 relative. Weight decay, bias correction from step 1, a new lr each
    # step; a bf16 gradient is read as it is (torch gets it widened, exactly).
    theirs, opt_theirs, ours, opt_ours = _pair(n, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    (a,), (b,) = theirs, ours
    body = n - n % TORCH_TAIL
    for step, lr in enumerate([1e-3, 3e-3, 5e-4, 2e-3, 1e-3]):
        g = (0.01 * torch.randn(n, generator=torch.Generator().manual_seed(step))).to(grad_dtype)
        opt_theirs.param_groups[0]["lr"] = lr
        a.grad = g.float()
        opt_theirs.step()
        assert opt_ours.step_fused(b, g.clone(), lr=lr)
        pairs = [("param", a, b)] + [(k, opt_theirs.state[a][k], opt_ours.state[b][k]) for k in STATES]
        for what, x, y in pairs:
            assert torch.equal(x[:body], y[:body]), (step, what, int((x[:body] != y[:body]).sum()))
            _assert_close(y, x, f"step {step} {what}")
        assert float(opt_ours.state[b]["step"]) == step + 1
        assert opt_ours.param_groups[0]["lr"] == lr


def test_within_1e_6_of_torch_unfused_adamw_with_two_groups_any_cpu(kernel):
    # torch's default (fused=False) path: the weights and states within 1e-6 relative after several steps (its
    # sqrt is not always correctly rounded: a weight here and there an ulp away); the states bitwise equal
    # where torch's CPU kernels fuse multiply-adds as the kernel does. Two groups: weight decay on one, off on
    # the other.
    g0 = torch.Generator().manual_seed(0)
    start = [torch.randn(64, 96, generator=g0), torch.randn(301, generator=g0)]
    theirs = [torch.nn.Parameter(t.clone()) for t in start]
    ours = [torch.nn.Parameter(t.clone()) for t in start]
    kw = dict(lr=1e-3, betas=(0.8, 0.99), eps=1e-6)
    opt_theirs = torch.optim.AdamW([{"params": theirs[:1], "weight_decay": 0.05},
                                    {"params": theirs[1:], "weight_decay": 0.0}], foreach=False, **kw)
    opt_ours = HostAdamW([{"params": ours[:1], "weight_decay": 0.05}, {"params": ours[1:], "weight_decay": 0.0}],
                         **kw)
    for step, lr in enumerate([1e-3, 2e-3, 5e-4, 1e-3, 3e-3, 1e-3]):
        grads = [0.01 * torch.randn(t.shape, generator=torch.Generator().manual_seed(step)) for t in start]
        for opt, params in ((opt_theirs, theirs), (opt_ours, ours)):
            for group in opt.param_groups:
                group["lr"] = lr
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
    exact = torch_rounds_like_the_kernel()
    for a, b in zip(theirs, ours):
        _assert_close(b, a, "param")
        for k in STATES:
            _assert_close(opt_ours.state[b][k], opt_theirs.state[a][k], k)
            assert torch.equal(opt_ours.state[b][k], opt_theirs.state[a][k]) or not exact, k


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_offloaded_update_equals_clip_widen_step_and_copy(kernel, torch_fuses, simd, grad_dtype):
    # offload.py's update of an fp32 master before the kernel: the gradient buffer clipped in place in its own
    # dtype by the clip coefficient (a tensor of that dtype), widened to fp32, torch's fused step, the master
    # rounded to nearest into the gradient buffer for upload. step_fused does it in one pass, writing the
    # rounded master over the gradient it reads: the same bits (n a multiple of torch's vector width).
    n = 16 * 700
    theirs, opt_theirs, ours, opt_ours = _pair(n, lr=1e-3, weight_decay=0.01)
    (a,), (b,) = theirs, ours
    for step in range(4):
        g = (0.02 * torch.randn(n, generator=torch.Generator().manual_seed(step))).to(grad_dtype)
        coef = torch.tensor(0.37 if step != 2 else 1.0).to(grad_dtype)  # clamp(max_norm / (norm + 1e-6), max=1)
        buffer_theirs, buffer_ours = g.clone(), g.clone()
        if float(coef) < 1.0:  # offload.py clip_gradient
            buffer_theirs.mul_(coef)
        a.grad = buffer_theirs.float()
        opt_theirs.step()
        upload_theirs = buffer_theirs.copy_(a.detach()) if grad_dtype == torch.bfloat16 else a.detach()
        round_into = buffer_ours if grad_dtype == torch.bfloat16 else None
        assert opt_ours.step_fused(b, buffer_ours, lr=1e-3, grad_scale=min(float(coef), 1.0), round_into=round_into)
        assert torch.equal(a, b), (step, int((a != b).sum()))
        if round_into is not None:
            assert torch.equal(upload_theirs, round_into), step
        for k in STATES:
            assert torch.equal(opt_theirs.state[a][k], opt_ours.state[b][k]), (step, k)


def test_rounded_copy_is_torch_round_to_nearest_even(kernel, simd):
    # Weights on and next to ties between bf16 neighbours, tiny and huge ones: the copy is torch's .to(bf16).
    n = 4096 + 13
    p = torch.nn.Parameter(torch.randn(n, generator=torch.Generator().manual_seed(0)))
    with torch.no_grad():
        bits = p.view(torch.int32)
        bits[:1024] = (bits[:1024] & -65536) | 0x8000  # exactly halfway: ties to even
        bits[1024:2048] = (bits[1024:2048] & -65536) | 0x7fff  # just below halfway
        p[2048:2100] = torch.tensor([3.0e38, -3.0e38, 1e-40, -1e-40] * 13)  # near overflow, subnormal
    opt = HostAdamW([p], lr=1e-12, weight_decay=0.0)  # an update far below every weight's ulp: p unchanged
    out = torch.empty(n, dtype=torch.bfloat16)
    before = p.detach().clone()
    assert opt.step_fused(p, torch.zeros(n), round_into=out)
    assert torch.equal(p.detach(), before)
    assert torch.equal(out, before.to(torch.bfloat16))


def test_grad_scale_in_step_equals_a_premultiplied_gradient(kernel):
    # The param-group key, as HostAdamW8bit's: used by one step, then back to 1.0.
    shapes = [(64, 96), (300,)]
    _, _, scaled_params, scaled = _pair(shapes, lr=1e-3, weight_decay=0.01)
    _, _, pre_params, premultiplied = _pair(shapes, lr=1e-3, weight_decay=0.01)
    for step in range(3):
        grads = [0.01 * torch.randn(s, generator=torch.Generator().manual_seed(step)) for s in shapes]
        coef = 0.3 if step != 1 else 1.0
        scaled.param_groups[0]["grad_scale"] = coef
        for p, g in zip(scaled_params, grads):
            p.grad = g.clone()
        scaled.step()
        assert scaled.param_groups[0]["grad_scale"] == 1.0
        for p, g in zip(pre_params, grads):
            p.grad = g * coef
        premultiplied.step()
    for a, b in zip(scaled_params, pre_params):
        assert torch.equal(a, b)


def test_thread_count_changes_nothing(kernel):
    n = 5 * (1 << 14) + 3  # several work items of the kernel's parallel loop
    results = []
    threads = torch.get_num_threads()
    try:
        for t in (1, max(2, threads)):
            torch.set_num_threads(t)
            _, _, (p,), opt = _pair(n, lr=1e-3, weight_decay=0.01)
            for step in range(2):
                g = (0.01 * torch.randn(n, generator=torch.Generator().manual_seed(step))).to(torch.bfloat16)
                assert opt.step_fused(p, g)
            results.append((p.detach().clone(), *(opt.state[p][k].clone() for k in STATES)))
    finally:
        torch.set_num_threads(threads)
    for x, y in zip(*results):
        assert torch.equal(x, y)


@pytest.mark.parametrize("option", ["amsgrad", "maximize"])
def test_what_the_kernel_does_not_do_steps_in_torch_adamw(kernel, option):
    # amsgrad and maximize are torch's: those groups step in torch's own AdamW, bitwise as torch.optim.AdamW.
    theirs, opt_theirs, ours, opt_ours = _pair([(40, 17)], lr=1e-2, weight_decay=0.01, **{option: True})
    (a,), (b,) = theirs, ours
    assert not opt_ours.step_fused(b, torch.zeros(40, 17))  # refused, nothing touched
    assert not opt_ours.state[b]
    for step in range(3):
        g = torch.randn(40, 17, generator=torch.Generator().manual_seed(step))
        a.grad, b.grad = g.clone(), g.clone()
        opt_theirs.step()
        opt_ours.step()
    assert torch.equal(a, b)
    if option == "amsgrad":
        assert torch.equal(opt_theirs.state[a]["max_exp_avg_sq"], opt_ours.state[b]["max_exp_avg_sq"])


def test_mixed_parameters_kernel_and_torch_in_one_step(kernel):
    # fp64 weights are torch's to step, fp32 ones the kernel's, in one optimizer: each as torch does it.
    g0 = torch.Generator().manual_seed(0)
    start = [torch.randn(33, 16, generator=g0), torch.randn(50, generator=g0, dtype=torch.float64)]
    theirs = [torch.nn.Parameter(t.clone()) for t in start]
    ours = [torch.nn.Parameter(t.clone()) for t in start]
    opt_theirs = torch.optim.AdamW(theirs, lr=1e-3, fused=True)
    opt_ours = HostAdamW(ours, lr=1e-3, fused=True)
    for step in range(3):
        for a, b in zip(theirs, ours):
            g = torch.randn(a.shape, dtype=a.dtype, generator=torch.Generator().manual_seed(step))
            a.grad, b.grad = g.clone(), g.clone()
        opt_theirs.step()
        opt_ours.step()
    for a, b in zip(theirs, ours):
        assert torch.equal(a, b)
        assert b.grad is not None  # the kernel's parameters got their .grad back after torch's step


def test_state_dict_loads_either_way(kernel, torch_fuses):
    # HostAdamW's state is torch AdamW's: a state saved by one continues in the other exactly (sizes a
    # multiple of 16, where the two compute the same bits).
    shapes = [(64, 96), (304,)]
    grads = [[0.01 * torch.randn(s, generator=torch.Generator().manual_seed(10 * i + j)) for j, s in
              enumerate(shapes)] for i in range(4)]
    # (the groups' `fused` travels in the state_dict: both fused, as optimizers.py builds them)
    classes = {"ours": lambda params, **kw: HostAdamW(params, fused=True, **kw),
               "torch": lambda params, **kw: torch.optim.AdamW(params, fused=True, **kw)}
    for first, second in (("ours", "torch"), ("torch", "ours")):
        g0 = torch.Generator().manual_seed(0)
        a_params = [torch.nn.Parameter(torch.randn(s, generator=g0)) for s in shapes]
        b_params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
        a = classes[first](a_params, lr=1e-3, weight_decay=0.01)
        for gs in grads[:2]:
            for p, g in zip(a_params, gs):
                p.grad = g.clone()
            a.step()
        b = classes[second](b_params, lr=1e-3, weight_decay=0.01)
        with torch.no_grad():
            for pa, pb in zip(a_params, b_params):
                pb.copy_(pa)
        b.load_state_dict(copy.deepcopy(a.state_dict()))  # (as from a file: torch would share the tensors)
        for gs in grads[2:]:
            for opt, params in ((a, a_params), (b, b_params)):
                for p, g in zip(params, gs):
                    p.grad = g.clone()
                opt.step()
        for pa, pb in zip(a_params, b_params):
            assert torch.equal(pa, pb), (first, second)
            assert set(a.state[pa]) == set(b.state[pb]) == {"step", "exp_avg", "exp_avg_sq"}
            for key in a.state[pa]:
                assert a.state[pa][key].dtype == b.state[pb][key].dtype, key
                assert torch.equal(a.state[pa][key], b.state[pb][key]), (first, second, key)


def test_without_the_kernel_steps_as_torch_and_step_fused_declines(no_kernel):
    theirs, opt_theirs, ours, opt_ours = _pair([(64, 96), (300,)], lr=1e-3, weight_decay=0.01)
    g = torch.randn(300).to(torch.bfloat16)
    assert not opt_ours.step_fused(ours[1], g, round_into=g.clone())  # offload.py then takes its own path
    assert not opt_ours.state[ours[1]]
    for step in range(3):
        coef = 0.5 if step == 1 else 1.0
        for a, b in zip(theirs, ours):
            grad = torch.randn(a.shape, generator=torch.Generator().manual_seed(step))
            a.grad, b.grad = grad * coef, grad.clone()
        opt_ours.param_groups[0]["grad_scale"] = coef  # the fallback multiplies the gradient itself
        opt_theirs.step()
        opt_ours.step()
    for a, b in zip(theirs, ours):
        assert torch.equal(a, b)


def test_a_failed_build_warns_once_then_torch_steps(monkeypatch, caplog):
    def no_compiler(march="native"):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(host_adamw, "_build", no_compiler)
    monkeypatch.setattr(host_adamw, "_library", None)
    monkeypatch.setattr(host_adamw, "_load_error", None)
    theirs, opt_theirs, ours, opt_ours = _pair([(30, 7)], lr=1e-3)
    with caplog.at_level(logging.WARNING, logger=host_adamw.__name__):
        for step in range(2):
            g = torch.randn(30, 7, generator=torch.Generator().manual_seed(step))
            theirs[0].grad, ours[0].grad = g.clone(), g.clone()
            opt_theirs.step()
            opt_ours.step()
    warnings = [r.getMessage() for r in caplog.records if r.name == host_adamw.__name__]
    assert len(warnings) == 1 and "pip install ninja" in warnings[0], warnings
    assert torch.equal(theirs[0], ours[0])


def test_optimizers_offload_adamw_uses_the_kernel(kernel):
    # optim.optimizer=adamw with offload_optimizer: the inner optimizers on the host are HostAdamW.
    from lowmem_grpo.config import OptimConfig
    from lowmem_grpo.optim.optimizers import build_optimizer

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)).to(torch.bfloat16)
    opt = build_optimizer(model, OptimConfig(optimizer="adamw", offload_optimizer=True, max_grad_norm=1.0))
    try:
        assert all(type(inner) is HostAdamW for inner in opt.inner.values())
        assert all(opt.host[p].dtype == torch.float32 for p in opt.params)
    finally:
        opt.release_host_memory()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_offloaded_adamw_with_the_kernel_equals_torch_fused_inner(kernel, torch_fuses, monkeypatch,
                                                                  dtype):
    # The offloaded optimizer as optimizers.py builds it for optim.optimizer=adamw (fp32 masters, HostAdamW
    # inside) against the same with torch's fused AdamW inside: two micro-batches per step, the global clip
    # active, three steps: device weights, masters and states the same bits (every tensor of this model is a
    # multiple of 16 elements, where the two compute alike). The kernel does run.
    from lowmem_grpo.optim.offload import OffloadedOptimizer
    from tests.optim.test_offload import _loss, _model

    calls, widened = [], []
    real, real_step = host_adamw.adamw_step, HostAdamW.step
    monkeypatch.setattr(host_adamw, "adamw_step", lambda *a, **k: calls.append(1) or real(*a, **k))
    # offload.py's _update takes the one pass (step_fused): never step() on a widened fp32 copy
    monkeypatch.setattr(HostAdamW, "step", lambda self, *a, **k: widened.append(1) or real_step(self, *a, **k))
    models = [_model(dtype), _model(dtype)]
    assert all(p.numel() % TORCH_TAIL == 0 for p in models[0].parameters())
    kw = dict(lr=1e-2, weight_decay=0.01, fused=True)
    inner = [lambda g: HostAdamW(g, **kw), lambda g: torch.optim.AdamW(g, **kw)]
    opts = [OffloadedOptimizer([{"params": list(m.parameters()), "lr": 1e-2}], make, 0.05,
                                         master_fp32=True) for m, make in zip(models, inner)]
    try:
        for step in range(3):
            for model, opt in zip(models, opts):
                opt.begin_step()
                for micro in range(2):
                    _loss(model, 10 * step + micro).backward()
                    opt.end_backward()
                opt.param_groups[0]["lr"] = 1e-2 / (step + 1)
                norm = opt.end_step()
                assert norm > 0.05  # the clip is active
        assert calls and not widened
        for (k, x), (_, y) in zip(models[0].named_parameters(), models[1].named_parameters()):
            assert torch.equal(x, y), k
        for p, q in zip(opts[0].params, opts[1].params):
            assert torch.equal(opts[0].host[p], opts[1].host[q])
            for key in STATES:
                assert torch.equal(opts[0].inner[p].state[opts[0].host[p]][key],
                                   opts[1].inner[q].state[opts[1].host[q]][key]), key
    finally:
        for opt in opts:
            opt.release_host_memory()


def test_a_tensor_the_kernel_cannot_take_is_left_untouched(kernel):
    # step_fused declines (False) and makes no state: a non-contiguous gradient, a wrong-size or fp16 upload
    # buffer; step() then steps it in torch's AdamW, as torch.optim.AdamW would.
    theirs, opt_theirs, ours, opt_ours = _pair([(32, 48)], lr=1e-3)
    (a,), (b,) = theirs, ours
    g = torch.randn(48, 32).t()  # (32, 48), not contiguous
    assert not opt_ours.step_fused(b, g)
    assert not opt_ours.step_fused(b, g.contiguous(), round_into=torch.empty(7, dtype=torch.bfloat16))
    assert not opt_ours.step_fused(b, g.contiguous(), round_into=torch.empty(32, 48, dtype=torch.float16))
    assert not opt_ours.state[b]
    assert torch.equal(a, b)
    a.grad, b.grad = g.clone(), g.clone()  # .clone() keeps the strides: not contiguous
    opt_theirs.step()
    opt_ours.step()
    assert torch.equal(a, b)


def test_a_small_beta1_takes_torch_other_lerp_form(kernel, torch_fuses, simd):
    # exp_avg.lerp_(grad, w) with w = 1 - beta1 >= 0.5 is computed from the gradient's end in torch's kernel:
    # g + (w - 1)(g - m). Bitwise as torch's fused step.
    n = 16 * 300
    theirs, opt_theirs, ours, opt_ours = _pair(n, lr=1e-3, betas=(0.3, 0.9), weight_decay=0.01)
    (a,), (b,) = theirs, ours
    for step in range(3):
        g = 0.01 * torch.randn(n, generator=torch.Generator().manual_seed(step))
        a.grad, b.grad = g.clone(), g.clone()
        opt_theirs.step()
        opt_ours.step()
        assert torch.equal(a, b) and torch.equal(opt_theirs.state[a]["exp_avg"], opt_ours.state[b]["exp_avg"])
