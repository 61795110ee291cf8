"""DecoderLayers: the decoder's layers run one at a time from recorded inputs give the decoder's own output,
bit for bit, on tiny Qwen3, Llama 3.2 and Gemma 3 models (padded rows, Gemma's per-layer masks and rotary
tables); gradients through `finishing_from` and a per-layer backward equal autograd's through the decoder."""

import pytest
import torch

from lowmem_grpo.policy.batch import Batch
from lowmem_grpo.policy.layer_major import DecoderLayers, decoder_layers, run_layer_major
from lowmem_grpo.policy.logprobs import completion_hidden
from lowmem_grpo.policy.model import build_head

from .test_architectures import CONFIGS, VOCAB, make_model
from .test_packing import make_batch


def _batches(seed: int) -> list[Batch]:
    return [make_batch(VOCAB, seed=seed + k) for k in range(3)]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_layer_major_forward_equals_the_decoders(name):
    model = make_model(name)
    head = build_head(model)
    layers = decoder_layers(head.decoder)
    batches = _batches(0)
    with torch.no_grad():
        expected = [completion_hidden(head, mb) for mb in batches]
        inputs = [layers.record(lambda mb=mb: completion_hidden(head, mb)) for mb in batches]
        kept = []
        final = run_layer_major(layers, inputs, keep=lambda i, m, h: kept.append((i, m)))
        assert kept == [(i, m) for i in range(len(layers)) for m in range(len(batches))]  # layer-major order
        for mb, last, want in zip(batches, final, expected):
            with layers.finishing_from(last):
                got = completion_hidden(head, mb)
            assert torch.equal(got, want)
    assert all(type(m).__name__ != "_StandIn" for m in head.decoder.layers)  # the real layers are back


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_per_layer_backward_equals_autograd(name):
    """Record, run the layers without a graph, finish with one, then a backward per layer from the saved
    inputs: the same parameter gradients as one backward through the decoder."""
    model = make_model(name)
    head = build_head(model)
    mb = _batches(5)[0]
    completion_hidden(head, mb).square().sum().backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)

    layers = decoder_layers(head.decoder)
    inputs = layers.record(lambda: completion_hidden(head, mb))
    saved = []
    (last,) = run_layer_major(layers, [inputs], keep=lambda i, m, h: saved.append(h))
    last = last.requires_grad_()
    with layers.finishing_from(last):
        completion_hidden(head, mb).square().sum().backward()
    grad = last.grad
    for i in reversed(range(len(layers))):
        x = saved[i].detach().requires_grad_()
        torch.autograd.backward(layers.run(i, x, inputs.calls[i]), grad)
        grad = x.grad
    inputs.hidden.backward(grad)
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert sorted(got) == sorted(expected)
    for n in expected:
        assert torch.equal(got[n], expected[n]), (n, (got[n] - expected[n]).abs().max())


def test_a_decoder_that_skips_a_layer_is_refused():
    model = make_model("qwen3")
    head = build_head(model)
    layers = DecoderLayers(head.decoder.layers)
    with pytest.raises(RuntimeError, match="called 0 of its 3 layers"):
        layers.record(lambda: None)
    with pytest.raises(NotImplementedError, match="no .layers list"):
        decoder_layers(torch.nn.Linear(2, 2))
