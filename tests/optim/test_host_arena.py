"""One block of host memory carved into views (host_arena.py), and the offloaded optimizer's
start-up check of host RAM (optim/host_ram.py, check_host_ram) with /proc readings faked."""

import math

import pytest
import torch

import lowmem_grpo.host_arena as host_arena
import lowmem_grpo.optim.host_ram as host_ram
from lowmem_grpo.host_arena import ALIGN, PAGE, HostArena, arena_bytes
from lowmem_grpo.optim.offload import OffloadedOptimizer

# deliberately odd shapes: sizes that are not multiples of the alignment, a scalar, an empty tensor
SPECS = [((5, 123, 123), torch.bfloat16), ((7,), torch.float32), ((), torch.int64), ((3, 0), torch.float16),
         ((33, 17), torch.float32), ((1,), torch.uint8), ((64,), torch.float64)]


def test_arena_bytes_by_hand():
    assert arena_bytes([]) == 0
    assert arena_bytes([1]) == PAGE  # the block is whole pages
    assert arena_bytes([PAGE]) == PAGE
    assert arena_bytes([1, 1]) == PAGE  # the second starts at 64, ends at 65
    assert arena_bytes([PAGE - 1, 2]) == 2 * PAGE  # the second starts at 4096 (the next 64-byte boundary)
    assert arena_bytes([PAGE - ALIGN, ALIGN]) == PAGE  # no padding between buffers already aligned


def test_views_have_the_planned_shapes_alignment_and_do_not_overlap():
    arena = HostArena(SPECS)
    views = [arena.take(shape, dtype) for shape, dtype in SPECS]
    sizes = [math.prod(s) * d.itemsize for s, d in SPECS]
    assert arena.nbytes == arena_bytes(sizes) and arena.nbytes % PAGE == 0
    assert sum(sizes) <= arena.nbytes < sum(sizes) + ALIGN * len(sizes) + PAGE
    assert not arena.pinned  # nothing registered unless asked (and on a CPU never)
    base = views[0].data_ptr()  # the first buffer starts the block
    assert base % PAGE == 0  # on a page: the range cudaHostRegister locks is exactly nbytes
    for v, (shape, dtype) in zip(views, SPECS):
        assert v.shape == shape and v.dtype == dtype and v.is_contiguous()
        if v.numel():  # (torch gives an empty tensor data_ptr 0)
            assert v.data_ptr() % ALIGN == 0
            assert v.untyped_storage().data_ptr() == views[0].untyped_storage().data_ptr()  # one allocation
            assert base <= v.data_ptr() and v.data_ptr() + v.numel() * v.element_size() <= base + arena.nbytes
    # Fill each view with its own pattern after all are handed out: an overlap would overwrite a neighbour.
    for i, v in enumerate(views):
        v.copy_(torch.full(v.shape, i + 1, dtype=torch.float64).to(v.dtype))
    for i, v in enumerate(views):
        assert torch.equal(v, torch.full(v.shape, i + 1, dtype=torch.float64).to(v.dtype)), i


def test_take_refuses_buffers_out_of_plan():
    arena = HostArena(SPECS[:2])
    with pytest.raises(RuntimeError, match="planned as"):
        arena.take(*SPECS[1])  # the first planned is SPECS[0]
    arena.take(*SPECS[0])
    arena.take(*SPECS[1])
    with pytest.raises(RuntimeError, match="all handed out"):
        arena.take(*SPECS[0])


def test_pin_registers_the_whole_block_once_and_release_unregisters_it(monkeypatch):
    # The CUDA calls faked (this machine has none): the range given to cudaHostRegister is the block,
    # exactly nbytes from a page boundary, and cudaHostUnregister gets the same pointer on release.
    calls = []
    monkeypatch.setattr(host_arena, "_register", lambda base: calls.append(("register", base.data_ptr(), base.numel())))
    monkeypatch.setattr(host_arena, "_unregister", lambda base: calls.append(("unregister", base.data_ptr())))
    arena = HostArena(SPECS, pinned=True)
    first = arena.take(*SPECS[0])
    assert arena.pinned
    assert calls == [("register", first.data_ptr(), arena.nbytes)] and first.data_ptr() % PAGE == 0
    arena.pin()  # already pinned: nothing more
    arena.release()
    assert not arena.pinned and calls[1:] == [("unregister", first.data_ptr())]
    arena.release()  # once only
    assert len(calls) == 2


