"""Gradient accumulation with the offloaded optimizer (optim/offload.py): each micro-batch's
gradients summed on the host, the global norm, one update per optimizer step -- the plain path's
parameters and states (autograd's .grad summed on the device, torch's clip_grad_norm_, one step)."""

import math

import pytest
import torch

import lowmem_grpo.optim.offload as offload
from lowmem_grpo.optim.offload import OffloadedOptimizer, staging_bytes

from .test_offload import LaggingCopies, Plain, _head_loss, _make, _model, assert_states_equal_plain, \
    assert_uploaded, split_head

MICRO_BATCHES = 4
CLIP = 0.05  # below every step's global norm here: the clip fires (asserted)


def _optimizer_step(model, opt, step, poison_micro_batch=None):
    """One optimizer step of MICRO_BATCHES backwards through the fused (tied) head, as the trainer runs it;
    returns the global norm. `poison_micro_batch`: that micro-batch's head gradient is NaN."""
    torch.manual_seed(100 + step)  # stochastic rounding draws from the global RNG, per parameter
    opt.begin_step()
    for i in range(MICRO_BATCHES):
        loss = _head_loss(model, 10 * step + i, poison=i == poison_micro_batch) / MICRO_BATCHES
        loss.backward()
        opt.end_backward()
    return opt.end_step()


def _pair(kind, split=True, **kw):
    dtype = torch.bfloat16 if kind == "bf16_sr" else torch.float32
    plain_model, offloaded_model = _model(dtype), _model(dtype)
    plain = Plain(plain_model, _make(kind), CLIP)
    opt = OffloadedOptimizer([{"params": list(offloaded_model.parameters()), "lr": 1e-2}], _make(kind),
                                       CLIP, **kw)
    if split:
        assert split_head(opt, offloaded_model)
    return plain_model, plain, offloaded_model, opt


@pytest.mark.parametrize("chunk_bytes", [None, 256])  # 256: many chunks per tensor, the ring wraps around
@pytest.mark.parametrize("kind", ["adamw", "adamw_8bit", "bf16_sr"])
def test_accumulated_steps_equal_the_plain_path(kind, chunk_bytes, monkeypatch):
    # 4 optimizer steps of 4 micro-batches each, the global clip firing every step, a tied embedding with
    # the head split: parameters and states bit for bit the plain path's. The sum on the host is in the
    # weight dtype with one rounding per add, as autograd's accumulation into .grad; the clip factor is
    # clip_grad_norm_'s; the updates run in the plain optimizer's order (stochastic rounding draws the
    # same numbers). (The fp32 target is 1e-6 relative; bf16_sr one bf16 step: bitwise is stronger.)
    if chunk_bytes:
        monkeypatch.setattr(offload, "STAGING_CHUNK_BYTES", chunk_bytes)
    plain_model, plain, offloaded_model, opt = _pair(kind)
    start = {k: v.detach().clone() for k, v in offloaded_model.named_parameters()}
    for step in range(4):
        norms = [_optimizer_step(m, o, step) for m, o in ((plain_model, plain), (offloaded_model, opt))]
        assert norms[0] > CLIP, "the clip must fire"
        assert norms[1] == pytest.approx(norms[0], rel=1e-6)
        assert opt.max_live_grads == 1 and all(p.grad is None for p in offloaded_model.parameters())
    if chunk_bytes:
        assert opt._staged_total > 4 * len(opt.params)  # tensors went through the ring in several chunks
    for k, x in plain_model.named_parameters():
        y = dict(offloaded_model.named_parameters())[k]
        assert torch.equal(x, y), k
        assert not torch.equal(y, start[k]), f"{k} never moved"
    assert_states_equal_plain(plain, opt)
    assert_uploaded(offloaded_model, opt)


