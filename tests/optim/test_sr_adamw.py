"""bf16 weights + stochastic rounding: updates at lr 1e-6 land, where a plain bf16 cast loses them."""

import pytest
import torch

from lowmem_grpo.optim import sr_adamw as sr_optim
from lowmem_grpo.optim.sr_adamw import sr_adamw8bit_class, stochastic_round_to_bf16

bnb = pytest.importorskip("bitsandbytes")


def test_stochastic_rounding_is_unbiased_and_exact_on_bf16_values():
    torch.manual_seed(0)
    ulp = 2.0 ** -7  # bf16 spacing in [1, 2)
    x = torch.full((200_000,), 1.0 + 0.25 * ulp)
    r = stochastic_round_to_bf16(x).float()
    assert set(r.unique().tolist()) == {1.0, 1.0 + ulp}
    assert abs(r.mean().item() - x[0].item()) < 0.02 * ulp  # E[round(x)] = x (std of the mean ~0.001 ulp)
    assert x.to(torch.bfloat16).float().unique().tolist() == [1.0]  # round-to-nearest loses it every time
    neg = stochastic_round_to_bf16(-x).float()
    assert abs(neg.mean().item() + x[0].item()) < 0.02 * ulp
    exact = torch.randn(1000).to(torch.bfloat16).float()
    assert torch.equal(stochastic_round_to_bf16(exact).float(), exact)


def _tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg)


def _run(dtype, optimizer_cls, steps=100, lr=1e-6):
    """`steps` AdamW steps on fixed gradients; returns {name: (start, end)} in fp32."""
    model = _tiny_model().to(torch.bfloat16).to(dtype)  # every run starts from the same bf16 values
    start = {k: p.detach().float().clone() for k, p in model.named_parameters()}
    g = torch.Generator().manual_seed(1)
    grads = {k: (0.01 * torch.randn(p.shape, generator=g)).to(torch.bfloat16).to(dtype)
             for k, p in model.named_parameters()}
    opt = optimizer_cls(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    torch.manual_seed(2)
    for _ in range(steps):
        for k, p in model.named_parameters():
            p.grad = grads[k].clone()
        opt.step()
    return {k: (start[k], p.detach().float()) for k, p in model.named_parameters()}, opt


def _mean_abs_delta(result, keep):
    deltas = [(end - start).abs().flatten() for k, (start, end) in result.items() if keep(k)]
    return torch.cat(deltas).mean().item()


def test_bf16_sr_updates_land_like_fp32_and_round_to_nearest_does_not():
    linear = lambda k: k.endswith("proj.weight")  # noqa: E731  (attention and MLP matrices)
    norm = lambda k: "norm" in k  # noqa: E731
    ref, _ = _run(torch.float32, bnb.optim.AdamW8bit)
    sr, _ = _run(torch.bfloat16, sr_adamw8bit_class())
    rtn, _ = _run(torch.bfloat16, bnb.optim.AdamW8bit)
    d_ref, d_sr, d_rtn = (_mean_abs_delta(r, linear) for r in (ref, sr, rtn))
    assert d_ref > 5e-5  # ~100 steps x 1e-6
    assert abs(d_sr - d_ref) / d_ref < 0.10, (d_sr, d_ref)
    assert d_rtn < 0.2 * d_ref, (d_rtn, d_ref)  # the failure this mode exists to fix
    moved = lambda r: sum(int((e != s).sum()) for k, (s, e) in r.items() if norm(k))  # noqa: E731
    assert moved(ref) > 0 and moved(sr) > 0  # norm gains (1.0, half-ulp 0.004) move under SR ...
    assert moved(rtn) == 0  # ... and never under a plain cast
    assert _mean_abs_delta(sr, norm) == pytest.approx(_mean_abs_delta(ref, norm), rel=0.5)


def test_chunked_update_keeps_bitsandbytes_state_format(monkeypatch):
    # States do not depend on the weights when weight decay is 0, so a chunked bf16 run must produce
    # exactly the 8-bit states of bitsandbytes' own fp32 run; small chunks exercise the absmax slicing.
    monkeypatch.setattr(sr_optim, "CHUNK", 3 * sr_optim.BLOCK)
    _, opt_sr = _run(torch.bfloat16, sr_adamw8bit_class(), steps=5)
    _, opt_ref = _run(torch.float32, bnb.optim.AdamW8bit, steps=5)
    states_sr = list(opt_sr.state.values())
    states_ref = list(opt_ref.state.values())
    assert any(s["state1"].dtype == torch.uint8 for s in states_sr)
    for a, b in zip(states_sr, states_ref):
        for key in ("state1", "state2", "absmax1", "absmax2"):
            if key in b:
                torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)


