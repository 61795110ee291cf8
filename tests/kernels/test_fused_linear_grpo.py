"""FusedLinearGRPOLoss (Liger's interface on our head) against the spec, without liger-kernel; against Liger's
own module: test_liger_dropin.py."""

import pytest
import torch

from lowmem_grpo.kernels import FusedLinearGRPOLoss, grpo_loss, spec, use_backend
B, T, H, V = 3, 6, 16, 97
SETTINGS = [  # (loss_type, beta, importance_sampling_level): the loss types Liger and TRL reduce alike
    ("dapo", 0.0, "token"), ("dapo", 0.04, "token"), ("grpo", 0.04, "token"), ("bnpo", 0.0, "token"),
    ("dr_grpo", 0.04, "token"), ("grpo", 0.04, "sequence"), ("dapo", 0.0, "sequence"), ("cispo", 0.04, "token"),
    ("sapo", 0.04, "token"), ("vespo", 0.0, "token"),
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
        logp = spec.linear_token_logprobs(hidden, weight, ids, bias=bias)
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
    eps_high = 1.3 if loss_type == "cispo" else 0.28  # cispo's bound is on the ratio itself
    module = FusedLinearGRPOLoss(beta=beta, use_ref_model=beta != 0.0, loss_type=loss_type, epsilon_high=eps_high,
                                 max_completion_length=T + 2, importance_sampling_level=level, temperature=temperature)
    loss, metrics, grads = _run(module, hidden, weight, bias, ids, mask, adv, old, ref if beta else None)

    leaves = [t.clone().requires_grad_() for t in (hidden, weight) + (() if bias is None else (bias,))]
    spec_loss, spec_metrics = spec.linear_grpo_loss(
        leaves[0], leaves[1], ids, adv, mask=mask, old_logp=old, ref_logp=ref if beta else None,
        bias=leaves[2] if bias is not None else None, epsilon_high=eps_high, beta=beta, temperature=temperature,
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
        ref_from_input = spec.linear_token_logprobs(hidden, ref_weight, ids.masked_fill(mask == 0, 0))
    module = FusedLinearGRPOLoss(beta=0.04)
    given, m_given, _ = _run(module, hidden, weight, bias, ids, mask, adv, old, ref_from_input)
    computed, m_computed, _ = _run(module, hidden, weight, bias, ids, mask, adv, old, None, ref_input=hidden,
                                   ref_weight=ref_weight)
    torch.testing.assert_close(computed, given)
    torch.testing.assert_close(m_computed[0], m_given[0])


def test_luspo_sums_every_position_times_the_sequence_length():
    """Liger's luspo: the unmasked per-token loss (padding positions included) times its sequence's length,
    averaged over all B x T positions; the spec's per-token terms without a mask give the per-token loss."""
    hidden, weight, bias, ids, mask, adv, old, ref = _inputs()
    loss, _, grads = _run(FusedLinearGRPOLoss(beta=0.04, loss_type="luspo", epsilon_high=0.28), hidden, weight, bias,
                          ids, mask, adv, old, ref)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp = spec.linear_token_logprobs(h, w, ids)
    terms = spec.grpo_token_terms(logp, adv, old_logp=old, ref_logp=ref, epsilon_high=0.28, beta=0.04)
    expected = (terms["loss"] * mask.sum(-1, keepdim=True)).mean()
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[0], h.grad, rtol=1e-4, atol=1e-6)
    assert grads[0][2, 1:].abs().sum() > 0  # the padding rows get a gradient, as in Liger
    torch.testing.assert_close(grads[1], w.grad, rtol=1e-4, atol=1e-6)


def test_luspo_needs_valid_ids_at_the_padding():
    hidden, weight, bias, ids, mask, adv, old, ref = _inputs()
    ids = ids.masked_fill(mask == 0, -100)
    with pytest.raises(ValueError, match="luspo.*padding.*valid id"):
        FusedLinearGRPOLoss(beta=0.0, loss_type="luspo", use_ref_model=False)(hidden, weight, ids, mask, adv)
    with pytest.raises(ValueError, match="luspo.*padding.*valid id"):  # before the reference head sees them
        FusedLinearGRPOLoss(beta=0.04, loss_type="luspo")(hidden, weight, ids, mask, adv, ref_input=hidden,
                                                          ref_weight=weight)
    FusedLinearGRPOLoss(beta=0.0, loss_type="dapo", use_ref_model=False)(hidden, weight, ids, mask, adv)  # dropped


@pytest.mark.parametrize("loss_type, level", [("luspo", "token"), ("luspo", "sequence"), ("dapo", "sequence"),
                                              ("vespo", "token")])
def test_goes_through_the_one_formula(monkeypatch, loss_type, level):
    """Doubling grpo_loss.policy_terms' loss doubles the drop-in's: no second copy of the per-token math."""
    hidden, weight, bias, ids, mask, adv, old, ref = _inputs()
    module = FusedLinearGRPOLoss(beta=0.0, use_ref_model=False, loss_type=loss_type, importance_sampling_level=level)
    with use_backend("torch"):
        plain, _ = module(hidden, weight, ids, mask, adv, old_per_token_logps=old)
        formula = grpo_loss.policy_terms

        def doubled(*args, **kw):
            loss, *rest = formula(*args, **kw)
            return (2 * loss, *rest)

        monkeypatch.setattr(grpo_loss, "policy_terms", doubled)
        twice, _ = module(hidden, weight, ids, mask, adv, old_per_token_logps=old)
    assert plain.abs() > 1e-3
    torch.testing.assert_close(twice, 2 * plain)


def test_missing_reference_log_probs_are_refused():
    hidden, weight, bias, ids, mask, adv, old, _ = _inputs()
    for beta in (0.04, 0.0):  # use_ref_model=True (the default) needs a reference, as Liger's assert says
        with pytest.raises(ValueError, match="ref_per_token_logps"):
            FusedLinearGRPOLoss(beta=beta)(hidden, weight, ids, mask, adv, old_per_token_logps=old)
