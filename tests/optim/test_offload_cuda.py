"""The offloaded optimizer on a GPU against the device's own optimizer (optim/offload.py), and the rule
they are compared by (ulp.py, `assert_within_updates`), with the CPU evidence for its bounds.

Both paths take the same gradients (both backwards run on the GPU) and step through different kernels, the
host's CPU kernels and the device's CUDA kernels. What that changes:

- The clip norm. Both take torch clip_grad_norm_'s: per-tensor norms accumulated in fp32, rounded to the
  gradient dtype, their norm in that dtype (offload.py `_global_norm`; each tensor's on the GPU as its
  gradient leaves, or on the host where the host summed it: `device_norms`). The fp32 sums of two kernels differ
  in their last bits, so in bf16 a tensor's norm may round to the neighbouring bf16 value (the first H100
  run: totals of 2.53125 and 2.515625, both bf16 numbers): each tensor's norm within 2**-7 relative, the
  total's own rounding one ulp more, so bf16 norms agree within 3 x 2**-7 (BF16_NORMS).
- bitsandbytes' 8-bit AdamW (adamw_8bit, bf16_sr). Its CUDA kernel applies the decoupled weight decay after
  the update, (p + u)(1 - lr wd); its CPU path, and the host kernel that follows it (host_adamw.py), before,
  p (1 - lr wd) + u: lr wd of an update apart, on every element (1e-4 here; 1e-8 at lr 1e-6, wd 1e-2; none
  at the default wd 0). Its bias corrections use __powf, a fast approximation (up to ~1e-4 of the first
  step's update). The rule allows FP32_STATES = 2**-11 of an update per step for these and fp32 AdamW.
- torch AdamW on bf16 weights keeps its moments in bf16, and the update m / denom goes through four bf16
  roundings: one step after a one-ulp change of the clip norm lands up to ~2**-6.4 of an update apart
  (measured below), so BF16_STATES = 2**-5. After that step the paths' forwards differ, a bf16 gradient
  whose terms cancel changes by as much as its own size, and Adam's per-element normalisation turns that
  into whole updates: on the CPU, runs with the clip norm one bf16 ulp apart ended 0.3 lr apart after two
  steps and 1.1 lr after four. So bf16 AdamW is compared after one step; fp32 AdamW, whose runs stay
  together (under 1e-5 lr apart after four such steps), after four.

A dropped gradient contribution or a missed step changes elements by whole updates (~lr): outside every
bound here (`test_tied_head_split_drops_nothing_the_rule_would_miss`); a missed last upload fails
`assert_uploaded` whatever the update's size.
"""

import math

import pytest
import torch

from lowmem_grpo.optim.offload import OffloadedOptimizer

from .test_offload import (Plain, _loss, _make, _model, _step, assert_every_weight_moved,
                           assert_uploaded, split_head)
from .ulp import BF16_STATES, FP32_STATES, assert_within_one_bf16_ulp, assert_within_updates, bf16_ulp

LR = 1e-2
BF16_NORMS = 3 * 2.0 ** -7  # relative: two kernels' bf16 clip norms (module docstring)


def _fraction(kind: str, dtype: torch.dtype) -> float:
    """The rule's share of an update per step for optimizer `kind` on `dtype` weights (module docstring)."""
    return BF16_STATES if kind == "adamw" and dtype == torch.bfloat16 else FP32_STATES


def _states_equal(a: dict, b: dict) -> None:
    for sa, sb in zip(a["inner"], b["inner"]):
        assert sa["param_groups"] == sb["param_groups"]
        for key in sa["state"]:
            for name, va in sa["state"][key].items():
                torch.testing.assert_close(va, sb["state"][key][name], rtol=0, atol=0, msg=name)


# --- The rule and its evidence, on the CPU --------------------------------------------------------------

def test_one_bf16_ulp_rule():
    # The rule's bound, per element: equal or neighbours pass; two ulps, or a norm gain's 1e-2 step, fail.
    one = torch.tensor([1.0, 0.02, -3.0, 0.0], dtype=torch.bfloat16)
    assert torch.equal(bf16_ulp(one), torch.tensor([2.0 ** -7, 2.0 ** -13, 2.0 ** -6, 2.0 ** -133]))
    assert_within_one_bf16_ulp(one, one, "equal")
    neighbours = one.float() + bf16_ulp(one)
    assert torch.equal(neighbours.to(torch.bfloat16).float(), neighbours)  # exactly the next bf16 numbers
    assert_within_one_bf16_ulp(one, neighbours.to(torch.bfloat16), "up")
    below_one = torch.tensor([1.0 - 2.0 ** -8], dtype=torch.bfloat16)  # 1.0's neighbour below: half a spacing
    assert_within_one_bf16_ulp(torch.tensor([1.0]), below_one, "below 1.0")
    with pytest.raises(AssertionError, match="1 of 1 elements"):
        assert_within_one_bf16_ulp(torch.tensor([1.0]), torch.tensor([1.0 - 2.0 ** -7]), "two below")
    with pytest.raises(AssertionError, match="1 of 4 elements"):
        assert_within_one_bf16_ulp(one, one.float() + torch.tensor([0.0, 0.0, 0.0, 1e-3]), "an update at 0")


