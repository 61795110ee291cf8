"""Each per-token loss variant is written once in torch (grpo_loss.policy_terms) and once in Triton
(grpo_loss_triton.block_terms); both match the spec (spec.grpo_token_terms), values and the
closed-form gradient, and every torch caller goes through the one torch copy."""

import math

import pytest
import torch

from lowmem_grpo.kernels import grpo_loss, grpo_token_terms, linear_grpo_loss, spec, use_backend
from lowmem_grpo.kernels._backend import HAS_TRITON, interpreter_enabled
from lowmem_grpo.kernels.grpo_loss import Variant, term_params

LOSS_TYPES = ["grpo", "cispo", "sapo", "vespo"]  # one per variant (bnpo, dapo, dr_grpo, luspo share grpo's)
needs_triton = pytest.mark.skipif(not (HAS_TRITON and interpreter_enabled()) and not torch.cuda.is_available(),
                                  reason="the Triton copy runs under TRITON_INTERPRET=1 on the CPU, or on a GPU")
# where the Triton copy runs: CPU tensors through the interpreter, CUDA ones compiled (marked `cuda`: the GPU
# session's `-m cuda` selects them)
TRITON_DEVICES = [pytest.param("cpu")] if HAS_TRITON and interpreter_enabled() else []
if HAS_TRITON and torch.cuda.is_available():
    TRITON_DEVICES.append(pytest.param("cuda", marks=pytest.mark.cuda))


def _token_inputs(n=257, seed=0, rows=1):
    """(rows, n) each: per-token advantages (the spec reads a 1-D advantage as one per sequence)."""
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(rows, n, generator=g) * 5
    old = logp + 0.4 * torch.randn(rows, n, generator=g)  # ratios on both sides of the clip range
    ref = logp + 0.5 * torch.randn(rows, n, generator=g)
    adv = torch.randn(rows, n, generator=g)
    return logp, old, ref, adv


def _vespo_phi(logp, old, adv, is_ratio=None):
    return spec.vespo_phi(logp - old, adv, torch.ones_like(logp), is_ratio)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("beta, bias_kl", [(0.0, False), (0.04, False), (0.04, True)])
