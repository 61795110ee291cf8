"""FusedLinearGRPOLoss (Liger's interface on our head): against the spec always, against Liger's own
LigerFusedLinearGRPOLoss where liger-kernel is installed (the `bench` extra), and its refusals."""

import importlib.util

import pytest
import torch

from lowmem_grpo.kernels import FusedLinearGRPOLoss, reference

HAS_LIGER = importlib.util.find_spec("liger_kernel") is not None
B, T, H, V = 3, 6, 16, 97
SETTINGS = [  # (loss_type, beta, importance_sampling_level)
    ("dapo", 0.0, "token"), ("dapo", 0.04, "token"), ("grpo", 0.04, "token"), ("bnpo", 0.0, "token"),
    ("dr_grpo", 0.04, "token"), ("grpo", 0.04, "sequence"), ("dapo", 0.0, "sequence"),
]


def _inputs(seed=0, with_bias=False):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.5
    bias = torch.randn(V, generator=g) * 0.1 if with_bias else None
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = (torch.arange(T)[None] < torch.tensor([[T], [T - 2], [1]])).long()  # padding at the ends
    adv = torch.randn(B, generator=g)
    with torch.no_grad():
        logp = reference.linear_token_logprobs(hidden, weight, ids, bias=bias)
    old = logp + 0.3 * torch.randn(B, T, generator=g)  # ratios on both sides of the clip range
    ref = logp + 0.5 * torch.randn(B, T, generator=g)
    return hidden, weight, bias, ids, mask, adv, old, ref


def _run(module, hidden, weight, bias, ids, mask, adv, old, ref, **kwargs):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    b = None if bias is None else bias.clone().requires_grad_()
    loss, metrics = module(h, w, ids, mask, adv, bias=b, ref_per_token_logps=ref, old_per_token_logps=old, **kwargs)
    loss.backward()
    return loss, metrics, (h.grad, w.grad) + (() if b is None else (b.grad,))


@pytest.mark.parametrize("loss_type, beta, level", SETTINGS)
@pytest.mark.parametrize("with_bias, temperature", [(False, 1.0), (True, 0.7)])
def test_matches_the_spec(loss_type, beta, level, with_bias, temperature):
    hidden, weight, bias, ids, mask, adv, old, ref = _inputs(with_bias=with_bias)
    module = FusedLinearGRPOLoss(beta=beta, use_ref_model=beta != 0.0, loss_type=loss_type, epsilon_high=0.28,
                                 max_completion_length=T + 2, importance_sampling_level=level, temperature=temperature)
    loss, metrics, grads = _run(module, hidden, weight, bias, ids, mask, adv, old, ref if beta else None)

    leaves = [t.clone().requires_grad_() for t in (hidden, weight) + (() if bias is None else (bias,))]
    spec_loss, spec_metrics = reference.linear_grpo_loss(
        leaves[0], leaves[1], ids, adv, mask=mask, old_logp=old, ref_logp=ref if beta else None,
        bias=leaves[2] if bias is not None else None, epsilon_high=0.28, beta=beta, temperature=temperature,
        loss_type=loss_type, importance_sampling_level=level, max_completion_length=T + 2)
    spec_loss.backward()
    torch.testing.assert_close(loss, spec_loss, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, [t.grad for t in leaves], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    expected = ((spec_metrics["kl"],) if beta else ()) + (spec_metrics["clip_ratio"],)
    assert len(metrics) == len(expected)
    for got, want in zip(metrics, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_num_items_in_batch_is_dapos_denominator():
    hidden, weight, bias, ids, mask, adv, old, ref = _inputs()
    module = FusedLinearGRPOLoss(beta=0.0, use_ref_model=False)
    plain, _, _ = _run(module, hidden, weight, bias, ids, mask, adv, old, None)
    scaled, _, _ = _run(module, hidden, weight, bias, ids, mask, adv, old, None, num_items_in_batch=100)
    torch.testing.assert_close(scaled, plain * mask.sum() / 100)


def test_reference_log_probs_from_ref_input():
    hidden, weight, bias, ids, mask, adv, old, ref = _inputs()
    ref_weight = weight + 0.05
    with torch.no_grad():
        ref_from_input = reference.linear_token_logprobs(hidden, ref_weight, ids.masked_fill(mask == 0, 0))
    module = FusedLinearGRPOLoss(beta=0.04)
    given, m_given, _ = _run(module, hidden, weight, bias, ids, mask, adv, old, ref_from_input)
    computed, m_computed, _ = _run(module, hidden, weight, bias, ids, mask, adv, old, None, ref_input=hidden,
                                   ref_weight=ref_weight)
    torch.testing.assert_close(computed, given)
    torch.testing.assert_close(m_computed[0], m_given[0])


@pytest.mark.parametrize("kwargs, match", [
    (dict(loss_type="sapo"), "sapo.*grpo, bnpo, dr_grpo, dapo"),
    (dict(loss_type="cispo"), "Liger's loss type"),
    (dict(loss_type="nope"), "unknown loss type"),
    (dict(delta=2.0), "delta"),
    (dict(use_bias_correction_kl=True), "use_bias_correction_kl"),
    (dict(loss_type="dr_grpo"), "max_completion_length"),
    (dict(importance_sampling_level="seq"), "importance_sampling_level"),
])
def test_unsupported_options_are_refused_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FusedLinearGRPOLoss(**kwargs)


def test_beta_without_reference_log_probs_is_refused():
    hidden, weight, bias, ids, mask, adv, old, _ = _inputs()
    with pytest.raises(ValueError, match="ref_per_token_logps"):
        FusedLinearGRPOLoss(beta=0.04)(hidden, weight, ids, mask, adv, old_per_token_logps=old)
    with pytest.raises(ValueError, match="vllm_is_ratio"):
        FusedLinearGRPOLoss(beta=0.0)(hidden, weight, ids, mask, adv, vllm_is_ratio=torch.ones(B))


@pytest.mark.skipif(not HAS_LIGER, reason="needs liger-kernel (pip install '.[bench]')")
@pytest.mark.parametrize("loss_type, beta, level", SETTINGS)
@pytest.mark.parametrize("with_bias, temperature", [(False, 1.0), (True, 0.7)])
def test_matches_liger(loss_type, beta, level, with_bias, temperature):
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    hidden, weight, bias, ids, mask, adv, old, ref = _inputs(with_bias=with_bias)
    kwargs = dict(beta=beta, use_ref_model=beta != 0.0, loss_type=loss_type, epsilon_high=0.28,
                  max_completion_length=T + 2, importance_sampling_level=level, temperature=temperature)
    ours = _run(FusedLinearGRPOLoss(**kwargs), hidden, weight, bias, ids, mask, adv, old, ref if beta else None)
    theirs = _run(LigerFusedLinearGRPOLoss(compiled=False, **kwargs), hidden, weight, bias, ids, mask, adv, old,
                  ref if beta else None)
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-5, atol=1e-6)
    assert isinstance(theirs[1], tuple) and len(ours[1]) == len(theirs[1])
    for got, want in zip(ours[1], theirs[1]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for got, want in zip(ours[2], theirs[2], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