def test_update_rule_by_hand():
    # Own rounding plus fraction x lr per step, per element; a whole update (a dropped contribution, a
    # missed step) is outside it at every fraction the tests use.
    w = torch.tensor([0.5, 1e-4, -0.02, 0.0])
    allowed = 1e-7 + 1e-5 * w.abs() + FP32_STATES * LR * 4
    assert_within_updates(w, w + allowed * 0.99, "fp32, four steps", lr=LR, steps=4, fraction=FP32_STATES)
    with pytest.raises(AssertionError, match="1 of 4 elements"):
        over = w + allowed * torch.tensor([0.5, 1.01, 0.5, 0.5])
        assert_within_updates(w, over, "just over", lr=LR, steps=4, fraction=FP32_STATES)
    b = w.to(torch.bfloat16)
    near = b.float() + bf16_ulp(b) + BF16_STATES * LR * 0.99  # one ulp and almost the fraction
    assert_within_updates(b, near, "bf16", lr=LR, steps=1, fraction=BF16_STATES)
    for ref, fraction in ((w, FP32_STATES), (b, BF16_STATES)):
        with pytest.raises(AssertionError, match="4 of 4 elements"):
            assert_within_updates(ref, ref.float() - LR, "a missed step", lr=LR, steps=1, fraction=fraction)


def test_bitsandbytes_cuda_order_of_the_decay_is_within_the_rule():
    # One 8-bit AdamW step by bitsandbytes' CPU path, against the CUDA kernel's arithmetic written out in
    # fp32 (kOptimizerStatic8bit2StateBlockwise: the update, then the decay; its __powf left exact here):
    # every element lr^2 wd apart, beyond 1e-5 relative + 1e-7, within the rule's fraction.
    bnb = pytest.importorskip("bitsandbytes")
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(4096, generator=gen) * 0.02
    g = torch.randn(4096, generator=gen) * 1e-3
    p = w0.clone()
    opt = bnb.optim.AdamW8bit([p], lr=LR, min_8bit_size=256)
    wd, (b1, b2), eps = opt.defaults["weight_decay"], opt.defaults["betas"], opt.defaults["eps"]
    p.grad = g
    opt.step()
    assert opt.state[p]["state1"].dtype == torch.uint8 and wd > 0  # 8-bit states, decay on
    m, v = (1 - b1) * g, (1 - b2) * g * g
    c1, c2 = 1 - b1, math.sqrt(1 - b2)
    cuda = (w0 + (-LR * c2 / c1) * (m / (v.sqrt() + c2 * eps))) * (1 - LR * wd)
    d = (p - cuda).abs()
    assert (d > 1e-7 + 1e-5 * cuda.abs()).all() and d.max() < 1.01 * LR * LR * wd
    assert_within_updates(cuda, p, "decay order", lr=LR, steps=1, fraction=FP32_STATES)


def test_bf16_adam_states_one_clip_ulp_is_within_the_rule():
    # torch AdamW on bf16 weights, one step, with the clip norm one bf16 ulp apart (as two kernels' bf16
    # norms may be): weights further apart than one bf16 ulp (the old rule), within BF16_STATES x lr.
    def run(norm_ulps):
        model = _model(torch.bfloat16)
        params = list(model.parameters())
        opt = _make("adamw")([{"params": params, "lr": LR}])
        _loss(model, 0).backward()
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        torch.nn.utils.clip_grads_with_norm_(params, 1.0, norm + norm_ulps * bf16_ulp(norm).to(norm.dtype))
        assert norm > 1.0 and norm.dtype == torch.bfloat16  # clipped, by a bf16 norm
        opt.step()
        return model
    a, b = run(0), run(1)
    beyond_an_ulp = 0
    for (k, x), (_, y) in zip(a.named_parameters(), b.named_parameters()):
        assert_within_updates(x, y, k, lr=LR, steps=1, fraction=BF16_STATES)
        d = (x.float() - y.float()).abs()
        beyond_an_ulp += int((d > torch.minimum(bf16_ulp(x), bf16_ulp(y))).sum())
    assert beyond_an_ulp > 0


