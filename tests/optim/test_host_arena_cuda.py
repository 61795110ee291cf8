"""Pinned host memory of exact size on a GPU machine (host_arena.py): registered pages that
report is_pinned() (every view's storage starts on the registered range), nothing from torch's caching
host allocator (no power-of-two growth), asynchronous copies that land, and pages unlocked when released,
or at the next known point once collected."""

import gc

import pytest
import torch

from lowmem_grpo.host_arena import HostArena, arena_bytes, buffer_bytes, unlock_pending

pytestmark = pytest.mark.cuda

# sizes just above powers of two, where per-tensor pin_memory costs most: 3 MiB + 10 B -> 4 MiB,
# 6,148,000 B -> 8 MiB, 68 B -> 128 B
SPECS = [((3 * 2**19 + 5,), torch.bfloat16), ((1000, 1537), torch.float32), ((17,), torch.float32)]


def _cached_host_bytes() -> int:
    """Bytes the caching host allocator hands out now: blocks checked out to callers, in their rounded
    sizes (active_bytes: a block reused from its cache counts too, unlike allocated_bytes)."""
    torch.cuda.init()  # host_memory_stats() is {} before CUDA is initialised
    return torch.cuda.host_memory_stats().get("active_bytes.current", 0)


def test_arena_views_are_pinned_and_the_caching_allocator_does_not_grow():
    before = _cached_host_bytes()
    arena = HostArena(SPECS, pinned=True)
    views = [arena.take(*s) for s in SPECS]
    assert arena.pinned and all(v.is_pinned() for v in views)
    assert all(v.pin_memory().data_ptr() == v.data_ptr() for v in views)  # torch sees them pinned: no copy
    assert arena.nbytes == arena_bytes(buffer_bytes(*s) for s in SPECS)
    assert _cached_host_bytes() == before  # registered memory: none of it from the caching host allocator
    # what the same buffers cost one by one: the allocator's power-of-two blocks
    one_by_one = [torch.empty(s, dtype=d, pin_memory=True) for s, d in SPECS]
    grown = _cached_host_bytes() - before
    assert grown == sum(1 << (buffer_bytes(s, d) - 1).bit_length() for s, d in SPECS) > arena.nbytes
    del one_by_one
    arena.release()  # unlocked now, the views still usable as ordinary memory
    assert not arena.pinned and not any(v.is_pinned() for v in views)
    views[0].fill_(1)


def test_non_blocking_copies_to_and_from_arena_views_land():
    arena = HostArena(SPECS, pinned=True)
    views = [arena.take(*s) for s in SPECS]
    side = torch.cuda.Stream()
    g = torch.Generator(device="cuda").manual_seed(0)
    sources = [torch.randn(s, generator=g, device="cuda").to(d) for s, d in SPECS]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # device -> host, asynchronously, as offload.py's gradients go down
        for v, src in zip(views, sources):
            v.copy_(src, non_blocking=True)
        done = torch.cuda.Event()
        done.record(side)
    done.synchronize()
    for v, src in zip(views, sources):
        assert torch.equal(v, src.cpu())
    for v in views:  # host -> device, as the updated weights go up
        v.mul_(2)
    back = [torch.empty(s, dtype=d, device="cuda") for s, d in SPECS]
    with torch.cuda.stream(side):
        for b, v in zip(back, views):
            b.copy_(v, non_blocking=True)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    for b, src in zip(back, sources):
        assert torch.equal(b, src * 2)


def test_the_offloaded_optimizer_pins_its_planned_bytes_and_unpins_them_when_released():
    pytest.importorskip("bitsandbytes")
    from transformers import LlamaConfig, LlamaForCausalLM

    from lowmem_grpo.config import load_config
    from lowmem_grpo.memory.plan import Arch, plan
    from lowmem_grpo.optim.optimizers import build_optimizer
    conf = dict(vocab_size=999, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**conf)).to("cuda", torch.bfloat16)
    cfg = load_config(None, ["model.name_or_path=x", "reward_funcs=[numeric_answer]", "precision=bf16_sr",
                             "optimizer_in_backward=true", "offload_optimizer=true", "beta=0"])
    before = _cached_host_bytes()
    opt = build_optimizer(model, cfg.optim, stochastic_rounding=True, in_backward=True)
    opt.split_tied_head(model)  # the trainer's call
    buffers = list(opt.host.values()) + list(opt.host_grad.values()) + [opt._host_norm_slots, opt.head_host]
    assert all(b.is_pinned() for b in buffers)
    assert _cached_host_bytes() == before
    planned = plan(cfg, Arch.from_config({"model_type": "llama", **conf}))
    assert opt.arena.nbytes + opt.head_arena.nbytes == planned.host_pinned_bytes
    # a step runs on the registered buffers: every weight comes back as its host copy
    ids = torch.randint(0, 999, (2, 9), device="cuda")
    opt.begin_step()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.end_step()
    torch.cuda.synchronize()
    for p in model.parameters():
        assert torch.equal(p.detach().cpu(), opt.host[p])
    # The hooks on the weights keep the optimizer alive after `del` (and so its blocks): released
    # explicitly, every block is unregistered; the buffers stay readable as ordinary memory.
    opt.release_host_memory()
    assert not any(b.is_pinned() for b in buffers)
    assert torch.equal(opt.host[p], p.detach().cpu())
    # An arena that is garbage-collected is unregistered at the next known point (its finalizer makes no
    # CUDA call: it may run inside a graph capture).
    arena = HostArena(SPECS, pinned=True)
    kept = arena.take(*SPECS[0])
    assert kept.is_pinned()
    del arena
    gc.collect()
    assert kept.is_pinned()
    unlock_pending()
    assert not kept.is_pinned()


def test_an_arena_collected_during_a_graph_capture_leaves_the_capture_intact():
    # Only a real capture shows this: a device synchronisation (or cudaHostUnregister) while a stream
    # captures invalidates the capture. An arena whose last reference goes inside the capture only queues
    # its block; the graph replays, and the next known point after it unlocks the block.
    x = torch.zeros(4, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch.cuda.graph asks
        x.add_(1)
    torch.cuda.current_stream().wait_stream(side)
    arena = HostArena(SPECS, pinned=True)
    kept = arena.take(*SPECS[0])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x.add_(1)
        del arena  # its finalizer runs here
        gc.collect()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(x.cpu(), torch.full((4,), 2.0))  # the warm-up and the replay (a capture runs nothing)
    assert kept.is_pinned()  # still locked: queued
    unlock_pending()
    assert not kept.is_pinned()


def test_a_failed_unregister_raises_at_release_and_leaves_no_error_behind():
    # Only the driver shows this: a failed cudaHostUnregister leaves CUDA's last error set, and torch's next
    # kernel-launch check would raise it from an unrelated launch. The block is unlocked behind the arena's
    # back, so its release() fails: it raises there, and the next launch runs clean.
    arena = HostArena(SPECS, pinned=True)
    assert int(torch.cuda.cudart().cudaHostUnregister(arena._base.data_ptr())) == 0
    with pytest.raises(RuntimeError, match="cudaHostUnregister"):
        arena.release()
    y = torch.ones(4, device="cuda") * 2  # launches: their checks read the last error
    torch.cuda.synchronize()
    assert torch.equal(y.cpu(), torch.full((4,), 2.0))