def test_every_view_s_storage_is_exactly_the_registered_range(fake_cuda):
    # torch's is_pinned() asks the driver about the start of a view's storage (ATen is_pinned_cuda:
    # storage().data()), not about the view's data_ptr. So every view's storage starts where the range given
    # to cudaHostRegister starts, and holds nothing beyond it: its bytes are the arena's nbytes.
    arena = HostArena(SPECS, pinned=True)
    views = [arena.take(*s) for s in SPECS]
    (what, start, size), = fake_cuda.calls
    assert what == "register" and start % PAGE == 0 and size == arena.nbytes
    for v in views:
        assert v.untyped_storage().data_ptr() == start and v.untyped_storage().nbytes() == arena.nbytes


def test_views_outlive_the_arena_and_survive_a_checkpoint(tmp_path):
    # The views keep the block alive without the arena; a checkpoint of views (of one dtype: torch.save
    # refuses views of one storage as different types, whatever the allocator) loads the same values; an
    # arena of nothing holds no memory and pins nothing.
    import gc
    specs = [((5, 123), torch.float32), ((7,), torch.float32)]
    arena = HostArena(specs)
    views = [arena.take(*s) for s in specs]
    for i, v in enumerate(views):
        v.copy_(torch.arange(v.numel(), dtype=torch.float32).view(v.shape) + i)
    expected = [v.clone() for v in views]
    del arena
    gc.collect()
    torch.save(views, tmp_path / "views.pt")
    for v, w, e in zip(views, torch.load(tmp_path / "views.pt"), expected):
        assert torch.equal(v, e) and torch.equal(w, e)
    empty = HostArena([((3, 0), torch.float16)])
    assert empty.nbytes == 0 and empty.take((3, 0), torch.float16).shape == (3, 0)
    empty.pin()  # nothing to lock: no CUDA call (there is none here)
    assert not empty.pinned


class FakeCuda:
    """Stands in for CUDA on this machine: cudaHostRegister/Unregister return the codes set, and every call
    that matters here is recorded in order (register, unregister, synchronize, a kernel launch)."""

    def __init__(self, monkeypatch):
        self.calls, self.capturing = [], False
        self.register_error = self.unregister_error = 0
        self.stale_error = False  # what cudaGetLastError would return: set by a failed call, read by a launch
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: self.capturing)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: self.calls.append("synchronize"))
        monkeypatch.setattr(torch.cuda, "cudart", lambda: self)
        monkeypatch.setattr(torch.cuda, "_sleep", self._launch, raising=False)

    def cudaHostRegister(self, ptr, size, flags):  # noqa: N802 (CUDA's names)
        self.calls.append(("register", ptr, size))
        self.stale_error = self.stale_error or bool(self.register_error)
        return self.register_error

    def cudaHostUnregister(self, ptr):  # noqa: N802
        self.calls.append(("unregister", ptr))
        self.stale_error = self.stale_error or bool(self.unregister_error)
        return self.unregister_error

    def cudaGetErrorString(self, err):  # noqa: N802
        return f"error {err}"

    def _launch(self, cycles):  # a kernel launch: torch's launch check reads (and resets) the last error
        self.calls.append("launch")
        if self.stale_error:
            self.stale_error = False
            raise RuntimeError("CUDA error: a stale error from an earlier call")


@pytest.fixture
def fake_cuda(monkeypatch):
    """A FakeCuda for the test; blocks it left queued are dropped after it (none was really locked)."""
    yield FakeCuda(monkeypatch)
    host_arena._pending.clear()


