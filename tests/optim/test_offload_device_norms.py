"""The offloaded optimizer's device norms (optim/offload.py, `device_norms`): a gradient that crosses to the
host once per step brings its norm with it, so end_step reads no host gradient for the global norm but those
summed on the host (accumulation, the tied head, lookup rows). The results are the host norms' bit for bit,
and the plain path's (within rounding where the tied weight's two parts meet on the host after each was
summed on the device). On this CPU "device" and host are one memory, so the tests turn device norms on: the
same function reads the same values; on a GPU the device's reduction differs by rounding
(test_offload_cuda.py)."""

import math

import pytest
import torch

import lowmem_grpo.optim.offload as offload
from lowmem_grpo.optim.offload import OffloadedOptimizer

from .test_offload import LaggingCopies, Plain, _head_loss, _loss, _make, _model, assert_states_equal_plain, \
    assert_uploaded, split_head

CLIP = 0.05  # below every step's global norm here: the clip fires (asserted)
LR = 1e-2  # test_offload's _make
MICRO_BATCHES = 3


class NormCount:
    """Counts the per-tensor norms taken, of host gradient buffers (end_step's pass over the host) and of
    gradients as they leave (device norms)."""

    def __init__(self, monkeypatch):
        self.on_host = self.on_device = 0
        self.host_buffers: set[int] = set()
        real = offload.grad_norm

        def counting(t):
            if t.data_ptr() in self.host_buffers:
                self.on_host += 1
            else:
                self.on_device += 1
            return real(t)
        monkeypatch.setattr(offload, "grad_norm", counting)

    def watch(self, opt):
        self.host_buffers |= {g.data_ptr() for g in opt.host_grad.values()}


def _backwards(model, opt, step, pattern):
    """One optimizer step's backwards, as the trainer's step modes run them.
    one: a single backward (every gradient crosses once; the tied weight's sum made by autograd);
    accumulate: MICRO_BATCHES backwards through the split head, each gradient summed on the host;
    held: the same backwards with the gradients held on the device and sent once (the layer-major
    backward's pattern): every gradient crosses once but the tied weight, whose head part is added on the host."""
    if pattern == "one":
        _loss(model, step).backward()
        opt.end_backward()
        return
    for i in range(MICRO_BATCHES):
        loss = _head_loss(model, 10 * step + i) / MICRO_BATCHES
        if pattern == "held" and isinstance(opt, OffloadedOptimizer):
            with opt.gradients_held():
                loss.backward()
        else:
            loss.backward()
        opt.end_backward()
    if pattern == "held" and isinstance(opt, OffloadedOptimizer):
        opt.send_held()
        opt.end_backward()


def _run(model, opt, pattern, steps, counts=None):
    norms, host_norms = [], []
    for step in range(steps):
        torch.manual_seed(100 + step)  # stochastic rounding draws from the global RNG, per parameter
        opt.begin_step()
        _backwards(model, opt, step, pattern)
        before = counts.on_host if counts else 0
        norms.append(opt.end_step())
        host_norms.append(counts.on_host - before if counts else 0)
    return norms, host_norms


# host norms per step after the first: none where every gradient crosses once; the tied weight's alone
# where its head part is added on the host; every tensor where each is summed on the host
EXPECTED_HOST_NORMS = {"one": lambda n: 0, "held": lambda n: 1, "accumulate": lambda n: n}


