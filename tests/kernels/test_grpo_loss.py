"""grpo_token_loss and grpo_token_terms against the spec, plus hand-derived cases."""

import math

import pytest
import torch

from lowmem_grpo.kernels import grpo_token_loss, grpo_token_terms, spec

from .helpers import assert_as_close_as_low_precision

# (name, epsilon_low, epsilon_high, beta, with_old, per_token_advantages, mask_kind)
CASES = [
    ("defaults", 0.2, None, 0.0, False, False, None),
    ("old+asym-clip", 0.2, 0.28, 0.0, True, False, "tokens"),
    ("kl", 0.2, None, 0.04, False, True, "rows"),
    ("old+kl+token-adv", 0.1, 0.3, 0.04, True, True, "tokens"),
    ("old+kl+whole-seq-masked", 0.2, 0.2, 0.04, True, False, "sequence"),
]
# The other per-token variants and options on grpo_token_loss (vespo's per-sequence weight is not a per-row op):
# (name, extra keyword arguments, importance-sampling ratio shape or None, with an entropy mask)
VARIANT_CASES = [
    ("cispo", dict(loss_type="cispo", epsilon_high=1.1), None, False),
    ("sapo", dict(loss_type="sapo", sapo_temperature_pos=0.8, sapo_temperature_neg=1.2), "token", False),
    ("delta+bias_kl", dict(loss_type="grpo", delta=1.2, epsilon_high=0.05, use_bias_correction_kl=True), None, False),
    ("is_sequence+entropy_mask", dict(loss_type="dapo"), "sequence", True),
]


def _inputs(B, T, V, dtype, device, with_old, per_token, mask_kind, beta, temperature=1.0):
    base = (torch.randn(B, T, V) * 2).to(dtype).to(device).requires_grad_()
    ids = torch.randint(0, V, (B, T), device=device)
    adv = torch.randn((B, T) if per_token else (B,), device=device)
    # old/ref near the current log-probs, so that some ratios fall inside and some outside the clip range
    with torch.no_grad():
        logp = spec.token_logprobs(base, ids, temperature=temperature)
    old = (logp + 0.3 * torch.randn(B, T, device=device)) if with_old else None
    ref = (logp + 0.5 * torch.randn(B, T, device=device)) if beta > 0 else None
    mask = None
    if mask_kind == "tokens":
        mask = torch.rand(B, T, device=device) > 0.3
    elif mask_kind == "rows":  # 0/1 float mask, padding at the end of each sequence
        mask = (torch.arange(T, device=device)[None] < torch.randint(1, T + 1, (B, 1), device=device)).float()
    elif mask_kind == "sequence":
        mask = torch.ones(B, T, dtype=torch.bool, device=device)
        mask[0] = False
    if mask is not None:  # padding ids are arbitrary (here out of range): they must be ignored
        ids = ids.masked_fill(mask == 0, -100)
    return base, ids, adv, old, ref, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_spec(device, dtype, temperature, case):
    _, eps_low, eps_high, beta, with_old, per_token, mask_kind = case
    B, T, V = 3, 7, 1001
    base, ids, adv, old, ref, mask = _inputs(B, T, V, dtype, device, with_old, per_token, mask_kind, beta, temperature)
    kwargs = dict(mask=mask, old_logp=old, ref_logp=ref, epsilon_low=eps_low, epsilon_high=eps_high, beta=beta,
                  temperature=temperature)
    names = ("loss", "logp", "kl") if ref is not None else ("loss", "logp")  # kl is constant 0 without ref
    ups = [torch.randn(B, T, device=device) for _ in names]
    out = grpo_token_loss(base * 1, ids, adv, **kwargs)
    (grad,) = torch.autograd.grad([getattr(out, n) for n in names], base, ups)

    refs = {}
    for dt in {torch.float32, dtype}:
        ref_base = base.detach().float().requires_grad_()
        r = spec.grpo_token_loss(ref_base, ids.clamp(min=0), adv, dtype=dt, **kwargs)
        (g,) = torch.autograd.grad([r[n] for n in names], ref_base, ups)
        refs[dt] = (r, g)
    (r32, g32), (r_low, g_low) = refs[torch.float32], refs[dtype]
    low = dtype != torch.float32
    for name in ("loss", "logp", "kl"):
        assert_as_close_as_low_precision(getattr(out, name), r32[name], r_low[name] if low else None, name=name)
    assert_as_close_as_low_precision(grad, g32, g_low if low else None, name="dlogits")
    for name in ("is_clipped", "is_low_clipped", "is_high_clipped"):
        assert getattr(out, name).dtype == torch.bool
        if not low:  # flags of a bf16 spec flip near the clip boundary; fp32 must agree exactly
            assert torch.equal(getattr(out, name), r32[name]), name
    if mask is not None:
        padding = mask == 0
        assert (out.loss[padding] == 0).all() and (out.logp[padding] == 0).all() and (out.kl[padding] == 0).all()
    if with_old:
        assert out.is_low_clipped.any() or out.is_high_clipped.any(), "case should exercise clipping"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", VARIANT_CASES, ids=[c[0] for c in VARIANT_CASES])
