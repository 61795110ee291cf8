"""GRPOLossSettings: checked once at construction, frozen, and the same loss as the ops' keyword form, bit for
bit, on the torch and the Triton paths; the per-token terms of both paths get the settings' TermParams."""

import dataclasses
import math

import pytest
import torch

from lowmem_grpo.kernels import (GRPOLossSettings, ISLevel, LossType, grpo_loss, grpo_loss_triton, grpo_token_loss,
                                 grpo_token_terms, linear_grpo_loss, use_backend)
from lowmem_grpo.kernels.fused_linear_grpo import FusedLinearGRPOLoss
from lowmem_grpo.kernels.loss_settings import TermParams, term_params

B, T, H, V = 3, 5, 8, 11
KEYWORDS = [
    dict(loss_type="dapo", beta=0.04, epsilon_high=0.28),
    dict(loss_type="grpo", delta=1.3, use_bias_correction_kl=True, beta=0.1, temperature=0.7),
    dict(loss_type="cispo", epsilon_high=1.5, top_entropy_quantile=0.5),
    dict(loss_type="sapo", sapo_temperature_pos=0.8, sapo_temperature_neg=1.2),
    dict(loss_type="vespo", vespo_k_pos=1.5, vespo_lambda_neg=2.5),
    dict(loss_type="dr_grpo", max_completion_length=7, importance_sampling_level="sequence", beta=0.02),
]


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g, requires_grad=True)
    weight = torch.randn(V, H, generator=g, requires_grad=True)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.2
    adv = torch.randn(B, generator=g)
    old = -torch.rand(B, T, generator=g) * 3
    ref = -torch.rand(B, T, generator=g) * 3
    return hidden, weight, ids, mask, adv, old, ref


def test_checked_once_at_construction_with_the_ops_errors():
    with pytest.raises(ValueError, match="unknown loss_type 'ppo'; valid: 'grpo', 'bnpo', 'dapo'"):
        GRPOLossSettings(loss_type="ppo")
    with pytest.raises(ValueError, match="unknown importance_sampling_level 'seq'; valid: 'token', 'sequence'"):
        GRPOLossSettings(importance_sampling_level="seq")
    for name, bad, text in [("epsilon_low", 1.0, r"epsilon_low must be in \[0, 1\)"),
                            ("epsilon_high", -0.1, "epsilon_high must be >= 0"),
                            ("beta", -1.0, "beta must be >= 0"), ("delta", -1.0, "delta must be > 0, got -1"),
                            ("temperature", 0.0, "temperature must be > 0"),
                            ("sapo_temperature_neg", 0.0, "sapo_temperature_neg must be > 0"),
                            ("top_entropy_quantile", 1.5, r"top_entropy_quantile must be in \[0, 1\]"),
                            ("max_completion_length", 0, "max_completion_length must be > 0")]:
        with pytest.raises(ValueError, match=text):
            GRPOLossSettings(**{name: bad})


def test_frozen_typed_and_terms_derived_once():
    s = GRPOLossSettings(loss_type="cispo", importance_sampling_level="sequence", epsilon_low=0.1, beta=1,
                         delta=2, vespo_k_pos=3)
    assert s.loss_type is LossType.CISPO and s.importance_sampling_level is ISLevel.SEQUENCE
    assert s.epsilon_high == 0.1 and isinstance(s.beta, float) and isinstance(s.vespo_k_pos, float)
    assert s.terms == TermParams(variant=grpo_loss.Variant.CISPO, eps_low=0.1, eps_high=0.1, delta=2.0, beta=1.0)
    assert s.terms is s.terms and s.variant is grpo_loss.Variant.CISPO
    assert GRPOLossSettings().terms.delta == math.inf
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.beta = 0.5
    assert dataclasses.replace(s, beta=0.5).terms.beta == 0.5  # a changed copy is checked and derived anew
    assert term_params("cispo", 0.1, None, 1.0, object(), delta=2.0) == s.terms
    assert s == GRPOLossSettings(loss_type=LossType.CISPO, importance_sampling_level="sequence", epsilon_low=0.1,
                                 epsilon_high=0.1, beta=1.0, delta=2.0, vespo_k_pos=3.0)


def test_beta_needs_ref_logp_at_the_call():
    hidden, weight, ids, mask, adv, old, _ = _inputs()
    with pytest.raises(ValueError, match="needs ref_logp"):
        linear_grpo_loss(hidden, weight, ids, adv, mask=mask, settings=GRPOLossSettings(beta=0.1))