def test_paged_state_slices_keep_their_paged_marks(monkeypatch):
    # On CUDA, PagedAdamW8bit's states are managed memory wrapped as CPU tensors marked `is_paged`;
    # bitsandbytes rejects an unmarked slice as a CPU tensor next to CUDA ones. The CPU has no paged
    # memory, so mark the states by hand and check what reaches bitsandbytes' update kernel.
    monkeypatch.setattr(sr_optim, "CHUNK", 2 * sr_optim.BLOCK)
    F = bnb.functional
    seen = []
    real_update = F.optimizer_update_8bit_blockwise

    def spy(name, g, p, state1, state2, *args, **kwargs):
        seen.append((getattr(state1, "is_paged", False), getattr(state2, "page_deviceid", None)))
        return real_update(name, g, p, state1, state2, *args, **kwargs)

    monkeypatch.setattr(F, "optimizer_update_8bit_blockwise", spy)
    p = torch.nn.Parameter(torch.randn(4 * sr_optim.BLOCK + 7).to(torch.bfloat16))
    opt = sr_adamw8bit_class(paged=True)([p], lr=1e-3, min_8bit_size=1)
    p.grad = torch.randn_like(p)
    opt.step()  # creates the states (plain CPU tensors here) ...
    for key in ("state1", "state2"):
        opt.state[p][key].is_paged, opt.state[p][key].page_deviceid = True, 0  # ... marked as on CUDA
    monkeypatch.setattr(opt, "prefetch_state", lambda p: None)  # no managed memory to prefetch on a CPU
    seen.clear()
    opt.step()
    assert seen == [(True, 0)] * 3  # three chunks, each state slice still marked


@pytest.mark.cuda
@pytest.mark.parametrize("paged", [False, True], ids=["adamw_8bit", "paged_adamw_8bit"])
def test_cuda_chunked_sr_update_matches_bitsandbytes_own_step(monkeypatch, paged):
    # The chunked fp32 update on CUDA (paged states included) computes bitsandbytes' own 8-bit step:
    # on fp32 copies of the same bf16 weights, bitsandbytes' step gives the same states and, before
    # rounding, the same weights; stochastic rounding then lands within one bf16 ulp of them.
    monkeypatch.setattr(sr_optim, "CHUNK", 3 * sr_optim.BLOCK)
    torch.manual_seed(0)
    base = torch.randn(5, 4 * sr_optim.BLOCK + 3, device="cuda").to(torch.bfloat16)
    grads = [torch.randn_like(base, dtype=torch.float32) * 0.01 for _ in range(3)]
    ours = torch.nn.Parameter(base.clone())
    theirs = torch.nn.Parameter(base.float())
    cls = bnb.optim.PagedAdamW8bit if paged else bnb.optim.AdamW8bit
    opt_ours = sr_adamw8bit_class(paged)([ours], lr=1e-3, min_8bit_size=1)
    opt_theirs = cls([theirs], lr=1e-3, min_8bit_size=1)
    for g in grads:
        ours.grad, theirs.grad = g.to(torch.bfloat16), g.to(torch.bfloat16).float()
        theirs.data.copy_(ours.data.float())  # same starting point each step: compare one update
        opt_ours.step()
        opt_theirs.step()
        torch.cuda.synchronize()
        ulp = torch.finfo(torch.bfloat16).eps * theirs.detach().abs().clamp(min=1e-30)
        assert ((ours.detach().float() - theirs.detach()).abs() <= ulp).all()
    for key in ("state1", "state2", "absmax1", "absmax2"):
        torch.testing.assert_close(opt_ours.state[ours][key].cuda(), opt_theirs.state[theirs][key].cuda(),
                                   rtol=0, atol=0)