def test_variants_match_spec(device, dtype, case):
    _, extra, is_shape, entropy_mask = case
    B, T, V = 3, 7, 1001
    base, ids, adv, old, ref, mask = _inputs(B, T, V, dtype, device, True, False, "tokens", 0.04, 0.9)
    kwargs = dict(extra, mask=mask, old_logp=old, ref_logp=ref, beta=0.04, temperature=0.9)
    if is_shape:
        kwargs["importance_sampling_ratio"] = torch.rand((B, T) if is_shape == "token" else (B, 1), device=device) + 0.5
    if entropy_mask:
        kwargs["entropy_mask"] = torch.rand(B, T, device=device) > 0.5
    ups = [torch.randn(B, T, device=device) for _ in range(2)]
    out = grpo_token_loss(base * 1, ids, adv, **kwargs)
    (grad,) = torch.autograd.grad([out.loss, out.kl], base, ups)
    refs = {}
    for dt in {torch.float32, dtype}:
        ref_base = base.detach().float().requires_grad_()
        r = spec.grpo_token_loss(ref_base, ids.clamp(min=0), adv, dtype=dt, **kwargs)
        refs[dt] = (r, torch.autograd.grad([r["loss"], r["kl"]], ref_base, ups)[0])
    (r32, g32), (r_low, g_low) = refs[torch.float32], refs[dtype]
    low = dtype != torch.float32
    for name in ("loss", "logp", "kl"):
        assert_as_close_as_low_precision(getattr(out, name), r32[name], r_low[name] if low else None, name=name)
    assert_as_close_as_low_precision(grad, g32, g_low if low else None, name="dlogits")
    if not low:
        for name in ("is_low_clipped", "is_high_clipped"):
            assert torch.equal(getattr(out, name), r32[name]), name


def test_vespo_is_refused_by_the_row_op():
    with pytest.raises(ValueError, match="loss_type='vespo' weighs each sequence"):
        grpo_token_loss(torch.randn(1, 2, 5), torch.zeros(1, 2, dtype=torch.long), torch.ones(1), loss_type="vespo")


@pytest.mark.parametrize("vocab", [151936, 49152])
def test_real_vocab_sizes(device, vocab):
    base, ids, adv, old, ref, mask = _inputs(2, 3, vocab, torch.bfloat16, device, True, False, "tokens", 0.04)
    kwargs = dict(mask=mask, old_logp=old, ref_logp=ref, beta=0.04, epsilon_high=0.28)
    out = grpo_token_loss(base * 1, ids, adv, **kwargs)
    (grad,) = torch.autograd.grad(out.loss.sum(), base)
    for dt in (torch.float32, torch.bfloat16):
        rb = base.detach().float().requires_grad_()
        r = spec.grpo_token_loss(rb, ids.clamp(min=0), adv, dtype=dt, **kwargs)
        r["ref_grad"] = torch.autograd.grad(r["loss"].sum(), rb)[0]
        if dt == torch.float32:
            r32 = r
        else:
            r16 = r
    assert_as_close_as_low_precision(out.loss, r32["loss"], r16["loss"], name="loss")
    assert_as_close_as_low_precision(grad, r32["ref_grad"], r16["ref_grad"], name="dlogits")


