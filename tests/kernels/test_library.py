"""torch.library registration: schemas, fake implementations, autograd, torch.compile, fake tensors."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from lowmem_grpo.kernels import grpo_token_loss, linear_grpo_loss, linear_token_logprobs, spec, token_logprobs


def _op_samples():
    torch.manual_seed(0)
    N, V, H = 6, 50, 8
    logits = torch.randn(N, V, requires_grad=True)
    ids = torch.randint(0, V, (N,))
    f = lambda *shape: torch.randn(*shape)  # noqa: E731
    mask = (torch.rand(N) > 0.3).to(torch.uint8)
    hidden, weight, bias = torch.randn(N, H, requires_grad=True), torch.randn(V, H, requires_grad=True), torch.randn(V)
    ops = torch.ops.lowmem_grpo
    return [
        (ops.token_logprobs.default, (logits, ids, 0.7, True)),
        # variant, eps_low, eps_high, delta, beta, bias_kl, sapo_pos, sapo_neg
        (ops.grpo_token_terms.default, (f(N).requires_grad_(), f(N), mask, f(N), f(N), None, None,
                                        0, 0.2, 0.28, float("inf"), 0.04, False, 1.0, 1.05)),
        (ops.grpo_token_terms.default, (f(N).requires_grad_(), f(N), mask, f(N), f(N), f(N).abs(), f(N).abs(),
                                        3, 0.2, 0.28, 2.0, 0.04, True, 1.0, 1.05)),
        (ops.grpo_token_loss.default, (logits, ids, f(N), mask, f(N), f(N), f(N).abs(), 0.9,
                                       2, 0.2, 0.28, 2.0, 0.04, True, 1.0, 1.05)),
        (ops.grpo_token_loss.default, (logits, ids, f(N), None, None, None, None, 1.0,
                                       0, 0.2, 0.2, float("inf"), 0.0, False, 1.0, 1.05)),
        (ops.linear_token_logprobs.default, (hidden, weight, bias, ids, 0.8, True, 16, 0.0)),
        (ops.linear_token_logprobs.default, (hidden, weight, None, ids, 1.0, False, 64, 2.0)),
        (ops.linear_token_logprobs.default, (hidden, weight, bias, ids, 0.8, True, 16, 0.0, True)),
        (ops.token_logprobs_backward_.default, (logits.detach().clone(), ids, f(N), f(N), f(N), f(N), 0.7)),
        (ops.linear_token_logprobs_backward.default,
         (hidden.detach(), weight.detach(), bias, ids, f(N), f(N), f(N), f(N), 0.8, 16, 2.0, True, True, True)),
        (ops.linear_token_logprobs_backward.default,  # from the forward's kept logits
         (hidden.detach(), weight.detach(), bias, ids, f(N), f(N), None, None, 0.8, 16, 0.0, True, True, True,
          f(N * V))),
    ]


@pytest.mark.parametrize("index", range(11))
def test_opcheck(index):
    op, args = _op_samples()[index]
    torch.library.opcheck(op, args)


def test_torch_compile_matches_eager():
    torch.manual_seed(0)
    hidden = torch.randn(2, 5, 16, requires_grad=True)
    weight = torch.randn(300, 16, requires_grad=True)
    ids = torch.randint(0, 300, (2, 5))

    def head(h, w):
        logp, ent = linear_token_logprobs(h, w, ids, chunk_size=128, return_entropy=True)
        return (logp * 2 + ent).sum()

    compiled = torch.compile(head, backend="aot_eager", fullgraph=True)
    eager_grads = torch.autograd.grad(head(hidden, weight), (hidden, weight))
    compiled_grads = torch.autograd.grad(compiled(hidden, weight), (hidden, weight))
    for a, b in zip(eager_grads, compiled_grads):
        torch.testing.assert_close(a, b)


def test_torch_compile_of_logits_ops():
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 99, requires_grad=True)
    ids = torch.randint(0, 99, (2, 4))
    adv = torch.randn(2)

    def loss_fn(x):
        out = grpo_token_loss(x * 1, ids, adv)
        return out.loss.sum() + token_logprobs(x * 1, ids).sum()

    compiled = torch.compile(loss_fn, backend="aot_eager", fullgraph=True)
    (g_compiled,) = torch.autograd.grad(compiled(logits), logits)
    (g_eager,) = torch.autograd.grad(loss_fn(logits), logits)
    torch.testing.assert_close(g_compiled, g_eager)
    ref = spec.grpo_token_loss(logits, ids, adv)["loss"].sum() + spec.token_logprobs(logits, ids).sum()
    torch.testing.assert_close(g_eager, torch.autograd.grad(ref, logits)[0])


def test_fake_tensors_give_shapes_without_compute():
    with FakeTensorMode():
        hidden = torch.empty(4, 8192, 1536, dtype=torch.bfloat16)
        weight = torch.empty(151936, 1536, dtype=torch.bfloat16)
        ids = torch.zeros(4, 8192, dtype=torch.long)
        logp = linear_token_logprobs(hidden, weight, ids)
        assert logp.shape == (4, 8192) and logp.dtype == torch.float32
        logits = torch.empty(2, 3, 151936, dtype=torch.bfloat16)
        assert token_logprobs(logits, ids[:2, :3]).shape == (2, 3)


def test_linear_grpo_loss_under_compile_with_graph_breaks():
    # the padding compaction (nonzero) is data-dependent: compile must still give the eager result
    torch.manual_seed(0)
    hidden = torch.randn(2, 5, 16, requires_grad=True)
    weight = torch.randn(300, 16, requires_grad=True)
    ids = torch.randint(0, 300, (2, 5))
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    fn = lambda h, w: linear_grpo_loss(h, w, ids, torch.tensor([1.0, -1.0]), mask=mask)[0]  # noqa: E731
    eager = torch.autograd.grad(fn(hidden, weight), (hidden, weight))
    compiled = torch.autograd.grad(torch.compile(fn, backend="aot_eager")(hidden, weight), (hidden, weight))
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b)
