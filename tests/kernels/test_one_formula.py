"""Issue 25 item 5: the PPO-clip / k3 per-token math has one torch copy (grpo_loss.ppo_clip_k3) and the
Triton one; both against the spec (reference.grpo_token_terms), and every torch caller goes through it."""

import pytest
import torch

from lowmem_grpo.kernels import grpo_loss, grpo_token_terms, linear_grpo_loss, reference, use_backend
from lowmem_grpo.kernels._backend import HAS_TRITON, interpreter_enabled


def _token_inputs(n=257, seed=0):
    """(1, n) each: per-token advantages (the spec reads a 1-D advantage as one per sequence)."""
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(1, n, generator=g) * 5
    old = logp + 0.4 * torch.randn(1, n, generator=g)  # ratios on both sides of the clip range
    ref = logp + 0.5 * torch.randn(1, n, generator=g)
    adv = torch.randn(1, n, generator=g)
    return logp, old, ref, adv


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("eps", [(0.2, 0.2), (0.1, 0.28)])
def test_ppo_clip_k3_matches_spec_values_and_gradient(beta, eps):
    eps_low, eps_high = eps
    logp, old, ref, adv = _token_inputs()
    loss, kl, low, high, dloss, _ = grpo_loss.ppo_clip_k3(logp - old, adv, logp, ref, eps_low=eps_low,
                                                          eps_high=eps_high, beta=beta)
    x = logp.clone().requires_grad_()
    spec = reference.grpo_token_terms(x, adv, old_logp=old, ref_logp=ref, epsilon_low=eps_low,
                                      epsilon_high=eps_high, beta=beta)
    torch.testing.assert_close(loss, spec["loss"].detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(kl, spec["kl"].detach(), rtol=1e-6, atol=1e-7)
    assert torch.equal(low, spec["is_low_clipped"]) and torch.equal(high, spec["is_high_clipped"])
    assert low.any() and high.any() and not (low | high).all()  # the inputs reach every branch
    (grad,) = torch.autograd.grad(spec["loss"].sum(), x)  # autograd of the spec = the closed form
    torch.testing.assert_close(dloss, grad, rtol=1e-5, atol=1e-7)


def test_hand_derived_values():
    # rho = e^0.5 ~ 1.6487 > 1.2 with A = 1: high-clipped, loss = -1.2; rho = e^-0.5 ~ 0.6065 < 0.8 with
    # A = -1: low-clipped, loss = -min(-0.6065, -0.8) = 0.8; rho = 1, A = 2: loss = -2, dloss = -2.
    log_ratio = torch.tensor([0.5, -0.5, 0.0])
    adv = torch.tensor([1.0, -1.0, 2.0])
    loss, _, low, high, dloss, _ = grpo_loss.ppo_clip_k3(log_ratio, adv, torch.zeros(3), None, eps_low=0.2,
                                                         eps_high=0.2, beta=0.0)
    torch.testing.assert_close(loss, torch.tensor([-1.2, 0.8, -2.0]))
    assert low.tolist() == [False, True, False] and high.tolist() == [True, False, False]
    torch.testing.assert_close(dloss, torch.tensor([0.0, 0.0, -2.0]))


@pytest.mark.skipif(not (HAS_TRITON and interpreter_enabled()) and not torch.cuda.is_available(),
                    reason="the Triton copy runs under TRITON_INTERPRET=1 on the CPU, or on a GPU")
def test_triton_copy_matches_torch_copy():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    logp, old, ref, adv = (t.to(dev) for t in _token_inputs(n=3000))  # > one TOKEN_BLOCK
    kwargs = dict(old_logp=old, ref_logp=ref, epsilon_low=0.1, epsilon_high=0.28, beta=0.04)
    outs = {}
    for backend in ("torch", "triton"):
        with use_backend(backend):
            x = logp.clone().requires_grad_()
            loss, kl, code = grpo_token_terms(x, adv, **kwargs)
            (grad,) = torch.autograd.grad(loss.sum(), x)
            outs[backend] = (loss, kl, code, grad)
    for a, b in zip(outs["torch"], outs["triton"]):
        if a.dtype == torch.int8:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_every_torch_caller_goes_through_the_one_formula(monkeypatch, level):
    """Doubling the formula's loss doubles linear_grpo_loss at both ratio levels: no second copy exists."""
    torch.manual_seed(0)
    B, T, H, V = 2, 5, 8, 33
    hidden, weight = torch.randn(B, T, H), torch.randn(V, H)
    ids, adv = torch.randint(0, V, (B, T)), torch.randn(B)
    old = torch.randn(B, T) * 0.1 - 3.5
    kwargs = dict(old_logp=old, importance_sampling_level=level, loss_type="dapo")
    with use_backend("torch"):
        plain, _ = linear_grpo_loss(hidden, weight, ids, adv, **kwargs)
        formula = grpo_loss.ppo_clip_k3

        def doubled(*args, **kw):
            loss, *rest = formula(*args, **kw)
            return (2 * loss, *rest)

        monkeypatch.setattr(grpo_loss, "ppo_clip_k3", doubled)
        twice, _ = linear_grpo_loss(hidden, weight, ids, adv, **kwargs)
    assert plain.abs() > 1e-3
    torch.testing.assert_close(twice, 2 * plain)