def test_hand_derived_clipping_and_kl(device):
    # Two-token vocabulary with equal logits: p = (1/2, 1/2), logp(id 0) = -ln 2 for every token.
    logits = torch.zeros(1, 3, 2, device=device, requires_grad=True)
    ids = torch.zeros(1, 3, dtype=torch.long, device=device)
    lp = -math.log(2.0)
    # ratio will be [e, e, 1]: old = logp - 1 for the first two tokens, old = logp for the third
    old = torch.tensor([[lp - 1, lp - 1, lp]], device=device)
    adv = torch.tensor([[1.0, -1.0, 2.0]], device=device)
    ref = torch.full((1, 3), lp + math.log(2.0), device=device)  # ref - logp = ln 2
    out = grpo_token_loss(logits * 1, ids, adv, old_logp=old, ref_logp=ref, beta=0.5, epsilon_low=0.2)
    k3 = 2.0 - math.log(2.0) - 1.0  # exp(ln 2) - ln 2 - 1
    # token 0: A = +1, rho = e > 1.2 -> clipped to 1.2: loss = -1.2 + beta k3, only the KL has a gradient
    # token 1: A = -1, min(-e, -1.2) = -e -> unclipped: loss = e + beta k3
    # token 2: A = +2, rho = 1: loss = -2 + beta k3
    expected = torch.tensor([[-1.2 + 0.5 * k3, math.e + 0.5 * k3, -2.0 + 0.5 * k3]], device=device)
    torch.testing.assert_close(out.loss, expected)
    torch.testing.assert_close(out.kl, torch.full((1, 3), k3, device=device))
    assert out.is_high_clipped.tolist() == [[True, False, False]]
    assert out.is_low_clipped.tolist() == [[False, False, False]]
    out.loss.sum().backward()
    # dl/dlogp: clipped -> 0 + beta (1 - 2); unclipped -> -rho A + beta (1 - 2)
    dl_dlogp = torch.tensor([-0.5, math.e - 0.5, -2.0 - 0.5], device=device)
    # dlogp/dlogits = onehot(0) - p = (1/2, -1/2)
    expected_grad = dl_dlogp[:, None] * torch.tensor([0.5, -0.5], device=device)
    torch.testing.assert_close(logits.grad[0], expected_grad)


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_token_terms_match_spec(device, beta):
    B, T = 4, 9
    logp = (-torch.rand(B, T, device=device) * 5).requires_grad_()
    old = logp.detach() + 0.3 * torch.randn(B, T, device=device)
    ref = logp.detach() + 0.5 * torch.randn(B, T, device=device) if beta else None
    adv = torch.randn(B, T, device=device)
    mask = torch.rand(B, T, device=device) > 0.2
    kw = dict(mask=mask, old_logp=old, ref_logp=ref, epsilon_low=0.2, epsilon_high=0.28, beta=beta)
    loss, kl, code = grpo_token_terms(logp, adv, **kw)
    g = torch.randn(B, T, device=device)
    (grad,) = torch.autograd.grad(loss, logp, g)
    r = spec.grpo_token_terms(logp, adv, **kw)
    (ref_grad,) = torch.autograd.grad(r["loss"], logp, g)
    torch.testing.assert_close(loss, r["loss"])
    torch.testing.assert_close(kl, r["kl"])
    torch.testing.assert_close(grad, ref_grad)
    assert torch.equal(code == 1, r["is_low_clipped"]) and torch.equal(code == 2, r["is_high_clipped"])


def test_bad_input_errors():
    logits = torch.randn(2, 3, 10)
    ids = torch.zeros(2, 3, dtype=torch.long)
    adv = torch.zeros(2)
    with pytest.raises(ValueError, match="needs ref_logp"):
        grpo_token_loss(logits, ids, adv, beta=0.04)
    with pytest.raises(ValueError, match=r"advantages must have shape \(2,\) or \(2, 3\)"):
        grpo_token_loss(logits, ids, torch.zeros(3))
    with pytest.raises(ValueError, match=r"old_logp must have shape \(2, 3\)"):
        grpo_token_loss(logits, ids, adv, old_logp=torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"mask must have shape \(2, 3\)"):
        grpo_token_loss(logits, ids, adv, mask=torch.ones(3, 2))
    with pytest.raises(ValueError, match="epsilon_low must be in"):
        grpo_token_loss(logits, ids, adv, epsilon_low=1.5)
    with pytest.raises(ValueError, match=r"logits must have shape \(B, T, V\)"):
        grpo_token_loss(logits[0], ids[0], adv)
    with pytest.raises(ValueError, match="ids must lie in"):  # unmasked padding id
        grpo_token_loss(logits, torch.full((2, 3), -100), adv)
