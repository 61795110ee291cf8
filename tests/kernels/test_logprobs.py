"""token_logprobs against the spec, forward and backward, on every path."""

import pytest
import torch

from lowmem_grpo.kernels import spec, token_logprobs

from .helpers import assert_as_close_as_low_precision

DTYPES = [torch.float32, torch.bfloat16]


def _case(shape, dtype, device, scale=3.0):
    base = (torch.randn(shape) * scale).to(dtype).to(device).requires_grad_()
    ids = torch.randint(0, shape[-1], shape[:-1], device=device)
    return base, ids


def _check(base, ids, temperature, return_entropy):
    """Run the op on a non-leaf view of `base` (the in-place backward path) and the spec (fp32, base's dtype)."""
    g_logp = torch.randn(ids.shape, device=ids.device)
    g_ent = torch.randn(ids.shape, device=ids.device)
    out = token_logprobs(base * 1, ids, temperature=temperature, return_entropy=return_entropy)
    outs = out if return_entropy else (out,)
    ups = (g_logp, g_ent)[: len(outs)]
    (grad,) = torch.autograd.grad(outs, base, ups)

    results = {}
    for dt in (torch.float32, base.dtype):
        ref_base = base.detach().float().requires_grad_()
        ref = spec.token_logprobs(ref_base, ids, temperature=temperature, return_entropy=return_entropy, dtype=dt)
        ref = ref if return_entropy else (ref,)
        (ref_grad,) = torch.autograd.grad(ref, ref_base, ups)
        results[dt] = (ref, ref_grad)
    (ref32, grad32), (ref_low, grad_low) = results[torch.float32], results[base.dtype]
    for i, name in enumerate(["logp", "entropy"][: len(outs)]):
        assert outs[i].dtype == torch.float32
        assert_as_close_as_low_precision(outs[i], ref32[i], ref_low[i] if base.dtype != torch.float32 else None, name=name)
    assert grad.dtype == base.dtype
    assert_as_close_as_low_precision(grad, grad32, grad_low if base.dtype != torch.float32 else None, name="dlogits")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 5, 123), (7, 1000), (1, 4099)], ids=str)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("return_entropy", [False, True])
def test_matches_spec(device, dtype, shape, temperature, return_entropy):
    base, ids = _case(shape, dtype, device)
    _check(base, ids, temperature, return_entropy)


@pytest.mark.parametrize("vocab", [151936, 49152])
@pytest.mark.parametrize("dtype", DTYPES)
def test_real_vocab_sizes(device, vocab, dtype):
    base, ids = _case((2, 3, vocab), dtype, device, scale=5.0)
    _check(base, ids, 0.7, True)


def test_float16(device):
    base, ids = _case((4, 999), torch.float16, device)
    _check(base, ids, 1.0, True)


def test_backward_writes_dlogits_into_the_logits_buffer(device):
    base, ids = _case((4, 300), torch.float32, device)
    logits = base * 2  # an intermediate, like an lm_head output
    token_logprobs(logits, ids).sum().backward()
    # d(2 * base) = 2 * dlogits, and dlogits now lives in `logits`' own storage
    torch.testing.assert_close(base.grad, 2 * logits.detach())


def test_leaf_logits_are_not_overwritten(device):
    base, ids = _case((4, 300), torch.float32, device)
    before = base.detach().clone()
    token_logprobs(base, ids).sum().backward()
    torch.testing.assert_close(base.detach(), before, rtol=0, atol=0)
    assert not torch.equal(base.grad, before)


def test_another_consumer_of_the_logits_gets_a_clear_error(device):
    base, ids = _case((4, 300), torch.float32, device)
    logits = base * 1
    other = (logits * logits).sum()  # saves `logits` for its own backward, which runs after ours
    loss = token_logprobs(logits, ids).sum() + other
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_non_contiguous_logits(device):
    full = torch.randn(3, 6, 257, device=device)
    logits = full[:, :-1, :]  # the usual shift: a strided view
    ids = torch.randint(0, 257, (3, 5), device=device)
    torch.testing.assert_close(token_logprobs(logits, ids), spec.token_logprobs(logits, ids))


def test_no_grad_and_empty(device):
    with torch.no_grad():
        x = torch.randn(2, 50, device=device)
        assert token_logprobs(x, torch.zeros(2, dtype=torch.long, device=device)).shape == (2,)
    empty = token_logprobs(torch.randn(0, 7, device=device), torch.zeros(0, dtype=torch.long, device=device))
    assert empty.shape == (0,)