def test_a_collected_arena_queues_its_block_for_the_next_known_point(fake_cuda):
    # A finalizer runs wherever the collector does (a CUDA graph capture included), so it makes no CUDA
    # call: a collected arena's block waits in a queue, still locked, until a known point unlocks it.
    cuda = fake_cuda
    import gc
    arena = HostArena(SPECS, pinned=True)
    view = arena.take(*SPECS[0])
    view.fill_(3)
    ptr = view.data_ptr()  # (the first buffer starts the block)
    del arena
    gc.collect()
    assert cuda.calls[1:] == []  # collected: no CUDA call after the registration
    assert torch.all(view == 3)  # the memory itself lives on with its views
    host_arena.unlock_pending()
    assert cuda.calls[1:] == ["synchronize", ("unregister", ptr)]
    host_arena.unlock_pending()  # once only
    assert len(cuda.calls) == 3


def test_nothing_is_synchronised_or_unlocked_while_a_graph_is_captured(fake_cuda):
    # A device synchronisation inside a CUDA graph capture invalidates the capture: while the current
    # stream captures, neither a collected arena nor release() touches CUDA; the next known point outside
    # the capture (here a new arena's pin) waits for the device once and unlocks both blocks.
    cuda = fake_cuda
    import gc
    collected, released = HostArena(SPECS, pinned=True), HostArena(SPECS, pinned=True)
    ptrs = [a._base.data_ptr() for a in (collected, released)]
    cuda.calls.clear()
    cuda.capturing = True
    del collected
    gc.collect()
    released.release()
    assert cuda.calls == [] and not released.pinned
    cuda.capturing = False
    later = HostArena(SPECS, pinned=True)
    assert cuda.calls == ["synchronize", ("unregister", ptrs[0]), ("unregister", ptrs[1]),
                          ("register", later._base.data_ptr(), later.nbytes)]
    later.release()


def test_a_failed_cuda_call_resets_the_error_and_raises_where_it_was_made(fake_cuda):
    # A failed cudaHostUnregister leaves CUDA's last-error state set; torch's next kernel-launch check would
    # raise it from an unrelated launch. It is reset at once and raised at the known point that unlocked
    # the block (release(), or unlock_pending() for a collected arena); a failed cudaHostRegister too.
    cuda = fake_cuda
    cuda.unregister_error = 713  # cudaErrorHostMemoryNotRegistered
    import gc
    arena, collected = HostArena(SPECS, pinned=True), HostArena(SPECS, pinned=True)
    with pytest.raises(RuntimeError, match="cudaHostUnregister .* failed .*cudaError 713"):
        arena.release()
    assert cuda.calls[-2:] == [("unregister", arena._base.data_ptr()), "launch"] and not cuda.stale_error
    del collected
    gc.collect()
    with pytest.raises(RuntimeError, match="cudaError 713"):
        host_arena.unlock_pending()
    assert not cuda.stale_error
    cuda.register_error = 2
    with pytest.raises(MemoryError, match="cudaHostRegister .* failed .*cudaError 2"):
        HostArena(SPECS, pinned=True)
    assert cuda.calls[-1] == "launch" and not cuda.stale_error


# ----- the start-up check ----------------------------------------------------------------------------

def _fake_proc(monkeypatch, tmp_path, available_kib: int, rss_pages: int = 25600):
    (tmp_path / "meminfo").write_text(f"MemTotal:       33554432 kB\nMemFree:         1000000 kB\n"
                                      f"MemAvailable:   {available_kib:>9} kB\n")
    (tmp_path / "statm").write_text(f"900000 {rss_pages} 1000 10 0 50000 0\n")
    monkeypatch.setattr(host_ram, "MEMINFO", str(tmp_path / "meminfo"))
    monkeypatch.setattr(host_ram, "STATM", str(tmp_path / "statm"))


def _tiny():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))


def _build(model, state_bytes):
    make = lambda groups: torch.optim.AdamW(groups, lr=1e-2)  # noqa: E731
    return OffloadedOptimizer([{"params": list(model.parameters()), "lr": 1e-2}], make, 1.0,
                                        state_bytes=state_bytes)