def test_settings_and_keywords_are_one_or_the_other():
    hidden, weight, ids, mask, adv, old, ref = _inputs()
    s = GRPOLossSettings()
    with pytest.raises(TypeError, match=r"got settings=\.\.\. and the loss settings beta as keywords"):
        linear_grpo_loss(hidden, weight, ids, adv, settings=s, beta=0.1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'epsilon'"):
        linear_grpo_loss(hidden, weight, ids, adv, epsilon=0.1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'temperature'"):  # not one of this op's
        grpo_token_terms(old, adv[:, None].expand(B, T), temperature=0.5)
    with pytest.raises(TypeError, match="settings must be a GRPOLossSettings, got dict"):
        grpo_token_terms(old, adv[:, None].expand(B, T), settings={"beta": 0.1})


@pytest.mark.parametrize("op", [grpo_token_terms, grpo_token_loss])
def test_per_token_ops_refuse_what_they_cannot_compute(op):
    logits = torch.randn(B, T, V)
    args = (logits.log_softmax(-1)[..., 0], torch.ones(B)) if op is grpo_token_terms else (
        logits, torch.zeros(B, T, dtype=torch.long), torch.ones(B))
    with pytest.raises(ValueError, match="importance_sampling_level='sequence' needs each sequence's mean"):
        op(*args, settings=GRPOLossSettings(importance_sampling_level="sequence"))
    with pytest.raises(ValueError, match="top_entropy_quantile=0.5 needs them: pass entropy_mask"):
        op(*args, settings=GRPOLossSettings(top_entropy_quantile=0.5))


def _same(a, b):
    return a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("keywords", KEYWORDS, ids=lambda k: k["loss_type"])
def test_linear_grpo_loss_settings_form_is_the_keyword_form_bit_for_bit(backend, keywords):
    results = []
    for form in ("keywords", "settings"):
        hidden, weight, ids, mask, adv, old, ref = _inputs()
        kw = dict(keywords) if form == "keywords" else {"settings": GRPOLossSettings(**keywords)}
        with use_backend(backend):
            loss, metrics = linear_grpo_loss(hidden, weight, ids, adv, mask=mask, old_logp=old, ref_logp=ref, **kw)
            loss.backward()
        results.append((loss, metrics, hidden.grad, weight.grad))
    (l1, m1, gh1, gw1), (l2, m2, gh2, gw2) = results
    assert _same(l1, l2) and _same(gh1, gh2) and _same(gw1, gw2)
    assert m1.keys() == m2.keys() and all(_same(m1[k], m2[k]) for k in m1)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("keywords", [k for k in KEYWORDS if "importance_sampling_level" not in k
                                      and "top_entropy_quantile" not in k], ids=lambda k: k["loss_type"])
def test_per_token_ops_settings_form_is_the_keyword_form(backend, keywords):
    _, _, ids, mask, adv, old, ref = _inputs()
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(B, T, V, generator=g)
    terms_kw = {k: v for k, v in keywords.items() if k in grpo_loss.TERMS_KEYWORDS}
    with use_backend(backend):
        logp = logits.log_softmax(-1).gather(-1, ids[..., None])[..., 0]
        by_kw = grpo_token_terms(logp, adv[:, None].expand(B, T).contiguous(), mask=mask, old_logp=old,
                                 ref_logp=ref, **terms_kw)
        by_settings = grpo_token_terms(logp, adv[:, None].expand(B, T).contiguous(), mask=mask, old_logp=old,
                                       ref_logp=ref, settings=GRPOLossSettings(**keywords))
        assert all(_same(a, b) for a, b in zip(by_kw, by_settings))
        if keywords["loss_type"] != "vespo":
            loss_kw = {k: v for k, v in keywords.items() if k in grpo_loss.TOKEN_LOSS_KEYWORDS}
            a = grpo_token_loss(logits, ids, adv, mask=mask, old_logp=old, ref_logp=ref, **loss_kw)
            b = grpo_token_loss(logits, ids, adv, mask=mask, old_logp=old, ref_logp=ref,
                                settings=GRPOLossSettings(**keywords))
            assert _same(a.loss, b.loss) and _same(a.logp, b.logp) and _same(a.kl, b.kl)


@pytest.mark.parametrize("backend, spied", [("torch", "_torch_token_terms"), ("triton", "grpo_token_terms_launch")])
def test_torch_and_triton_paths_get_the_settings_terms(monkeypatch, backend, spied):
    """The one settings object reaches either path's per-token terms (rebuilt from the custom op's scalars)."""
    module = grpo_loss if backend == "torch" else grpo_loss_triton
    original, seen = getattr(module, spied), []

    def spy(*args):
        seen.append(args[-1])
        return original(*args)

    monkeypatch.setattr(module, spied, spy)
    settings = GRPOLossSettings(**KEYWORDS[1])
    hidden, weight, ids, mask, adv, old, ref = _inputs()
    with use_backend(backend):
        linear_grpo_loss(hidden, weight, ids, adv, mask=mask, old_logp=old, ref_logp=ref, settings=settings)
    assert seen == [settings.terms]


def test_liger_dropin_binds_one_settings_object_and_passes_it(monkeypatch):
    from lowmem_grpo.kernels import fused_linear_grpo

    loss_fn = FusedLinearGRPOLoss(beta=0.04, loss_type="grpo", epsilon_high=0.28, temperature=0.9)
    assert loss_fn.settings == GRPOLossSettings(loss_type="grpo", beta=0.04, epsilon_high=0.28, temperature=0.9)
    assert FusedLinearGRPOLoss(beta=0.04, use_ref_model=False).settings.beta == 0.0  # no KL term
    seen = []
    original = fused_linear_grpo.linear_grpo_loss
    monkeypatch.setattr(fused_linear_grpo, "linear_grpo_loss",
                        lambda *a, **kw: seen.append(kw["settings"]) or original(*a, **kw))
    hidden, weight, ids, mask, adv, old, ref = _inputs()
    loss_fn(hidden, weight, ids, mask, adv, ref_per_token_logps=ref, old_per_token_logps=old)
    assert len(seen) == 1 and seen[0] is loss_fn.settings


def test_the_triton_functions_old_name_warns_and_gives_block_terms():
    with pytest.warns(DeprecationWarning, match="grpo_loss_triton.block_terms"):
        old = grpo_loss_triton.grpo_token_terms
    assert old is grpo_loss_triton.block_terms
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        grpo_loss_triton.nope