def test_tied_head_split_drops_nothing_the_rule_would_miss():
    # The head's contribution of the tied weight lost (as in test_offload.py's
    # test_tied_head_split_drops_nothing): after one step the weight is outside the rule even at the
    # loosest fraction used here.
    models = [_model(), _model()]
    opts = [OffloadedOptimizer([{"params": list(m.parameters()), "lr": LR}], _make("adamw"), None)
            for m in models]
    split_head(opts[1], models[1])
    opts[1]._head_hook = lambda leaf: setattr(leaf, "grad", None)  # noqa: E731  (the head's part, lost)
    opts[1]._head_leaf = None  # the leaf is made again, with the lossy hook
    for m, o in zip(models, opts):
        _step(m, o, 0)
    with pytest.raises(AssertionError, match="further than the rule allows"):
        assert_within_updates(models[0].lm_head.weight, models[1].lm_head.weight, "tied", lr=LR, steps=1,
                              fraction=BF16_STATES)


# --- On a GPU: the host's CPU kernels against the device's CUDA kernels ---------------------------------

@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind, dtype, steps", [
    ("adamw", torch.float32, 4), ("adamw", torch.bfloat16, 1), ("adamw_8bit", torch.float32, 1),
    ("bf16_sr", torch.bfloat16, 1)])
def test_offloaded_on_cuda_matches_and_holds_no_device_states(kind, dtype, steps):
    # Weights within the rule (module docstring: bf16 AdamW and the 8-bit optimizers one step, fp32 AdamW
    # four). One step where the two paths cannot stay together: bf16 Adam moments (module docstring);
    # bitsandbytes' 8-bit states, quantised by the CPU and the CUDA kernel from fp32 values that differ in
    # their last bits, so now and then one lands on the neighbouring 8-bit code; stochastic rounding, whose
    # noise comes from the GPU's RNG on the device and the CPU's on the host. Every weight moved, every
    # device weight is its host copy (a missed last upload fails that even where an update is under an
    # ulp), no optimizer state is on the device.
    on_device, offloaded = _model(dtype, "cuda"), _model(dtype, "cuda")
    start = {k: v.detach().clone() for k, v in on_device.named_parameters()}
    # lr 1e-2: more than one bf16 ulp at a norm gain of 1.0 (2**-7), so every element moves
    a = Plain(on_device, _make(kind), 1.0)
    b = OffloadedOptimizer([{"params": list(offloaded.parameters()), "lr": LR}], _make(kind), 1.0)
    for step in range(steps):
        for model, opt in ((on_device, a), (offloaded, b)):
            torch.manual_seed(10 + step)
            opt.begin_step()
            _loss(model, step).backward()
            assert math.isfinite(opt.end_step())
    torch.cuda.synchronize()
    assert_uploaded(offloaded, b)
    assert_every_weight_moved(offloaded, start)
    for (k, x), (_, y) in zip(on_device.named_parameters(), offloaded.named_parameters()):
        assert_within_updates(x, y, k, lr=LR, steps=steps, fraction=_fraction(kind, dtype))
    for s in b.state_dict()["inner"]:
        for v in s["state"].values():
            assert all(t.device.type == "cpu" for t in v.values() if isinstance(t, torch.Tensor))


def _split_on_cuda(kind, dtype, max_grad_norm):
    """(models, optimizers) for "device" (the plain path on the GPU), "unsplit" and "split" (offloaded,
    without and with the tied-head split), all on CUDA."""
    models = {name: _model(dtype, "cuda") for name in ("device", "unsplit", "split")}
    opts = {"device": Plain(models["device"], _make(kind), max_grad_norm)}
    for name in ("unsplit", "split"):
        opts[name] = OffloadedOptimizer([{"params": list(models[name].parameters()), "lr": LR}],
                                                  _make(kind), max_grad_norm)
    assert split_head(opts["split"], models["split"])
    return models, opts


@pytest.mark.cuda
@pytest.mark.parametrize("kind, dtype", [("adamw", torch.float32), ("adamw_8bit", torch.float32),
                                         ("bf16_sr", torch.bfloat16)])
