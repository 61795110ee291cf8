"""FusedLinearGRPOLoss against Liger-Kernel's own LigerFusedLinearGRPOLoss (compiled=False), called the same way:
loss, metrics tuple and the gradients of input / weight / bias, over the parametrisation of Liger's test_correctness
at its small shape, plus vllm_is_ratio, bias-corrected KL, num_items_in_batch, the warning and the refusals.
Skipped where liger-kernel is not installed (the `bench` extra)."""

import itertools
import re

import pytest
import torch

from lowmem_grpo.kernels import FusedLinearGRPOLoss

liger = pytest.importorskip("liger_kernel.chunked_loss", reason="needs liger-kernel (pip install '.[bench]')")
LigerFusedLinearGRPOLoss = liger.LigerFusedLinearGRPOLoss

SMALL, LARGE = (3, 47, 31, 123), (8, 128, 1024, 4096)
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.bfloat16: dict(atol=1e-1, rtol=5e-1)}  # bf16: Liger's own
LOSS_TYPES = ["bnpo", "grpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
HPARAMS = [(0.1, 0.2, 0.2, 1.0), (0.0, 0.1, 0.1, 2.0)]  # (beta, epsilon_low, epsilon_high, temperature), Liger's
REF_COMBOS = [(True, True, True), (True, False, False), (False, False, True)]  # use_ref_model, ref logps, old logps


def _case(shape, dtype=torch.float32, bias=False, temperature=1.0, use_ref_model=True, ref_logps=True, old=True,
          seed=0):
    """Inputs shaped as Liger's test_correctness builds them: random padding anywhere, advantages of both signs,
    ref / old log-probs near the policy's, a reference head near the policy head."""
    B, T, H, V = shape
    g = torch.Generator().manual_seed(seed)

    def randn(*size, scale=1.0):
        return (torch.randn(*size, generator=g) * scale).to(dtype)

    weight, b = randn(V, H), randn(V) if bias else None
    ref_weight, ref_bias = weight + randn(V, H, scale=0.01), (b + randn(V, scale=0.01) if bias else None)
    x, ids = randn(B, T, H), torch.randint(0, V, (B, T), generator=g)
    with torch.no_grad():
        logits = x @ weight.t() + (0 if b is None else b)
        logp = torch.log_softmax(logits / temperature, -1).gather(-1, ids[..., None])[..., 0]
    mask = torch.ones(B, T)
    n_masked = int(torch.randint(1, B * T // 2, (1,), generator=g))
    mask.view(-1)[torch.randperm(B * T, generator=g)[:n_masked]] = 0
    adv = randn(B)
    adv[0], adv[1] = -adv[0].abs(), adv[1].abs()
    inputs = dict(_input=x, lin_weight=weight, selected_token_ids=ids, attention_mask=mask, advantages=adv, bias=b,
                  ref_per_token_logps=None, old_per_token_logps=None, ref_input=None, ref_weight=ref_weight,
                  ref_bias=ref_bias)
    if use_ref_model and ref_logps:
        inputs["ref_per_token_logps"] = logp + torch.randn(B, T, generator=g) * 0.01
    elif use_ref_model:
        inputs["ref_input"] = x + randn(B, T, H, scale=0.01)
    if old:
        inputs["old_per_token_logps"] = logp + torch.randn(B, T, generator=g) * 0.01
    return inputs


def _run(module, inputs, grad_scale=1.0, frozen=(), **extra):
    """(loss, metrics, grads of _input / lin_weight / bias but the `frozen` ones) of one forward and backward of
    (grad_scale * loss); a positional call as Liger's own test makes."""
    args = dict(inputs)
    leaves = [k for k in ("_input", "lin_weight", "bias") if args[k] is not None and k not in frozen]
    for k in leaves:
        args[k] = args[k].clone().requires_grad_()
    order = ("_input", "lin_weight", "selected_token_ids", "attention_mask", "advantages", "bias",
             "ref_per_token_logps", "old_per_token_logps", "ref_input", "ref_weight", "ref_bias")
    loss, metrics = module(*(args[k] for k in order), **extra)
    (grad_scale * loss).backward()
    return loss.detach(), tuple(m.detach() for m in metrics), [args[k].grad for k in leaves]


def _both(kwargs, inputs, **extra):
    ours = _run(FusedLinearGRPOLoss(**kwargs), inputs, **extra)
    theirs = _run(LigerFusedLinearGRPOLoss(compiled=False, **kwargs), inputs, **extra)
    return ours, theirs


def _assert_same(ours, theirs, dtype=torch.float32):
    tol = TOL[dtype]
    torch.testing.assert_close(ours[0], theirs[0], **tol)
    assert isinstance(ours[1], tuple) and len(ours[1]) == len(theirs[1])
    for got, want in zip(ours[1], theirs[1]):
        torch.testing.assert_close(got, want, **tol)
    assert len(ours[2]) == len(theirs[2])
    for got, want in zip(ours[2], theirs[2]):
        torch.testing.assert_close(got, want, **tol)


def _kwargs(loss_type, level="token", delta=None, hparams=HPARAMS[0], use_ref_model=True, T=SMALL[1], **more):
    beta, eps_low, eps_high, temperature = hparams
    return dict(beta=beta, epsilon_low=eps_low, epsilon_high=eps_high, temperature=temperature,
                use_ref_model=use_ref_model, loss_type=loss_type, importance_sampling_level=level, delta=delta,
                max_completion_length=T if loss_type == "dr_grpo" else None, **more)


CORRECTNESS = [c for c in itertools.product(LOSS_TYPES, ["token", "sequence"], [None, 2.0], HPARAMS, REF_COMBOS,
                                            [True, False], [torch.float32, torch.bfloat16])
               if not (c[1] == "sequence" and c[0] in ("cispo", "sapo", "vespo"))  # refused (test below)
               and not (c[0] == "vespo" and c[6] == torch.bfloat16)  # Liger: exp(log phi) amplifies bf16 noise
               and not (c[0] == "luspo" and c[1] == "token" and c[6] == torch.bfloat16)]  # test below


@pytest.mark.parametrize("loss_type, level, delta, hparams, refs, bias, dtype", CORRECTNESS)
def test_correctness_matches_liger(loss_type, level, delta, hparams, refs, bias, dtype):
    use_ref_model, ref_logps, old = refs
    inputs = _case(SMALL, dtype, bias, hparams[3], use_ref_model, ref_logps, old)
    ours, theirs = _both(_kwargs(loss_type, level, delta, hparams, use_ref_model), inputs)
    _assert_same(ours, theirs, dtype)
    assert len(ours[1]) == (2 if hparams[0] else 1)


@pytest.mark.parametrize("hparams", HPARAMS)
@pytest.mark.parametrize("refs", REF_COMBOS)
def test_bf16_token_level_luspo_is_as_accurate_as_liger(hparams, refs):
    """Token-level luspo multiplies each token's bf16 rounding by its sequence's length (Liger's own test skips
    that level), beyond bf16's tolerance between two implementations: both are measured against the same
    loss computed in fp32 from the same bf16 inputs instead, and ours must be about as close as Liger's."""
    inputs = _case(SMALL, torch.bfloat16, True, hparams[3], *refs)
    kwargs = _kwargs("luspo", "token", None, hparams, refs[0])
    fp32 = {k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in inputs.items()}
    truth = _run(FusedLinearGRPOLoss(**kwargs), fp32)
    ours, theirs = _both(kwargs, inputs)

    def errors(result):
        return [float((result[0] - truth[0]).abs())] + [float((g.float() - t).norm() / t.norm())
                                                         for g, t in zip(result[2], truth[2])]

    for got, liger_err in zip(errors(ours), errors(theirs)):
        assert got <= 2.0 * liger_err + 0.01, (errors(ours), errors(theirs))


SLOW_CASES = [("dapo", "token", None, torch.float32), ("grpo", "sequence", 2.0, torch.float32),
              ("luspo", "sequence", None, torch.float32), ("cispo", "token", None, torch.float32),
              ("bnpo", "token", None, torch.bfloat16)]


@pytest.mark.slow
@pytest.mark.parametrize("loss_type, level, delta, dtype", SLOW_CASES)
def test_correctness_matches_liger_large(loss_type, level, delta, dtype):
    inputs = _case(LARGE, dtype, bias=True, use_ref_model=True, ref_logps=False, old=True)
    ours, theirs = _both(_kwargs(loss_type, level, delta, T=LARGE[1]), inputs)
    _assert_same(ours, theirs, dtype)


@pytest.mark.parametrize("shape_kind", ["B", "B1", "BT"])
@pytest.mark.parametrize("loss_type, level", [(t, "token") for t in LOSS_TYPES if t != "dr_grpo"]
                         + [("luspo", "sequence"), ("grpo", "sequence")])
@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_vllm_is_ratio_matches_liger(shape_kind, loss_type, level, beta):
    inputs = _case(SMALL, old=True)
    B, T = SMALL[:2]
    g = torch.Generator().manual_seed(3)
    size = {"B": (B,), "B1": (B, 1), "BT": (B, T)}[shape_kind]
    ratio = torch.rand(*size, generator=g) * 0.999 + 0.001
    ours, theirs = _both(_kwargs(loss_type, level, hparams=(beta, 0.2, 0.28, 1.0)), inputs, vllm_is_ratio=ratio)
    _assert_same(ours, theirs)
    plain, _ = _both(_kwargs(loss_type, level, hparams=(beta, 0.2, 0.28, 1.0)), inputs)
    assert not torch.allclose(ours[0], plain[0])  # the ratio reached the loss


@pytest.mark.parametrize("loss_type, level", [(t, lv) for t in ("grpo", "dapo", "luspo") for lv in ("token", "sequence")]
                         + [("cispo", "token")])
def test_bias_corrected_kl_matches_liger(loss_type, level):
    inputs = _case(SMALL, use_ref_model=True, ref_logps=False, old=True)
    inputs["old_per_token_logps"] = inputs["old_per_token_logps"] + 0.3 * torch.randn(SMALL[:2])  # rho far from 1
    kwargs = _kwargs(loss_type, level, use_bias_correction_kl=True)
    ours, theirs = _both(kwargs, inputs)
    _assert_same(ours, theirs)
    plain, _ = _both(dict(kwargs, use_bias_correction_kl=False), inputs)
    assert not torch.allclose(ours[1][0], plain[1][0])  # the kl metric moved with the correction


@pytest.mark.parametrize("loss_type", ["dapo", "cispo", "vespo", "bnpo", "luspo"])
@pytest.mark.parametrize("as_tensor", [False, True])
def test_num_items_in_batch_matches_liger(loss_type, as_tensor):
    inputs = _case(SMALL, use_ref_model=False, old=True)
    n = float(inputs["attention_mask"].sum()) * 1.7
    ours, theirs = _both(_kwargs(loss_type, use_ref_model=False), inputs,
                         num_items_in_batch=torch.tensor(n) if as_tensor else n)
    _assert_same(ours, theirs)
    default, _ = _both(_kwargs(loss_type, use_ref_model=False), inputs)
    if loss_type in ("dapo", "cispo", "vespo"):  # their normaliser; the others ignore it, as Liger's
        torch.testing.assert_close(ours[0] * 1.7, default[0])
    else:
        torch.testing.assert_close(ours[0], default[0])


@pytest.mark.parametrize("loss_type", ["dapo", "luspo"])
def test_no_reference_model_means_no_kl(loss_type):
    """use_ref_model=False: no KL term and a kl metric of 0 even when reference log-probs are given, as Liger."""
    inputs = _case(SMALL, use_ref_model=True, ref_logps=True, old=True)
    inputs["ref_per_token_logps"] = inputs["ref_per_token_logps"] - 1.0  # a KL term would be large
    ours, theirs = _both(_kwargs(loss_type, use_ref_model=False), inputs)
    _assert_same(ours, theirs)
    assert ours[1][0] == 0.0
    without_kl = _run(FusedLinearGRPOLoss(**_kwargs(loss_type, hparams=(0.0, 0.2, 0.2, 1.0))), inputs)
    _assert_same((ours[0], (ours[1][1],), ours[2]), without_kl)


def test_both_reference_inputs_warn_and_use_the_log_probs():
    """Our warning's text is Liger's own (tests read it with pytest.warns(match=...))."""
    inputs = _case(SMALL, use_ref_model=True, ref_logps=True, old=True)
    both = dict(inputs, ref_input=inputs["_input"] + 0.5)
    with pytest.warns(UserWarning) as theirs_warned:
        theirs = _run(LigerFusedLinearGRPOLoss(compiled=False, **_kwargs("dapo")), both)
    liger_text = str(theirs_warned[0].message)
    assert "Using ref_per_token_logps" in liger_text
    with pytest.warns(UserWarning, match=re.escape(liger_text)):
        ours = _run(FusedLinearGRPOLoss(**_kwargs("dapo")), both)
    _assert_same(ours, theirs)
    _assert_same(ours, _run(FusedLinearGRPOLoss(**_kwargs("dapo")), inputs))


def test_frozen_head_and_scaled_backward_match_liger():
    inputs = _case(SMALL, bias=True, use_ref_model=True, ref_logps=False, old=True)
    ours, theirs = _both(_kwargs("grpo"), inputs, grad_scale=2.5, frozen=("lin_weight",))  # a trainable bias
    assert len(ours[2]) == 2 and all(g is not None for g in ours[2])
    _assert_same(ours, theirs)
    unscaled = _run(FusedLinearGRPOLoss(**_kwargs("grpo")), inputs, frozen=("lin_weight",))
    for got, want in zip(ours[2], unscaled[2]):
        torch.testing.assert_close(got, 2.5 * want)


@pytest.mark.parametrize("loss_type", ["cispo", "sapo", "vespo"])
def test_sequence_level_refusal_matches_liger(loss_type):
    inputs = _case(SMALL, use_ref_model=False)
    for cls in (FusedLinearGRPOLoss, LigerFusedLinearGRPOLoss):
        module = cls(**_kwargs(loss_type, "sequence", use_ref_model=False))  # constructing is fine, as Liger
        with pytest.raises(ValueError, match="Sequence-level importance sampling is not supported"):
            _run(module, inputs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(delta=0.0), "delta"), (dict(delta=-1.0), "delta"), (dict(sapo_temperature_pos=0.0), "sapo_temperature_pos"),
    (dict(sapo_temperature_neg=-1.0), "sapo_temperature_neg"),
])
def test_bad_settings_are_refused_at_construction_as_liger(kwargs, match):
    for cls in (FusedLinearGRPOLoss, LigerFusedLinearGRPOLoss):
        with pytest.raises(ValueError, match=match):
            cls(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(loss_type="dr_grpo"), "max_completion_length"), (dict(loss_type="nope"), "loss_type"),
    (dict(importance_sampling_level="seq"), "importance_sampling_level"), (dict(epsilon_low=1.5), "epsilon_low"),
    (dict(temperature=0.0), "temperature"),
])
def test_our_construction_checks(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FusedLinearGRPOLoss(**kwargs)


def test_missing_reference_is_a_value_error_naming_the_fix():
    inputs = _case(SMALL, use_ref_model=False)
    for beta in (0.0, 0.1):  # Liger asserts for either beta
        with pytest.raises(ValueError, match="ref_per_token_logps=.*ref_input=.*use_ref_model=False"):
            _run(FusedLinearGRPOLoss(beta=beta), inputs)
        with pytest.raises(AssertionError):
            _run(LigerFusedLinearGRPOLoss(beta=beta, compiled=False), inputs)
    with pytest.raises(ValueError, match="ref_weight"):
        _run(FusedLinearGRPOLoss(), dict(inputs, ref_input=inputs["_input"], ref_weight=None))


@pytest.mark.parametrize("size", [(3, 2), (2,), (3, 47, 1)])
def test_bad_vllm_is_ratio_shape_is_refused(size):
    inputs = _case(SMALL, use_ref_model=False)
    with pytest.raises(ValueError, match=r"vllm_is_ratio must have shape \(3,\), \(3, 1\) or \(3, 47\)"):
        _run(FusedLinearGRPOLoss(use_ref_model=False), inputs, vllm_is_ratio=torch.ones(size))
