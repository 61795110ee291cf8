"""The optimizer step inside backward: same update as a normal step, one gradient alive at a time,
tied embeddings updated once with both contributions, per-tensor clipping to its share."""

import math

import pytest
import torch

from lowmem_grpo.optim.optimizer_in_backward import OptimizerInBackward, fp32_norm


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))


def _loss(model, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (3, 7), generator=g)
    logits = model(input_ids=ids).logits  # the tied embedding is used twice: lookup and lm head
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten())


def _make(kind):
    if kind == "adamw":
        return lambda groups: torch.optim.AdamW(groups, lr=1e-2, foreach=False)
    bnb = pytest.importorskip("bitsandbytes")
    return lambda groups: bnb.optim.AdamW8bit(groups, lr=1e-2, min_8bit_size=256)


@pytest.mark.parametrize("kind", ["adamw", "adamw_8bit"])
def test_same_update_as_a_normal_step_and_one_gradient_at_a_time(kind):
    normal, fused = _model(), _model()
    opt = _make(kind)([{"params": list(normal.parameters())}])
    in_bwd = OptimizerInBackward([{"params": list(fused.parameters()), "lr": 1e-2}], _make(kind), None)
    assert fused.model.embed_tokens.weight is fused.lm_head.weight
    for step in range(3):
        _loss(normal, step).backward()
        norm = math.sqrt(sum(float(p.grad.norm()) ** 2 for p in normal.parameters()))
        opt.step()
        opt.zero_grad()
        in_bwd.begin_step()
        _loss(fused, step).backward()
        assert in_bwd.end_step() == pytest.approx(norm, rel=1e-5)
        assert in_bwd.max_live_grads == 1  # never more than the parameter being updated
        assert all(p.grad is None for p in fused.parameters())
    for (k, a), (_, b) in zip(normal.named_parameters(), fused.named_parameters()):
        assert torch.equal(a, b), k  # bit for bit (the same per-tensor code); tied embedding: both contributions, once


def test_per_tensor_clipping_to_its_share():
    model = _model()
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    before = [p.detach().clone() for p in params]
    _loss(model, 0).backward()
    grads = [p.grad.clone() for p in params]
    model.zero_grad()
    max_norm = 0.05
    in_bwd = OptimizerInBackward([{"params": params, "lr": 1.0}], lambda g: torch.optim.SGD(g, lr=1.0), max_norm)
    in_bwd.begin_step()
    _loss(model, 0).backward()
    in_bwd.end_step()
    clipped = 0
    for p, p0, g in zip(params, before, grads):
        cap = max_norm * math.sqrt(p.numel() / total)
        applied = p0 - p.detach()  # SGD with lr 1: the update is the (clipped) gradient
        if g.norm() > cap:
            clipped += 1
            assert applied.norm().item() == pytest.approx(cap, rel=1e-3)
            cosine = float((applied * g).sum() / (applied.norm() * g.norm()))
            assert cosine > 0.99999  # scaled, not rotated (element-wise checks drown in p0 - p rounding)
        else:
            torch.testing.assert_close(applied, g, rtol=1e-5, atol=1e-7)
    assert clipped > 0