def test_cuda_tied_head_split_equals_the_unsplit_offload_bit_for_bit(kind, dtype):
    # Split and unsplit share every line of host code (the same inner optimizer on the host, the same CPU
    # RNG draws in the same order for stochastic rounding) and get the same device gradients (eager
    # attention, no atomics in the fused head): the only difference is where the tied weight's two
    # contributions meet, summed by autograd on the GPU or by the optimizer on the host, one rounding
    # either way. So bit for bit, after several steps. (No clipping here: the tied norm is computed on
    # the GPU without the split and on the host with it, two kernels' sums; the next test clips.)
    models, opts = _split_on_cuda(kind, dtype, None)
    split = opts["split"]
    start = {k: v.detach().clone() for k, v in models["split"].named_parameters()}
    for step in range(4):
        norms = {name: _step(models[name], opts[name], step) for name in ("unsplit", "split")}
        assert norms["split"] == pytest.approx(norms["unsplit"], rel=BF16_NORMS if dtype == torch.bfloat16 else 1e-6)
        # both contributions were there: the head's reached the host buffer (its event waited for) ...
        assert split.head_host.float().abs().sum() > 0 and not split._head_arrived
        assert split.max_live_grads == 1  # ... and the device held one gradient at a time
    torch.cuda.synchronize()
    for (k, x), (_, y) in zip(models["unsplit"].named_parameters(), models["split"].named_parameters()):
        assert torch.equal(x, y), k
    _states_equal(opts["unsplit"].state_dict(), split.state_dict())
    assert_uploaded(models["split"], split)
    assert_every_weight_moved(models["split"], start)
    assert all(p.grad is None for p in models["split"].parameters())


@pytest.mark.cuda
@pytest.mark.parametrize("kind, dtype, steps", [("adamw", torch.float32, 4), ("adamw", torch.bfloat16, 1),
                                                ("bf16_sr", torch.bfloat16, 1)])
def test_cuda_tied_head_split_matches_the_device_optimizer(kind, dtype, steps):
    # Against the plain path on the GPU (its optimizer's CUDA kernels, the head's and the lookup's
    # contributions summed by autograd on the device), with the global clip active: norms and weights
    # within the module docstring's rules, for as many steps as test_offloaded_on_cuda_matches_and_holds_
    # no_device_states takes. Dropping either contribution of the tied weight moves it by whole updates, far
    # outside them.
    models, opts = _split_on_cuda(kind, dtype, 0.05)
    start = {k: v.detach().clone() for k, v in models["split"].named_parameters()}
    for step in range(steps):
        norms = {name: _step(models[name], opts[name], step) for name in ("device", "split")}
        rel = BF16_NORMS if dtype == torch.bfloat16 else 1e-3
        assert norms["split"] == pytest.approx(norms["device"], rel=rel) and norms["device"] > 0.05  # clipped
    torch.cuda.synchronize()
    for (k, x), (_, y) in zip(models["device"].named_parameters(), models["split"].named_parameters()):
        assert_within_updates(x, y, k, lr=LR, steps=steps, fraction=_fraction(kind, dtype))
    assert_uploaded(models["split"], opts["split"])
    assert_every_weight_moved(models["split"], start)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind, dtype", [("adamw", torch.float32), ("bf16_sr", torch.bfloat16)])
def test_cuda_device_norms_match_the_host_norms(kind, dtype):
    # device_norms (on by default on CUDA): each gradient's norm taken on the GPU as it leaves, copied with
    # it; against the same optimizer taking every norm on the host: the norms are two kernels' sums (within
    # the module docstring's bounds), the clip fires, and the weights stay within the rule over the steps
    # it allows; every norm but none of a host sum crossed (one backward per step: every gradient once).
    models = [_model(dtype, "cuda") for _ in range(2)]
    opts = [OffloadedOptimizer([{"params": list(m.parameters()), "lr": LR}], _make(kind), 0.05) for m in models]
    assert opts[0].device_norms
    opts[1].device_norms = False
    steps = 4 if dtype == torch.float32 else 1
    for step in range(steps):
        norms = []
        for model, opt in zip(models, opts):
            torch.manual_seed(10 + step)
            opt.begin_step()
            _loss(model, step).backward()
            norms.append(opt.end_step())
        assert norms[0] == pytest.approx(norms[1], rel=BF16_NORMS if dtype == torch.bfloat16 else 1e-5)
        assert norms[1] > 0.05  # clipped
        assert opts[0]._norm_arrived == set(range(len(opts[0].params))) and not opts[1]._norm_arrived
    torch.cuda.synchronize()
    for (k, x), (_, y) in zip(*(m.named_parameters() for m in models)):
        assert_within_updates(x, y, k, lr=LR, steps=steps, fraction=_fraction(kind, dtype))
    assert_uploaded(models[0], opts[0])
