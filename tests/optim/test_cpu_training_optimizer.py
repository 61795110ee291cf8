"""A model trained on the CPU (not offloaded) steps its 8-bit optimizer in host_adamw.py's fused kernel:
`build_optimizer` picks the host class there, the kernel runs, and several steps equal bitsandbytes' own
CPU step (states bitwise, weights bitwise with a correctly rounded sqrt); elsewhere bitsandbytes' classes.
`adamw` steps there in torch's fused CPU AdamW, landing where torch's default step does."""

import pytest
import torch
from torch import nn

from lowmem_grpo.config import OptimConfig
from lowmem_grpo.optim import host_adamw
from lowmem_grpo.optim.optimizers import build_optimizer

bnb = pytest.importorskip("bitsandbytes")


def _model(device="cpu") -> nn.Module:
    torch.manual_seed(0)  # 8-bit states for both matrices (>= 4096 elements), fp32 ones for the biases
    return nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 80)).to(device)



def _groups(model: nn.Module) -> list[dict]:
    """The groups _param_groups makes for _model: decay on the matrices only."""
    return [{"params": [m.weight for m in model[::2]], "weight_decay": 0.01},
            {"params": [m.bias for m in model[::2]], "weight_decay": 0.0}]


def _same_gradients(ours: nn.Module, theirs: nn.Module, generator: torch.Generator) -> None:
    for a, b in zip(ours.parameters(), theirs.parameters()):
        a.grad = 0.01 * torch.randn(a.shape, generator=generator)
        b.grad = a.grad.clone()

@pytest.fixture
def correctly_rounded_sqrt(monkeypatch):
    """torch's CPU sqrt (MKL's) may be an ulp off, the kernel's is correctly rounded (docs/memory-modes.md,
    "Numerics"): with this, bitsandbytes' step computes the kernel's arithmetic exactly."""
    torch_sqrt = torch.Tensor.sqrt
    monkeypatch.setattr(torch.Tensor, "sqrt", lambda self: torch_sqrt(self.double()).to(self.dtype))


@pytest.mark.parametrize("optimizer", ["adamw_8bit", "paged_adamw_8bit"])
def test_cpu_training_steps_in_the_kernel_as_bitsandbytes_steps(kernel, torch_fuses, correctly_rounded_sqrt,
                                                                 monkeypatch, optimizer):
    cfg = OptimConfig(optimizer=optimizer, learning_rate=1e-3, weight_decay=0.01)
    ours_model, theirs_model = _model(), _model()
    ours = build_optimizer(ours_model, cfg)
    assert getattr(ours, "takes_grad_scale", False), type(ours).__mro__  # host_adamw8bit_class's
    calls = []
    real = host_adamw.adamw8bit_step
    monkeypatch.setattr(host_adamw, "adamw8bit_step", lambda *a, **k: calls.append(1) or real(*a, **k))
    # bitsandbytes' own class on the same groups
    base = bnb.optim.PagedAdamW8bit if optimizer == "paged_adamw_8bit" else bnb.optim.AdamW8bit
    theirs = base(_groups(theirs_model), lr=1e-3, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon)
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        _same_gradients(ours_model, theirs_model, g)
        ours.step()
        theirs.step()
        assert len(calls) == 2 * (step + 1)  # the two matrices, each step (the biases: fp32 states, bnb's path)
        for a, b in zip(ours_model.parameters(), theirs_model.parameters()):
            assert torch.equal(a, b), (step, a.shape)
            for key in ("state1", "state2", "absmax1", "absmax2"):
                if key in ours.state[a]:
                    assert torch.equal(ours.state[a][key], theirs.state[b][key]), (step, key)


def test_models_off_the_cpu_keep_bitsandbytes_classes():
    model = _model("meta")  # a device that is not the CPU (no GPU needed to build the optimizer)
    opt = build_optimizer(model, OptimConfig(optimizer="adamw_8bit"))
    assert type(opt) is bnb.optim.AdamW8bit
    assert type(build_optimizer(_model(), OptimConfig(optimizer="adamw"))) is torch.optim.AdamW


def test_cpu_training_steps_adamw_fused_where_the_plain_step_lands():
    cfg = OptimConfig(optimizer="adamw", learning_rate=1e-3, weight_decay=0.01)
    ours_model, plain_model = _model(), _model()
    ours = build_optimizer(ours_model, cfg)
    assert all(group["fused"] for group in ours.param_groups)
    plain = torch.optim.AdamW(_groups(plain_model), lr=1e-3, betas=(cfg.adam_beta1, cfg.adam_beta2),
                              eps=cfg.adam_epsilon)
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        _same_gradients(ours_model, plain_model, g)
        ours.step()
        plain.step()
        for a, b in zip(ours_model.parameters(), plain_model.parameters()):  # moved ~4e-3 each, rounding apart
            torch.testing.assert_close(a, b, rtol=0, atol=1e-7, msg=f"step {step}, {tuple(a.shape)}")
    assert not any(group["fused"] for group in build_optimizer(_model("meta"), cfg).param_groups)
