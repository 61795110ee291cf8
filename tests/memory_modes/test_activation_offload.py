"""Activation offload: the same gradients with the layer inputs moved off and back."""

import pytest
import torch

from lowmem_grpo.memory_modes import activation_offload
from lowmem_grpo.memory_modes.activation_offload import _Offloaded, offload_activations, side_stream
from lowmem_grpo.policy.model import enable_checkpointing


def _model(device):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2)).to(device)
    enable_checkpointing(model)
    return model.train()


def _grads(device, offload):
    model = _model(device)
    ids = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(1)).to(device)
    with offload:
        hidden = model.model(input_ids=ids).last_hidden_state  # (4, 32, 64)
        loss = (hidden.float() ** 2).mean()
    loss.backward()
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}  # lm_head unused


def test_offloaded_layer_inputs_give_identical_gradients_cpu():
    hooks = offload_activations(min_bytes=1, copy_on_cpu=True)
    plain = _grads("cpu", torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
    moved = _grads("cpu", hooks)
    assert hooks.offloaded_bytes >= 3 * 4 * 32 * 64 * 4  # at least the three layer inputs went through
    for k in plain:
        torch.testing.assert_close(moved[k], plain[k], rtol=0, atol=0, msg=k)


@pytest.mark.parametrize("prefetch", [True, False])
def test_prefetch_brings_each_tensor_back_before_backward_asks_for_it(prefetch):
    # Backward unpacks in the reverse order of the forward: with prefetch, unpacking one issues the copy
    # back of the one packed before it, so every tensor but the first unpacked is already on its way.
    # The same gradients either way.
    hooks = offload_activations(min_bytes=1, copy_on_cpu=True, prefetch=prefetch)
    plain = _grads("cpu", torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
    moved = _grads("cpu", hooks)
    packed = hooks.prefetched + hooks.fetched_on_demand
    assert packed >= 3 and all(r is None for r in hooks._packed)  # every one came back, none is left behind
    if prefetch:
        assert hooks.fetched_on_demand <= 2 and hooks.prefetched >= packed - 2
    else:
        assert hooks.prefetched == 0
    for k in plain:
        torch.testing.assert_close(moved[k], plain[k], rtol=0, atol=0, msg=k)


def test_a_prefetch_is_one_tensor_ahead():
    # The device holds at most one offloaded tensor more than without prefetch: after each unpack, at most
    # one tensor has been fetched and not yet handed to autograd.
    class Watched(offload_activations):
        def __init__(self):
            self.fetched, self.unpacked, self.most_ahead = set(), set(), 0
            super().__init__(min_bytes=1, copy_on_cpu=True)

        def _fetch(self, record):
            self.fetched.add(id(record))
            super()._fetch(record)

        def _unpack(self, packed):
            out = super()._unpack(packed)
            if isinstance(packed, _Offloaded):
                self.unpacked.add(id(packed))
                self.most_ahead = max(self.most_ahead, len(self.fetched - self.unpacked))
            return out

    hooks = Watched()
    _grads("cpu", hooks)
    assert hooks.prefetched >= 2 and hooks.most_ahead == 1


def test_nothing_moves_on_cpu_by_default():
    hooks = offload_activations(min_bytes=1)
    _grads("cpu", hooks)
    assert hooks.offloaded_bytes == 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run by benchmarks/gpu_session.sh)")
def test_async_offload_on_cuda_gives_identical_gradients():
    hooks = offload_activations(min_bytes=1)
    plain = _grads("cuda", torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
    moved = _grads("cuda", hooks)
    assert hooks.offloaded_bytes > 0 and hooks.prefetched >= 2  # copies back issued ahead, on the side stream
    for k in plain:
        torch.testing.assert_close(moved[k], plain[k], rtol=0, atol=0, msg=k)


def test_the_copy_stream_is_made_once_per_device(monkeypatch):
    # Made on first use and reused: not a new stream (the next one of torch's pool) for every tensor packed.
    made = []
    monkeypatch.setattr(activation_offload, "_side_streams", {})
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: made.append(device) or object())
    first = side_stream(torch.device("cuda", 0))
    assert side_stream(torch.device("cuda", 0)) is first and made == [torch.device("cuda", 0)]
    assert side_stream(torch.device("cuda", 1)) is not first and len(made) == 2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run by benchmarks/gpu_session.sh)")
def test_async_offload_on_cuda_makes_one_stream(monkeypatch):
    # Every layer input of two forwards (two contexts, as the loss makes one per micro-batch) goes through
    # the same side stream, made once.
    made = []

    class CountedStream(torch.cuda.Stream):
        def __new__(cls, *args, **kwargs):
            if "stream_id" not in kwargs:  # a stream taken from the pool (current_stream() wraps an existing one)
                made.append(1)
            return super().__new__(cls, *args, **kwargs)
    monkeypatch.setattr(activation_offload, "_side_streams", {})
    monkeypatch.setattr(torch.cuda, "Stream", CountedStream)
    hooks = [offload_activations(min_bytes=1), offload_activations(min_bytes=1)]
    for h in hooks:
        _grads("cuda", h)
    assert all(h.offloaded_bytes >= 3 * 4 * 32 * 64 * 4 for h in hooks)  # several tensors packed each
    assert len(made) == 1