def test_accumulated_gradient_is_the_plain_sum_and_the_one_step_at_the_end():
    # The weights do not move until end_step; the host buffer then holds the sum autograd makes on the
    # device (bf16, bitwise), here read before the update by turning the update off (apply=False).
    plain_model, _, offloaded_model, opt = _pair("bf16_sr")
    before = {k: v.detach().clone() for k, v in offloaded_model.named_parameters()}
    opt.begin_step()
    for i in range(MICRO_BATCHES):
        (_head_loss(plain_model, i) / MICRO_BATCHES).backward()
        (_head_loss(offloaded_model, i) / MICRO_BATCHES).backward()
        opt.end_backward()
        for k, v in offloaded_model.named_parameters():
            assert torch.equal(v, before[k]), f"{k} moved before the last micro-batch"
    norm = opt.end_step(apply=False)
    for p, q in zip(plain_model.parameters(), offloaded_model.parameters()):
        assert torch.equal(p.grad, opt.host_grad[q])
    assert norm == pytest.approx(float(torch.nn.utils.get_total_norm([p.grad for p in plain_model.parameters()])),
                                 rel=1e-6)
    for k, v in offloaded_model.named_parameters():  # apply=False: nothing moved
        assert torch.equal(v, before[k]), k


def test_accumulation_with_lagging_copies_equals_the_plain_path(monkeypatch):
    # The CUDA path's bookkeeping on the CPU: copies (first ones and staged chunks) land only when waited
    # for. Reading a buffer before its copy landed would add into the previous step's gradient.
    monkeypatch.setattr(offload, "STAGING_CHUNK_BYTES", 512)
    copies = LaggingCopies(monkeypatch)
    plain_model, plain, offloaded_model, opt = _pair("adamw", lag_bytes=8 * 1024)
    for step in range(3):
        norms = [_optimizer_step(m, o, step) for m, o in ((plain_model, plain), (offloaded_model, opt))]
        assert norms[1] == pytest.approx(norms[0], rel=1e-6) and norms[0] > CLIP
        assert opt.host_waits > 1 and not copies.in_flight
    for (k, x), (_, y) in zip(plain_model.named_parameters(), offloaded_model.named_parameters()):
        assert torch.equal(x, y), k
    assert_uploaded(offloaded_model, opt)


@pytest.mark.parametrize("split", [True, False])
def test_a_nonfinite_micro_batch_skips_the_whole_step(split):
    # NaN in the head's gradient of micro-batch 2 of 4: the global norm is NaN, every weight and state is
    # left as it was (the plain path skips the step too), and the next step runs normally, both equal.
    plain_model, plain, offloaded_model, opt = _pair("adamw_8bit", split=split)
    for m, o in ((plain_model, plain), (offloaded_model, opt)):
        _optimizer_step(m, o, 0)
    weights = {k: v.detach().clone() for k, v in offloaded_model.named_parameters()}
    states = [{k: v.clone() if torch.is_tensor(v) else v for k, v in opt.inner[p].state[opt.host[p]].items()}
              for p in opt.params]
    for m, o in ((plain_model, plain), (offloaded_model, opt)):
        assert math.isnan(_optimizer_step(m, o, 1, poison_micro_batch=2))
    for k, v in offloaded_model.named_parameters():
        assert torch.equal(v, weights[k]), k
    for p, before in zip(opt.params, states):
        for name, v in opt.inner[p].state[opt.host[p]].items():
            assert torch.equal(v, before[name]) if torch.is_tensor(v) else v == before[name], name
    for m, o in ((plain_model, plain), (offloaded_model, opt)):
        assert math.isfinite(_optimizer_step(m, o, 2))
    for (k, x), (_, y) in zip(plain_model.named_parameters(), offloaded_model.named_parameters()):
        assert torch.equal(x, y), k
    assert_states_equal_plain(plain, opt)