def test_inactive_hooks_leave_gradients_alone():
    model = _model()
    OptimizerInBackward([{"params": list(model.parameters()), "lr": 1e-2}], _make("adamw"), None)
    before = [p.detach().clone() for p in model.parameters()]
    _loss(model, 0).backward()  # no begin_step(): e.g. a user's own backward for a probe
    assert all(p.grad is not None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


# --- Device syncs: updates held while their norms travel to the host (CUDA), then applied in order ---

class LaggingDevice:
    """Stands in for a GPU that runs behind the host and never catches up by itself: a norm's event
    completes only once the host waits for it or for a later one (one stream: events complete in order).
    Installed in place of OptimizerInBackward._norm_to_host, it makes the CPU hold updates back as a
    CUDA backward would in its worst case."""

    def __init__(self, monkeypatch):
        self.recorded = self.done = self.waits = 0
        self.waited = []  # (event waited for, newest event recorded then)
        monkeypatch.setattr(OptimizerInBackward, "_norm_to_host", lambda opt, norm: self._norm_to_host(norm))

    def _norm_to_host(self, norm):
        self.recorded += 1
        return norm, _LaggingEvent(self, self.recorded), None


class _LaggingEvent:
    def __init__(self, device, seq):
        self.device, self.seq = device, seq

    def query(self):
        return self.seq <= self.device.done

    def synchronize(self):
        self.device.waits += 1
        self.device.waited.append((self.seq, self.device.recorded))
        self.device.done = max(self.device.done, self.seq)


def _clip_per_tensor(params, max_norm):
    """The in-backward clipping rule applied to ready gradients: each tensor to its share of max_norm.
    Returns how many were clipped."""
    total, clipped = sum(p.numel() for p in params), 0
    for p in params:
        norm = fp32_norm(p.grad)
        cap = max_norm * math.sqrt(p.numel() / total)
        if norm > cap:
            p.grad.mul_(cap / (norm + 1e-6))
            clipped += 1
    return clipped


@pytest.mark.parametrize("kind", ["adamw", "adamw_8bit"])
def test_held_updates_equal_a_normal_step_with_per_tensor_clipping(monkeypatch, kind):
    # Updates applied in batches, several hooks after their gradients were ready, give bit for bit the
    # parameters of a normal step on per-tensor-clipped gradients, with clipping active on some tensors.
    device = LaggingDevice(monkeypatch)
    normal, fused = _model(), _model()
    opt = _make(kind)([{"params": list(normal.parameters())}])
    lag = 8 * 1024  # bytes: a few of the toy model's gradients
    in_bwd = OptimizerInBackward([{"params": list(fused.parameters()), "lr": 1e-2}], _make(kind), 0.5, lag_bytes=lag)
    for step in range(4):
        _loss(normal, step).backward()
        norm = math.sqrt(sum(fp32_norm(p.grad) ** 2 for p in normal.parameters()))
        assert 0 < _clip_per_tensor(list(normal.parameters()), 0.5) < len(list(normal.parameters()))
        opt.step()
        opt.zero_grad()
        in_bwd.begin_step()
        _loss(fused, step).backward()
        assert in_bwd.end_step() == pytest.approx(norm, rel=1e-6)
        assert in_bwd.max_live_grads > 1  # updates really were held back
        assert in_bwd.max_live_grad_bytes <= lag + max(p.numel() * 4 for p in fused.parameters())
        assert all(p.grad is None for p in fused.parameters())
    assert device.waits > 1 and in_bwd.host_waits > 1
    for (k, a), (_, b) in zip(normal.named_parameters(), fused.named_parameters()):
        assert torch.equal(a, b), k


def test_a_nonfinite_tensor_among_held_updates_is_skipped_alone(monkeypatch):
    LaggingDevice(monkeypatch)
    model = _model()
    params = list(model.parameters())
    _loss(model, 0).backward()
    grads = [p.grad.clone() for p in params]
    model.zero_grad()
    before = [p.detach().clone() for p in params]
    bad = model.model.layers[0].mlp.up_proj.weight  # its hook runs in the middle of the backward
    bad.register_hook(lambda g: torch.where(g.abs() > g.abs().median(), g, torch.full_like(g, math.nan)))
    in_bwd = OptimizerInBackward([{"params": params, "lr": 1.0}], lambda g: torch.optim.SGD(g, lr=1.0), None,
                                 lag_bytes=1 << 30)  # everything held until end_step: one group
    in_bwd.begin_step()
    _loss(model, 0).backward()
    assert all(p.detach().equal(p0) for p, p0 in zip(params, before))  # nothing applied yet
    assert math.isnan(in_bwd.end_step())
    assert in_bwd.nonfinite_tensors == 1 and in_bwd.host_waits == 1
    assert in_bwd.max_live_grads == len(params)
    for p, p0, g in zip(params, before, grads):
        if p is bad:
            assert torch.equal(p.detach(), p0)
        else:  # SGD with lr 1, no clipping: the update is the gradient
            assert torch.equal(p.detach(), p0 - g)


@pytest.mark.parametrize("paged", [False, True], ids=["adamw_8bit", "paged_adamw_8bit"])
def test_host_waits_per_backward_are_bounded_by_the_lag(monkeypatch, paged):
    # Before: a float(norm) read and bitsandbytes' sync_gpu per tensor, two full syncs each. Now, even on
    # a device that never catches up: a first wait once lag_bytes are held, then at most one per half-lag
    # of gradient bytes, plus the one in end_step; each wait inside backward is for an older event than
    # the newest (work stays queued behind it); bitsandbytes syncs only for paged optimizers (2 per
    # tensor, as in its own step()).
    bnb = pytest.importorskip("bitsandbytes")
    from bitsandbytes.optim import optimizer as bnb_optimizer
    device = LaggingDevice(monkeypatch)
    bnb_syncs = []
    monkeypatch.setattr(bnb_optimizer, "sync_gpu", lambda t: bnb_syncs.append(t))
    model = _model()
    params = list(model.parameters())
    cls = bnb.optim.PagedAdamW8bit if paged else bnb.optim.AdamW8bit
    lag = 16 * 1024
    in_bwd = OptimizerInBackward([{"params": params, "lr": 1e-2}], lambda g: cls(g, lr=1e-2, min_8bit_size=256),
                                 None, lag_bytes=lag)
    for step in range(2):
        bnb_syncs.clear()
        waits_before = device.waits
        device.waited.clear()
        in_bwd.begin_step()
        _loss(model, step).backward()
        in_bwd.end_step()
        grad_bytes = sum(p.numel() * 4 for p in params)
        assert max(p.numel() * 4 for p in params) <= lag // 2  # so the newest gradient never has to go
        assert 3 <= in_bwd.host_waits <= 2 + (grad_bytes - lag) // (lag // 2) < len(params)
        assert device.waits - waits_before == in_bwd.host_waits
        assert all(seq < newest for seq, newest in device.waited[:-1])  # the last: end_step's
        assert len(bnb_syncs) == (2 * len(params) if paged else 0)


# --- A step with every gradient zero, without a backward ---

@pytest.mark.parametrize("kind", ["adamw", "adamw_8bit", "bf16_sr"])
def test_zero_gradient_step_equals_the_hooks_on_a_zero_loss(kind):
    # After real steps, step_zero_gradients() gives the parameters and states that a backward of 0 * loss
    # gives through the hooks. bf16_sr: stochastic rounding draws per parameter from the global RNG,
    # so this also checks that the parameters are stepped in the hooks' order.
    if kind == "bf16_sr":
        pytest.importorskip("bitsandbytes")
        from lowmem_grpo.optim.sr_adamw import sr_adamw8bit_class
        cls = sr_adamw8bit_class()
        make = lambda groups: cls(groups, lr=1e-2, min_8bit_size=256)  # noqa: E731
    else:
        make = _make(kind)
    models, opts = [], []
    for _ in range(2):
        model = _model().to(torch.bfloat16) if kind == "bf16_sr" else _model()
        models.append(model)
        opts.append(OptimizerInBackward([{"params": list(model.parameters()), "lr": 1e-2}], make, 1.0))
    for model, opt in zip(models, opts):
        torch.manual_seed(1)
        for step in range(2):
            opt.begin_step()
            _loss(model, step).backward()
            opt.end_step()
        opt.param_groups[0]["lr"] = 3e-3  # as a scheduler would: the zero step must use it
    before = [p.detach().clone() for p in models[0].parameters()]
    (hooked, hooks), (direct, zero_step) = zip(models, opts)
    torch.manual_seed(2)
    hooks.begin_step()
    (0 * _loss(hooked, 5)).backward()
    assert hooks.end_step() == 0.0
    torch.manual_seed(2)
    assert zero_step.step_zero_gradients() == 0.0
    assert zero_step.max_live_grads == 1 and zero_step.nonfinite_tensors == 0
    assert all(p.grad is None for p in direct.parameters())
    moved = [not torch.equal(p, p0) for p, p0 in zip(direct.parameters(), before)]
    assert sum(moved) > len(moved) // 2  # Adam moved on momentum (bf16: a few tiny updates round away)
    for (k, a), (_, b) in zip(hooked.named_parameters(), direct.named_parameters()):
        assert torch.equal(a, b), k
    for sa, sb in zip(hooks.state_dict()["inner"], zero_step.state_dict()["inner"]):
        assert sa["param_groups"] == sb["param_groups"] and sb["param_groups"][0]["lr"] == 3e-3
        _assert_same_state(sa["state"], sb["state"])


def _assert_same_state(a, b, key="state"):
    """Optimizer states equal exactly (bitsandbytes nests its quantisation states one level deeper)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), key
        for k in a:
            _assert_same_state(a[k], b[k], f"{key}.{k}")
    else:
        assert torch.equal(a, b) if torch.is_tensor(a) else a == b, key
