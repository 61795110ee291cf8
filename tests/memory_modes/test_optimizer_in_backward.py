"""The optimizer step inside backward: same update as a normal step, one gradient alive at a time,
tied embeddings updated once with both contributions, per-tensor clipping to its share."""

import math

import pytest
import torch

from lowmem_grpo.memory_modes.optimizer_in_backward import OptimizerInBackward


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
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=k)  # tied embedding: both contributions, once


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