def test_the_staging_ring_is_all_accumulation_costs():
    # Later micro-batches arrive in the ring, whatever the model's size: its bytes are what the planner
    # counts; it is made only once a second micro-batch arrives.
    assert staging_bytes() == offload.STAGING_SLOTS * offload.STAGING_CHUNK_BYTES == 64 << 20
    _, _, model, opt = _pair("adamw")
    opt.begin_step()
    _head_loss(model, 0).backward()
    assert opt._staging is None  # one micro-batch: straight into the gradient buffers
    opt.end_backward()
    _head_loss(model, 1).backward()
    assert opt._staging.numel() == staging_bytes()
    opt.end_step()


def test_the_clip_factor_goes_to_the_host_kernel_not_through_the_gradient(monkeypatch):
    # With host_adamw's kernel the clip costs no pass of its own: the factor is the kernel's grad_scale and
    # the host gradient buffers are read, never rewritten. (Without the kernel the gradient is multiplied in
    # place: test_accumulated_steps_equal_the_plain_path.)
    from lowmem_grpo.optim import host_adamw
    pytest.importorskip("bitsandbytes")
    if host_adamw.library() is None:
        pytest.skip(f"the host kernel did not build here: {host_adamw._load_error}")
    scales, real = [], host_adamw.adamw8bit_step
    monkeypatch.setattr(host_adamw, "adamw8bit_step", lambda *a, **k: scales.append(k["grad_scale"]) or real(*a, **k))
    cls = host_adamw.host_adamw8bit_class(stochastic_rounding=True)
    model = _model(torch.bfloat16)
    opt = OffloadedOptimizer([{"params": list(model.parameters()), "lr": 1e-2}],
                                       lambda groups: cls(groups, lr=1e-2, min_8bit_size=256), CLIP)
    assert split_head(opt, model)
    opt.begin_step()
    for i in range(MICRO_BATCHES):
        (_head_loss(model, i) / MICRO_BATCHES).backward()
        opt.end_backward()
    summed = {p: opt.host_grad[p].clone() for p in opt.params}
    norm = opt.end_step()
    opt.synchronize()
    coef = CLIP / (norm + 1e-6)  # (computed in the bf16 gradients' dtype, as clip_grad_norm_ does: 1% apart)
    assert norm > CLIP and scales and all(s == pytest.approx(coef, rel=1e-2) for s in scales)
    kernel = [p for p in opt.params if opt.inner[p].state[opt.host[p]]["state1"].dtype == torch.uint8]
    assert kernel and all(torch.equal(opt.host_grad[p], summed[p]) for p in kernel)  # (small tensors: fp32 states,
    # bitsandbytes' path, which clips the gradient in place)
    assert all(g["grad_scale"] == 1.0 for inner in opt.inner.values() for g in inner.param_groups)


def test_the_global_norm_sums_in_the_plain_paths_order():
    # The optimizer's groups (decay matrices, then norm gains: optimizers._param_groups) order the parameters
    # otherwise than the model. The plain path's clip_grad_norm_ sums the per-tensor norms in the model's
    # order, and a sum in another order rounds otherwise: the global norm (hence the clip factor) must be
    # summed in `norm_order`, to the last bit, whatever the gradients.
    from lowmem_grpo.optim.optimizers import _param_groups
    for step in range(8):
        plain_model, offloaded_model = _model(), _model()
        groups = [{**g, "lr": 1e-2} for g in _param_groups(offloaded_model, 0.0)]
        assert [id(p) for g in groups for p in g["params"]] != [id(p) for p in offloaded_model.parameters()]
        opt = OffloadedOptimizer(groups, _make("adamw"), CLIP, norm_order=list(offloaded_model.parameters()))
        opt.begin_step()
        for i in range(MICRO_BATCHES):
            (_head_loss(plain_model, 10 * step + i) / MICRO_BATCHES).backward()
            (_head_loss(offloaded_model, 10 * step + i) / MICRO_BATCHES).backward()
            opt.end_backward()
        plain = torch.nn.utils.get_total_norm([p.grad for p in plain_model.parameters()])
        assert opt.end_step(apply=False) == float(plain), step