@pytest.mark.parametrize("pattern", ["one", "held", "accumulate"])
@pytest.mark.parametrize("kind", ["adamw", "adamw_8bit", "bf16_sr"])
def test_device_norms_give_the_host_norms_steps_bit_for_bit(kind, pattern, monkeypatch):
    dtype = torch.bfloat16 if kind == "bf16_sr" else torch.float32
    models = [_model(dtype) for _ in range(3)]
    plain = Plain(models[0], _make(kind), CLIP)
    opts = [OffloadedOptimizer([{"params": list(m.parameters()), "lr": LR}], _make(kind), CLIP) for m in models[1:]]
    counts = NormCount(monkeypatch)
    for opt, model, on in zip(opts, models[1:], (False, True)):
        opt.device_norms = on
        if pattern != "one":
            assert split_head(opt, model)
        counts.watch(opt)
    plain_norms, _ = _run(models[0], plain, pattern, 3)
    host_norms, host_counts = _run(models[1], opts[0], pattern, 3, counts)
    counts.on_device = 0
    device_norms, device_counts = _run(models[2], opts[1], pattern, 3, counts)
    assert all(n > CLIP for n in plain_norms), "the clip must fire"
    assert device_norms == host_norms  # the same bits
    # held: the tied weight's head part is summed apart, then added; the plain sum rounds otherwise (in bf16
    # by a bf16 step, so the plain path is compared in fp32 only)
    plain_like = pattern != "held" or dtype == torch.float32
    if plain_like:
        assert host_norms == pytest.approx(plain_norms, rel=1e-5 if pattern == "held" else 1e-6)
    n = len(opts[1].params)
    assert host_counts == [n] * 3
    assert device_counts[1:] == [EXPECTED_HOST_NORMS[pattern](n)] * 2
    # device norms: every first arrival in step 1; afterwards none for a tensor summed on the host the step before
    assert counts.on_device == (n - (pattern != "one")) + 2 * (n - EXPECTED_HOST_NORMS[pattern](n))
    for (k, x), (_, y), (_, z) in zip(*(m.named_parameters() for m in models)):
        assert torch.equal(y, z), k  # device norms: the host norms' steps, bit for bit
        if pattern != "held":
            assert torch.equal(x, y), k
        elif plain_like:  # (the clip factor too differs by rounding; in the 8-bit states that can put a value
            # one code over, which moves its weight's update by a fraction of a percent of lr)
            torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-6 if kind == "adamw" else 1e-2 * LR)
    if pattern != "held":
        assert_states_equal_plain(plain, opts[1])
    assert_uploaded(models[2], opts[1])


def test_device_norms_wait_for_their_copies(monkeypatch):
    # LaggingCopies: a gradient's copy, and the norm that crosses with it, land only when the host waits for
    # the copy's event. A global norm that read a slot before its copy landed would take the last step's
    # norm; the steps equal the host norms' bit for bit instead.
    LaggingCopies(monkeypatch)
    models = [_model(), _model()]
    opts = [OffloadedOptimizer([{"params": list(m.parameters()), "lr": 1e-2}], _make("adamw"), CLIP, lag_bytes=64)
            for m in models]
    opts[1].device_norms = True
    results = [_run(m, o, "held", 3) for m, o in zip(models, opts)]
    assert results[0] == results[1]
    for (k, x), (_, y) in zip(*(m.named_parameters() for m in models)):
        assert torch.equal(x, y), k
    assert opts[1]._norm_arrived  # the norms did cross with the gradients


def test_a_nonfinite_gradient_crossing_once_skips_the_step(monkeypatch):
    # A NaN in one layer's gradient, which crosses once: its device norm is NaN, the step is skipped and
    # counts one non-finite tensor, as with the host's norm.
    model = _model()
    opt = OffloadedOptimizer([{"params": list(model.parameters()), "lr": 1e-2}], _make("adamw"), 1.0)
    opt.device_norms = True
    counts = NormCount(monkeypatch)
    counts.watch(opt)
    _run(model, opt, "one", 1)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    poisoned = model.model.layers[1].mlp.down_proj.weight
    hook = poisoned.register_hook(lambda g: g * float("nan"))
    counts.on_host = 0
    norms, _ = _run(model, opt, "one", 1, counts)
    hook.remove()
    assert math.isnan(norms[0]) and opt.nonfinite_tensors == 1 and counts.on_host == 0
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights[k]), k