def test_start_up_check_counts_the_pinned_block_and_the_states(monkeypatch, tmp_path):
    model = _tiny()
    params = list(model.parameters())
    # fp32 weights, no master: the block holds each weight copy, each gradient buffer and the norm slots
    sizes = [4 * p.numel() for p in params]
    pinned = arena_bytes(sizes + sizes + [4 * len(params)])
    states = 8 * 2**20  # what the caller says the inner optimizer's states take (whole KiB: meminfo's unit)
    _fake_proc(monkeypatch, tmp_path, (pinned + states) // 1024)  # exactly enough: it goes ahead
    opt = _build(model, states)
    assert opt.arena.nbytes == pinned
    _fake_proc(monkeypatch, tmp_path, (pinned + states) // 1024 - 1, rss_pages=262144)  # 1 KiB short: refused
    with pytest.raises(MemoryError) as e:
        _build(model, states)
    msg = str(e.value)
    assert "\n" not in msg  # one line
    gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
    assert f"needs {gib(pinned)} of pinned host memory" in msg
    assert f"+ {gib(states)} of optimizer states" in msg
    assert f"= {gib(pinned + states)} more host RAM, but {gib(pinned + states - 1024)} is available" in msg
    assert "this process holds 1.00 GiB already" in msg  # 262144 pages of 4 KiB (the faked statm)
    assert "optim.optimizer=adamw_8bit instead of adamw" in msg and "`lowmem-grpo plan`" in msg


def test_build_optimizer_passes_the_states_to_the_check(monkeypatch, tmp_path):
    # The trainer's path: the states (fp32 moments of torch AdamW here) are in the check, so a machine
    # with room for the pinned block but not for the states is refused before anything is allocated.
    pytest.importorskip("bitsandbytes")
    from lowmem_grpo.config import OptimConfig
    from lowmem_grpo.memory.plan import optimizer_state_bytes
    from lowmem_grpo.optim.optimizers import build_optimizer
    model = _tiny()
    sizes = [p.numel() for p in model.parameters()]
    cfg = OptimConfig(optimizer="adamw", offload_optimizer=True)
    pinned = arena_bytes([4 * n for n in sizes] * 2 + [4 * len(sizes)])  # fp32 weights: no separate master
    head = arena_bytes([4 * 64 * 32])  # the tied head's block, checked when the split is made
    states = optimizer_state_bytes(sizes, "adamw", 4)
    assert states == 8 * sum(sizes)
    _fake_proc(monkeypatch, tmp_path, (pinned + states) // 1024 - 1)
    with pytest.raises(MemoryError, match="pinned host memory"):
        build_optimizer(model, cfg, in_backward=True)
    _fake_proc(monkeypatch, tmp_path, (pinned + states + head) // 1024 + 1)
    opt = build_optimizer(model, cfg, in_backward=True)
    opt.split_tied_head(model)  # (the trainer's call: the head's block is checked and made there)
    assert opt.arena.nbytes == pinned and opt.head_arena.nbytes == head


def test_the_offloaded_optimizer_releases_both_blocks(monkeypatch):
    # Its hooks keep it alive after `del`, so the pinned blocks are released explicitly (CUDA faked: the
    # blocks are registered as on a GPU, the rest runs on the CPU).
    calls = []
    monkeypatch.setattr(host_arena, "_register", lambda base: calls.append(("register", base.data_ptr())))
    monkeypatch.setattr(host_arena, "_unregister", lambda base: calls.append(("unregister", base.data_ptr())))
    monkeypatch.setattr(host_arena.HostArena, "__init__", _pinned_init(host_arena.HostArena.__init__))
    model = _tiny()
    opt = _build(model, 0)
    assert opt.split_tied_head(model)
    blocks = [opt.arena, opt.head_arena]
    assert all(b.pinned for b in blocks)
    registered = [ptr for what, ptr in calls if what == "register"]
    assert len(registered) == 2
    opt.release_host_memory()
    assert not any(b.pinned for b in blocks)
    assert sorted(ptr for what, ptr in calls if what == "unregister") == sorted(registered)
    opt.release_host_memory()  # once only
    assert len(calls) == 4


def _pinned_init(init):
    """HostArena.__init__ that pins as on a GPU, whatever it is asked."""
    def pinned_init(self, specs, pinned=False):
        init(self, specs, pinned=True)
    return pinned_init