def test_bad_input_errors():
    x = torch.randn(2, 3, 10)
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 10\)"):
        token_logprobs(x, torch.full((2, 3), 10))
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 10\).*-100"):
        token_logprobs(x, torch.full((2, 3), -100))
    with pytest.raises(ValueError, match=r"ids must have shape \(2, 3\)"):
        token_logprobs(x, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(TypeError, match="ids must be an integer tensor"):
        token_logprobs(x, torch.zeros(2, 3))
    with pytest.raises(TypeError, match="logits must be float32, bfloat16 or float16"):
        token_logprobs(torch.zeros(2, 3, 10, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature must be > 0"):
        token_logprobs(x, torch.zeros(2, 3, dtype=torch.long), temperature=0.0)


def test_entropy_of_a_peaked_distribution(device):
    # H ~ 1e-6 while lse ~ 20: entropy must not come from the difference of two large numbers
    logits = torch.zeros(3, 151936, device=device)
    logits[:, 7] = 20.0
    ids = torch.full((3,), 7, device=device)
    _, entropy = token_logprobs(logits, ids, return_entropy=True)
    _, expected = spec.token_logprobs(logits.double(), ids, return_entropy=True, dtype=torch.float64)
    torch.testing.assert_close(entropy, expected, rtol=1e-3, atol=1e-9)


def test_minus_inf_logits_are_banned_tokens(device):
    # a vocabulary mask written as -inf logits: finite log-probs, entropy and gradients elsewhere
    base = torch.randn(4, 500, device=device)
    base[:, 100:300] = float("-inf")
    base.requires_grad_()
    ids = torch.randint(0, 100, (4,), device=device)
    logp, entropy = token_logprobs(base * 1, ids, return_entropy=True)
    (grad,) = torch.autograd.grad((logp.sum() + entropy.sum()), base)
    ref_logp, ref_entropy = spec.token_logprobs(base, ids, return_entropy=True)
    keep = torch.isfinite(base.detach())
    torch.testing.assert_close(logp, ref_logp)
    torch.testing.assert_close(entropy, torch.where(torch.isnan(ref_entropy), entropy, ref_entropy))
    assert torch.isfinite(grad).all() and (grad[~keep] == 0).all()


@pytest.mark.parametrize("banned", ["first_block", "all_but_last_block", "first_and_middle"])
def test_minus_inf_whole_blocks(device, banned):
    # The online logsumexp must not form exp(-inf - -inf) = NaN when a whole vocabulary block (the
    # kernel reads 4096 columns at a time) or everything before the last block is -inf.
    V = 9000
    base = torch.randn(3, V, device=device) * 3
    cut = {"first_block": (0, 4096), "all_but_last_block": (0, 8192), "first_and_middle": (0, 6000)}[banned]
    base[:, cut[0]:cut[1]] = float("-inf")
    base.requires_grad_()
    ids = torch.randint(cut[1], V, (3,), device=device)
    logp, entropy = token_logprobs(base * 1, ids, return_entropy=True)
    (grad,) = torch.autograd.grad(logp.sum() + entropy.sum(), base)
    ref_base = base.detach()[:, cut[1]:].double().requires_grad_()  # banned tokens have probability 0
    ref_logp, ref_entropy = spec.token_logprobs(ref_base, ids - cut[1], return_entropy=True,
                                                dtype=torch.float64)
    (ref_grad,) = torch.autograd.grad(ref_logp.sum() + ref_entropy.sum(), ref_base)
    torch.testing.assert_close(logp.double(), ref_logp.double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy.double(), ref_entropy.double(), rtol=1e-5, atol=1e-5)
    assert (grad[:, :cut[1]] == 0).all()
    torch.testing.assert_close(grad[:, cut[1]:].double(), ref_grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("return_entropy", [False, True])
def test_the_cpu_paths_fp32_shortcuts_give_the_copying_paths_bits(monkeypatch, temperature, with_bias, return_entropy):
    """The torch path scales an fp32 chunk in one pass and works on it in place in the backward; forcing the
    copy (as for bf16 or a soft cap) gives the same bits, forward and backward."""
    from lowmem_grpo.kernels import logprobs

    torch.manual_seed(0)
    n, vocab = 37, 1000
    logits = torch.randn(n, vocab) * 4
    bias = torch.randn(vocab) if with_bias else None
    ids = torch.randint(0, vocab, (n,))
    grad, grad_entropy = torch.randn(n), (torch.randn(n) if return_entropy else None)

    def run():
        stats = logprobs.new_stats(n, logits.device)
        for i, v0 in enumerate(range(0, vocab, 300)):  # vocabulary slices, merged as the fused head does
            piece = logits[:, v0:v0 + 300].contiguous()
            logprobs.logits_stats(piece, ids, stats, col_offset=v0, inv_temp=1 / temperature, accumulate=i > 0,
                                  with_entropy=return_entropy, bias=bias)
        lse, logp, entropy = logprobs.finalize_stats(stats)
        dlogits = logits.clone()
        logprobs.logits_grad_(dlogits, ids, lse, grad, entropy if return_entropy else None, grad_entropy,
                              inv_temp=1 / temperature, bias=bias)
        return logp, lse, entropy, dlogits

    fast = run()
    monkeypatch.setattr(logprobs, "_grad_in_place", lambda chunk, softcap: False)
    monkeypatch.setattr(logprobs, "_scaled_copy", lambda chunk, bias, col_offset, softcap, inv_temp: logprobs._capped_(
        chunk.to(torch.float32, copy=True), bias, col_offset, softcap).mul_(inv_temp))
    for a, b in zip(fast, run()):
        assert torch.equal(a, b)
