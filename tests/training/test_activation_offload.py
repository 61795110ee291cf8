"""Activation offload: the same gradients with the layer inputs moved off and back."""

import pytest
import torch

from lowmem_grpo.training import activation_offload
from lowmem_grpo.training.activation_offload import HostBlock, _Offloaded, offload_activations, side_stream
from lowmem_grpo.host_arena import arena_bytes
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


def _micro_batch(model, hooks, seq=32, before_backward=None, seed=0):
    """One micro-batch's forward under `hooks`, then its backward (the gradients add up over calls)."""
    ids = torch.randint(0, 64, (4, seq), generator=torch.Generator().manual_seed(seq + seed)).to(model.device)
    with hooks:
        loss = (model.model(input_ids=ids).last_hidden_state.float() ** 2).mean()
    if before_backward is not None:
        before_backward()
    loss.backward()


def _in_block(hooks, block) -> list[bool]:
    """For each save still packed: whether its host copy is a view of the block."""
    base = block._base.untyped_storage().data_ptr() if block._base is not None else None
    return [r.host.untyped_storage().data_ptr() == base for r in hooks._packed if r is not None]


def test_saves_go_into_one_block_that_the_next_micro_batch_reuses():
    """The first micro-batch sizes the block (its saves go to tensors of their own); from the second on every
    save is a view of the same block of exactly those bytes, and the gradients are bit for bit the plain ones."""
    block = HostBlock(pinned=False)
    plain_model, model = _model("cpu"), _model("cpu")
    seen = []
    for step in range(3):
        _micro_batch(plain_model, torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
        hooks = offload_activations(min_bytes=1, copy_on_cpu=True, block=block)
        _micro_batch(model, hooks, before_backward=lambda: seen.append(_in_block(hooks, block)))
        if step == 0:
            first_high_water = block.high_water
            assert block.arena is None and block.overflows == len(seen[0]) >= 3 and not any(seen[0])
            assert first_high_water >= hooks.offloaded_bytes
        else:
            assert all(seen[-1]) and len(seen[-1]) == len(seen[0]) and block.overflows == len(seen[0])
            assert block.high_water == first_high_water and block.nbytes == arena_bytes([first_high_water])
        if step == 1:
            arena = block.arena
    assert block.arena is arena  # reused, not remade
    for (name, p), q in zip(plain_model.named_parameters(), model.parameters()):
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=name)


def test_a_block_whose_saves_are_still_needed_is_not_written():
    """A micro-batch that starts before the last one's backward has run copies to tensors of its own, and
    the held saves come back unchanged: both gradients are the plain ones."""
    block = HostBlock(pinned=False)
    plain_model, model = _model("cpu"), _model("cpu")
    _micro_batch(model, offload_activations(min_bytes=1, copy_on_cpu=True, block=block))  # sizes the block
    _micro_batch(plain_model, torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
    held = offload_activations(min_bytes=1, copy_on_cpu=True, block=block)
    ids = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(32))
    with held:
        loss = (model.model(input_ids=ids).last_hidden_state.float() ** 2).mean()
    assert all(_in_block(held, block))
    copies = [r.host.clone() for r in held._packed]
    overflows, high_water = block.overflows, block.high_water
    inner = offload_activations(min_bytes=1, copy_on_cpu=True, block=block)
    _micro_batch(model, inner, seed=1)  # other tokens, forward and backward, while `held` waits for its backward
    _micro_batch(plain_model, torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t), seed=1)
    assert all(torch.equal(r.host, c) for r, c in zip(held._packed, copies))
    loss.backward()
    _micro_batch(plain_model, torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
    for (name, p), q in zip(plain_model.named_parameters(), model.parameters()):
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=name)
    assert block.overflows == overflows + len(copies)  # every save of `inner` went elsewhere
    assert block.high_water == high_water  # and did not count as more than one micro-batch's need


def test_the_block_grows_to_the_largest_micro_batch():
    """A longer micro-batch than any before overflows once (the rest of its saves elsewhere), then fits."""
    block = HostBlock(pinned=False)
    model = _model("cpu")
    _micro_batch(model, offload_activations(min_bytes=1, copy_on_cpu=True, block=block), seq=16)
    small = block.high_water
    for seq, fits in ((16, True), (48, False), (48, True), (16, True)):
        hooks = offload_activations(min_bytes=1, copy_on_cpu=True, block=block)
        seen = []
        _micro_batch(model, hooks, seq=seq, before_backward=lambda: seen.append(_in_block(hooks, block)))
        assert all(seen[0]) == fits and (fits or seen[0][0])  # a longer one: its first saves still fit
    assert block.high_water > 2 * small and block.nbytes == arena_bytes([block.high_water])


def test_a_tensor_saved_by_two_ops_moves_once():
    """RMSNorm's fp32 input is saved by pow and by mul: one host copy, one copy back, the same gradients;
    a tensor changed in place between two saves is copied again (each save keeps what it saw)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    norm = LlamaRMSNorm(64)
    x = torch.randn(4, 32, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(3), requires_grad=True)
    plain = torch.autograd.grad(norm(x).float().sum(), [x, norm.weight])
    hooks = offload_activations(min_bytes=1, copy_on_cpu=True)
    with hooks:
        y = norm(x).float().sum()
    # the fp32 input once (4 x 32 x 64 x 4 bytes), the bf16 normalised output, the (4, 32, 1) fp32 rsqrt
    assert hooks.offloaded_bytes == 4 * 32 * 64 * (4 + 2) + 4 * 32 * 4, hooks.offloaded_bytes
    moved = torch.autograd.grad(y, [x, norm.weight])
    assert hooks.prefetched + hooks.fetched_on_demand == 3
    for a, b in zip(moved, plain):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    a = torch.randn(4, 8, 8, requires_grad=True)
    for change in (False, True):
        hooks = offload_activations(min_bytes=1, copy_on_cpu=True)
        with hooks:
            e = (2 * a).detach()  # one tensor that two muls save (for their gradient towards a)
            c = a * e
            if change:
                e.mul_(3)  # in place between the two saves: its version moves
            d = c * e
        assert len(hooks._packed) == (2 if change else 1)
        (grad,) = torch.autograd.grad(d.sum(), [a])
        torch.testing.assert_close(grad, (2 * a.detach()) * (2 * a.detach()) * (3 if change else 1))


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


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run by benchmarks/gpu_session.sh)")
def test_offload_on_cuda_copies_into_one_page_locked_block():
    """From the second micro-batch on, every save's host copy is a view of the device's page-locked block
    (asynchronous copies, no power-of-two rounding), the block exactly the saves' bytes to the page; the
    gradients stay bit for bit the plain ones."""
    plain_model, model = _model("cuda"), _model("cuda")
    block = activation_offload.host_block(torch.device("cuda", torch.cuda.current_device()))
    seen = []
    for _ in range(3):
        _micro_batch(plain_model, torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
        hooks = offload_activations(min_bytes=1)  # the default: the device's block
        _micro_batch(model, hooks, before_backward=lambda: seen.append(
            (_in_block(hooks, block), [r.host.is_pinned() for r in hooks._packed if r is not None])))
    assert hooks.block is block and block.pinned and block.nbytes == arena_bytes([block.high_water])
    for in_block, pinned in seen[1:]:
        assert in_block and all(in_block) and all(pinned)
    for (name, p), q in zip(plain_model.named_parameters(), model.parameters()):
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=name)
