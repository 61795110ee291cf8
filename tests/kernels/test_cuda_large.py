"""The Triton kernels on a GPU at Qwen2.5's vocabulary (151936) in bf16, with more than 2^31 logits.

CPU tests run the same kernels in Triton's interpreter at small sizes; what only a GPU shows is the
compiled code at real sizes: int64 row offsets (N * V > 2^31 elements would overflow int32 offsets
in the last rows), the vocabulary-block loop at V = 151936, and the in-place backward on a 4 GiB
buffer. The expected values are the fp32 (and bf16) spec's, lowmem_grpo/kernels/spec.py, run a row chunk at a
time so that it fits beside the op's own buffers.
"""

import math

import pytest
import torch

from lowmem_grpo.kernels import grpo_token_loss, linear_grpo_loss, spec, token_logprobs, use_backend

from .helpers import assert_as_close_as_low_precision

pytestmark = pytest.mark.cuda

V = 151936
N_BIG = 2**31 // V + 64  # 14198 rows: the last rows start past element 2^31


def _chunks(n: int, size: int = 1024):
    return [slice(i, min(n, i + size)) for i in range(0, n, size)]


def _spec_rows(logits, ids, g_logp, g_ent, rows, dtype):
    x = logits[rows].detach().float().requires_grad_()
    logp, ent = spec.token_logprobs(x, ids[rows], return_entropy=True, dtype=dtype)
    (grad,) = torch.autograd.grad((logp, ent), x, (g_logp[rows], g_ent[rows]))
    return logp, ent, grad


def test_token_logprobs_past_2_to_the_31_elements():
    torch.manual_seed(0)
    base = (torch.randn(N_BIG, V, device="cuda", dtype=torch.bfloat16) * 3).requires_grad_()
    ids = torch.randint(0, V, (N_BIG,), device="cuda")
    g_logp, g_ent = torch.randn(N_BIG, device="cuda"), torch.randn(N_BIG, device="cuda")
    with use_backend("triton"):
        logits = base * 1  # an intermediate: backward overwrites it with dlogits
        logp, ent = token_logprobs(logits, ids, return_entropy=True)
        torch.autograd.backward((logp, ent), (g_logp, g_ent))
    grad = base.grad
    del logits
    for rows in _chunks(N_BIG)[:2] + _chunks(N_BIG)[-3:]:  # the first rows and those past 2^31
        ref32 = _spec_rows(base, ids, g_logp, g_ent, rows, torch.float32)
        ref16 = _spec_rows(base, ids, g_logp, g_ent, rows, torch.bfloat16)
        names = ("logp", "entropy", "dlogits")
        for got, r32, r16, name in zip((logp[rows], ent[rows], grad[rows]), ref32, ref16, names):
            assert_as_close_as_low_precision(got, r32, r16, name=f"{name} rows {rows.start}:{rows.stop}")


def test_grpo_token_loss_past_2_to_the_31_elements():
    torch.manual_seed(1)
    B, T = 2, N_BIG // 2
    base = torch.randn(B, T, V, device="cuda", dtype=torch.bfloat16).requires_grad_()
    ids = torch.randint(0, V, (B, T), device="cuda")
    adv = torch.randn(B, device="cuda")
    typical = -math.log(V) - 0.5  # E[logp] for unit-variance logits: old / ref near it keep rho and k3 moderate
    old = torch.randn(B, T, device="cuda") * 0.3 + typical
    ref = torch.randn(B, T, device="cuda") * 0.3 + typical
    kw = dict(old_logp=old, ref_logp=ref, beta=0.04, epsilon_low=0.2, epsilon_high=0.28)
    with use_backend("triton"):
        out = grpo_token_loss(base * 1, ids, adv, **kw)
        out.loss.sum().backward()
    for b in range(B):
        for rows in _chunks(T)[-2:]:  # the last rows of each sequence: b = 1 lies past 2^31
            x = base[b:b + 1, rows].detach().float().requires_grad_()
            expected = spec.grpo_token_loss(x, ids[b:b + 1, rows], adv[b:b + 1], old_logp=old[b:b + 1, rows],
                                            ref_logp=ref[b:b + 1, rows], beta=0.04, epsilon_low=0.2,
                                            epsilon_high=0.28)
            (g,) = torch.autograd.grad(expected["loss"].sum(), x)
            x16 = base[b:b + 1, rows].detach().float().requires_grad_()
            expected16 = spec.grpo_token_loss(x16, ids[b:b + 1, rows], adv[b:b + 1], old_logp=old[b:b + 1, rows],
                                              ref_logp=ref[b:b + 1, rows], beta=0.04, epsilon_low=0.2,
                                              epsilon_high=0.28, dtype=torch.bfloat16)
            (g16,) = torch.autograd.grad(expected16["loss"].sum(), x16)
            assert_as_close_as_low_precision(out.loss[b:b + 1, rows], expected["loss"], expected16["loss"], name="loss")
            assert_as_close_as_low_precision(base.grad[b:b + 1, rows], g, g16, name="dlogits")


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_linear_grpo_loss_at_qwen_sizes_matches_the_cpu_spec(loss_type):
    # The fused head on the GPU (Triton row kernels, cuBLAS slices) against the fp32 spec on the CPU,
    # at Qwen2.5-1.5B's hidden size and vocabulary with a tied bf16 weight.
    torch.manual_seed(2)
    B, T, H = 4, 512, 1536
    hidden = (torch.randn(B, T, H) * 0.5).to(torch.bfloat16)
    weight = (torch.randn(V, H) * 0.02).to(torch.bfloat16)
    ids = torch.randint(0, V, (B, T))
    mask = torch.rand(B, T) > 0.1
    adv = torch.randn(B)
    kw = dict(mask=mask, loss_type=loss_type, beta=0.0, max_completion_length=T)
    results = {}
    for dev, dtype in (("cuda", torch.bfloat16), ("cpu", torch.float32), ("cpu", torch.bfloat16)):
        h = hidden.to(dev, dtype).requires_grad_()
        w = weight.to(dev, dtype).requires_grad_()
        args = (h, w, ids.to(dev), adv.to(dev))
        if dev == "cuda":
            with use_backend("triton"):
                loss, _ = linear_grpo_loss(*args, **{k: v.to(dev) if torch.is_tensor(v) else v for k, v in kw.items()})
        else:
            loss = spec.linear_grpo_loss(*args, **kw, dtype=dtype)[0]
        gh, gw = torch.autograd.grad(loss, (h, w))
        results[(dev, dtype)] = [t.detach().cpu() for t in (loss, gh, gw)]
    got = results[("cuda", torch.bfloat16)]
    ref32, ref16 = results[("cpu", torch.float32)], results[("cpu", torch.bfloat16)]
    for g, r32, r16, name in zip(got, ref32, ref16, ("loss", "d hidden", "d weight")):
        assert_as_close_as_low_precision(g.float(), r32, r16.float(), factor=1.5, name=name)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_kernels_launch_on_their_tensors_device():
    # Triton launches on the current device; tensors on cuda:1 while cuda:0 is current must still be
    # computed on cuda:1 (lowmem_grpo/kernels/_backend.py launch_guard).
    torch.manual_seed(3)
    x = torch.randn(64, 5000)
    ids = torch.randint(0, 5000, (64,))
    expected = spec.token_logprobs(x, ids)
    torch.cuda.set_device(0)
    with use_backend("triton"):
        got = token_logprobs(x.to("cuda:1"), ids.to("cuda:1"))
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-5)