@pytest.mark.parametrize("eps, delta", [((0.2, 0.2), None), ((0.1, 0.28), None), ((0.2, 0.28), 1.5)])
@pytest.mark.parametrize("weighted", [False, True])
def test_policy_terms_match_spec_values_and_gradient(loss_type, beta, bias_kl, eps, delta, weighted):
    eps_low, eps_high = eps
    if loss_type == "cispo":
        eps_high = 1.3  # cispo's eps_high bounds the ratio itself: some tokens above, some below
    rows = 4
    logp, old, ref, adv = _token_inputs(n=64, rows=rows)
    g = torch.Generator().manual_seed(1)
    weight = torch.rand(rows, 64, generator=g) if weighted else None
    p = term_params(loss_type, eps_low, eps_high, beta, ref, delta=delta, use_bias_correction_kl=bias_kl)
    coef = _vespo_phi(logp, old, adv, weight).expand_as(logp) if loss_type == "vespo" else None  # vespo: IS in phi
    loss, kl, low, high, dloss, dkl = grpo_loss.policy_terms(logp - old, adv, logp, ref,
                                                             None if loss_type == "vespo" else weight, coef, p)
    x = logp.clone().requires_grad_()
    expected = spec.grpo_token_terms(x, adv, old_logp=old, ref_logp=ref, epsilon_low=eps_low, epsilon_high=eps_high,
                                     beta=beta, loss_type=loss_type, delta=delta, use_bias_correction_kl=bias_kl,
                                     importance_sampling_ratio=weight)
    torch.testing.assert_close(loss, expected["loss"].detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(kl, expected["kl"].detach(), rtol=1e-6, atol=1e-7)
    assert torch.equal(low, expected["is_low_clipped"]) and torch.equal(high, expected["is_high_clipped"])
    if loss_type in ("grpo", "cispo"):
        assert high.any() and not high.all()  # the inputs reach the clipped regions
    (grad,) = torch.autograd.grad(expected["loss"].sum(), x, retain_graph=True)  # autograd of the spec = closed form
    torch.testing.assert_close(dloss, grad, rtol=1e-5, atol=1e-6)
    if beta:
        (grad_kl,) = torch.autograd.grad(expected["kl"].sum(), x)
        torch.testing.assert_close(dkl, grad_kl, rtol=1e-5, atol=1e-6)


def test_hand_derived_values():
    # rho = e^0.5 ~ 1.6487 > 1.2 with A = 1: high-clipped, loss = -1.2; rho = e^-0.5 ~ 0.6065 < 0.8 with
    # A = -1: low-clipped, loss = -min(-0.6065, -0.8) = 0.8; rho = 1, A = 2: loss = -2, dloss = -2.
    log_ratio = torch.tensor([0.5, -0.5, 0.0])
    adv = torch.tensor([1.0, -1.0, 2.0])
    loss, _, low, high, dloss, _ = grpo_loss.policy_terms(log_ratio, adv, torch.zeros(3), None, None, None,
                                                          term_params("grpo", 0.2, 0.2, 0.0, None))
    torch.testing.assert_close(loss, torch.tensor([-1.2, 0.8, -2.0]))
    assert low.tolist() == [False, True, False] and high.tolist() == [True, False, False]
    torch.testing.assert_close(dloss, torch.tensor([0.0, 0.0, -2.0]))
    # delta = 1.5 with A = -1: rho = e^0.5 > 1.5 is capped, loss = 1.5 and no gradient; rho = e^0.2 ~ 1.2214 in
    # (1.2, 1.5): loss = rho, dloss = rho (the unclipped branch, as without delta).
    log_ratio, adv = torch.tensor([0.5, 0.2]), torch.tensor([-1.0, -1.0])
    loss, _, _, _, dloss, _ = grpo_loss.policy_terms(log_ratio, adv, torch.zeros(2), None, None, None,
                                                     term_params("grpo", 0.2, 0.2, 0.0, None, delta=1.5))
    torch.testing.assert_close(loss, torch.tensor([1.5, math.exp(0.2)]))
    torch.testing.assert_close(dloss, torch.tensor([0.0, math.exp(0.2)]))
    # cispo, eps_high = 1.2: rho = e^0.5 is capped to 1.2; loss = -1.2 * A * logp, dloss = -1.2 * A.
    logp = torch.tensor([-2.0])
    loss, _, _, high, dloss, _ = grpo_loss.policy_terms(torch.tensor([0.5]), torch.tensor([1.0]), logp, None, None,
                                                        None, term_params("cispo", 0.2, 1.2, 0.0, None))
    torch.testing.assert_close(loss, torch.tensor([2.4]))
    torch.testing.assert_close(dloss, torch.tensor([-1.2]))
    assert high.tolist() == [True]
    # sapo at rho = 1: sigmoid(0) = 1/2, loss = -(1/2) 4 / tau A = -2 A / tau; dloss = -4 A (1/4) = -A.
    loss, _, _, _, dloss, _ = grpo_loss.policy_terms(torch.zeros(2), torch.tensor([1.0, -1.0]), torch.zeros(2), None,
                                                     None, None, term_params("sapo", 0.2, 0.2, 0.0, None))
    torch.testing.assert_close(loss, torch.tensor([-2.0, 2.0 / 1.05]))
    torch.testing.assert_close(dloss, torch.tensor([-1.0, 1.0]))


def test_vespo_phi_is_one_at_ratio_one_and_smaller_away_from_it():
    A = torch.tensor([1.0, -1.0, 1.0])
    log_ratio = torch.tensor([[0.0, 0.0], [0.0, 0.0], [0.3, 0.4]])
    phi = spec.vespo_phi(log_ratio, A, torch.ones(3, 2))
    torch.testing.assert_close(phi[:2], torch.ones(2, 1))
    w = math.exp(0.7)  # k = 2, lambda = 3 for A >= 0: phi = e^3 w^2 e^(-3 w)
    torch.testing.assert_close(phi[2, 0], torch.tensor(math.exp(3) * w ** 2 * math.exp(-3 * w)))


@needs_triton
@pytest.mark.parametrize("dev", TRITON_DEVICES)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("delta, bias_kl, weighted", [(None, False, False), (1.5, True, True)])
def test_triton_copy_matches_torch_copy(loss_type, delta, bias_kl, weighted, dev):
    logp, old, ref, adv = (t.to(dev) for t in _token_inputs(n=1500, rows=2))  # > one TOKEN_BLOCK
    is_ratio = torch.rand(2, 1500, device=dev) + 0.5 if weighted else None
    kwargs = dict(old_logp=old, ref_logp=ref, epsilon_low=0.1, epsilon_high=1.3 if loss_type == "cispo" else 0.28,
                  beta=0.04, loss_type=loss_type, delta=delta, use_bias_correction_kl=bias_kl,
                  importance_sampling_ratio=is_ratio, mask=torch.rand(2, 1500, device=dev) > 0.2)
    outs = {}
    for backend in ("torch", "triton"):
        with use_backend(backend):
            x = logp.clone().requires_grad_()
            loss, kl, code = grpo_token_terms(x, adv, **kwargs)
            (grad,) = torch.autograd.grad(loss.sum() + 0.5 * kl.sum(), x)
            outs[backend] = (loss, kl, code, grad)
    for a, b in zip(outs["torch"], outs["triton"]):
        if a.dtype == torch.int8:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["dapo", "cispo", "sapo", "vespo", "luspo"])
def test_every_torch_caller_goes_through_the_one_formula(monkeypatch, level, loss_type):
    """Doubling the formula's loss doubles linear_grpo_loss at both ratio levels: no second copy exists."""
    torch.manual_seed(0)
    B, T, H, V = 2, 5, 8, 33
    hidden, weight = torch.randn(B, T, H), torch.randn(V, H)
    ids, adv = torch.randint(0, V, (B, T)), torch.randn(B)
    old = None if loss_type == "vespo" else torch.randn(B, T) * 0.1 - 3.5  # vespo: phi ~ 0 far from rho = 1
    kwargs = dict(old_logp=old, importance_sampling_level=level, loss_type=loss_type, delta=3.0)
    with use_backend("torch"):
        plain, _ = linear_grpo_loss(hidden, weight, ids, adv, **kwargs)
        formula = grpo_loss.policy_terms

        def doubled(*args, **kw):
            loss, *rest = formula(*args, **kw)
            return (2 * loss, *rest)

        monkeypatch.setattr(grpo_loss, "policy_terms", doubled)
        twice, _ = linear_grpo_loss(hidden, weight, ids, adv, **kwargs)
    assert plain.abs() > 1e-3
    torch.testing.assert_close(twice, 2 * plain)


def test_each_loss_type_has_a_variant():
    assert set(grpo_loss.VARIANT_OF_LOSS_TYPE) == {"grpo", "bnpo", "dapo", "dr_grpo", "luspo", "cispo", "sapo", "vespo"}
    assert {grpo_loss.VARIANT_OF_LOSS_TYPE[t] for t in LOSS_TYPES} == set(Variant)
