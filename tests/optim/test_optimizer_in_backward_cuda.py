"""The optimizer step inside backward on a GPU: the same parameters as a normal step.

On CUDA the hooks run while backward kernels are still queued, bitsandbytes' 8-bit kernels run on
the device, and the stochastic-rounding variant draws its noise on the device: what the CPU tests
of test_optimizer_in_backward.py cannot show.
"""

import copy
import math

import pytest
import torch

from lowmem_grpo.optim.optimizer_in_backward import OptimizerInBackward, fp32_norm

from .ulp import assert_within_one_bf16_ulp

pytestmark = pytest.mark.cuda
bnb = pytest.importorskip("bitsandbytes")


def _model(dtype):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    # eager attention: a deterministic backward, so two models given the same inputs get the same
    # gradients bit for bit (the memory-efficient SDPA backward need not)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                      attn_implementation="eager")
    return LlamaForCausalLM(cfg).to("cuda", dtype)


def _loss(model, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 512, (4, 33), generator=g).cuda()
    logits = model(input_ids=ids).logits.float()
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten())


@pytest.mark.parametrize("precision", ["fp32", "bf16_sr"])
def test_cuda_in_backward_equals_a_normal_step(precision):
    from lowmem_grpo.optim.sr_adamw import sr_adamw8bit_class
    dtype = torch.bfloat16 if precision == "bf16_sr" else torch.float32
    cls = sr_adamw8bit_class() if precision == "bf16_sr" else bnb.optim.AdamW8bit
    make = lambda groups: cls(groups, lr=1e-3, min_8bit_size=256)  # noqa: E731
    normal, fused = _model(dtype), _model(dtype)
    opt = make([{"params": list(normal.parameters())}])
    in_bwd = OptimizerInBackward([{"params": list(fused.parameters()), "lr": 1e-3}], make, None)
    # Stochastic rounding draws its noise per parameter, in a different order in the hooks (reverse
    # order of use) than in a normal step, so with bf16_sr only one step is comparable element-wise:
    # the same weights and gradients, so each element lies within one bf16 ulp of the other (the ulp
    # computed per element). Later steps would start from weights that differ by such roundings and
    # drift apart through Adam. lr 1e-3 is under one ulp at a norm gain of 1.0, so a weight left out
    # would pass that bound: the test also checks that every weight moved.
    steps = 3 if precision == "fp32" else 1
    start = {k: v.detach().clone() for k, v in fused.named_parameters()}
    for step in range(steps):
        _loss(normal, step).backward()
        opt.step()
        opt.zero_grad()
        in_bwd.begin_step()
        _loss(fused, step).backward()
        in_bwd.end_step()
        assert all(p.grad is None for p in fused.parameters())
    torch.cuda.synchronize()
    for (k, a), (_, b) in zip(normal.named_parameters(), fused.named_parameters()):
        if precision == "fp32":  # the same bitsandbytes kernel on the same gradients: bit for bit
            assert torch.equal(a, b), k
        else:
            assert_within_one_bf16_ulp(a, b, k)
        assert not torch.equal(b, start[k]), f"{k} never moved"


def test_cuda_hooks_make_no_sync(monkeypatch):
    # No host read of a norm in the hooks (torch's sync debug mode raises on one), no
    # torch.cuda.synchronize() from bitsandbytes' 8-bit step in the whole step (counted), and end_step
    # waits at most once; the parameters are those of a normal step with the same per-tensor clipping.
    # A stack of linear layers: an embedding's backward reads a count on the host by itself.
    torch.manual_seed(0)
    normal = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)).cuda()
    fused = copy.deepcopy(normal)
    make = lambda groups: bnb.optim.AdamW8bit(groups, lr=1e-3, min_8bit_size=256)  # noqa: E731
    opt = make([{"params": list(normal.parameters())}])
    max_norm = 0.05
    in_bwd = OptimizerInBackward([{"params": list(fused.parameters()), "lr": 1e-3}], make, max_norm)
    total = sum(p.numel() for p in normal.parameters())
    syncs = []
    real_synchronize = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: (syncs.append(a), real_synchronize(*a))[1])
    for step in range(3):
        x = torch.randn(64, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
        (normal(x) ** 2).mean().backward()
        for p in normal.parameters():  # the hooks' clipping rule, on the normal step's gradients
            norm, cap = fp32_norm(p.grad), max_norm * math.sqrt(p.numel() / total)
            if norm > cap:
                p.grad.mul_(cap / (norm + 1e-6))
        opt.step()
        opt.zero_grad()
        loss = (fused(x) ** 2).mean()
        in_bwd.begin_step()
        syncs.clear()
        if step == 0:  # the first step creates bitsandbytes' states (its tables copied to the GPU: a sync)
            loss.backward()
        else:
            torch.cuda.set_sync_debug_mode("error")
            try:
                loss.backward()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        in_bwd.end_step()
        if step > 0:
            assert syncs == [] and in_bwd.host_waits <= 1
    real_synchronize()
    for (k, a), (_, b) in zip(normal.named_parameters(), fused.named_parameters()):
        assert torch.equal(a, b), k  # the same clipping arithmetic and kernels on the same gradients
