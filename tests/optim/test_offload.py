"""Optimizer states in host RAM (optim/offload.py): the same update as the plain path (autograd's
.grad, torch's clip_grad_norm_, one optimizer step), the non-finite guard, the tied-head split, and state
that survives a save/load. Gradient accumulation: test_offload_accumulation.py; on a GPU, against the
device's own optimizer: test_offload_cuda.py."""

import math

import pytest
import torch

from lowmem_grpo.optim.host_ram import host_bytes_per_param, pcie_bytes_per_step
from lowmem_grpo.optim.offload import OffloadedOptimizer


def _model(dtype=torch.float32, device="cpu"):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    # eager attention: its backward is deterministic on CUDA too (two models given the same inputs get the
    # same gradients bit for bit, so paths that share the optimizer's code can be compared bitwise)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                         attn_implementation="eager"))
    return model.to(device, dtype)


def _loss(model, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (3, 7), generator=g).to(model.device)
    logits = model(input_ids=ids).logits.float()
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten())


def _make(kind):
    if kind == "adamw":
        return lambda groups: torch.optim.AdamW(groups, lr=1e-2, foreach=False)
    pytest.importorskip("bitsandbytes")
    if kind == "bf16_sr":
        from lowmem_grpo.optim.sr_adamw import sr_adamw8bit_class
        cls = sr_adamw8bit_class()
        return lambda groups: cls(groups, lr=1e-2, min_8bit_size=256)
    import bitsandbytes as bnb
    return lambda groups: bnb.optim.AdamW8bit(groups, lr=1e-2, min_8bit_size=256)


class Plain:
    """The plain path as the trainer runs it without offload, behind the offloaded optimizer's interface:
    autograd sums .grad over the backwards, then torch's clip_grad_norm_ (the global norm) and, if it is
    finite, one step of one optimizer over every parameter, in their order."""

    def __init__(self, model, make, max_grad_norm, lr=1e-2):
        self.params = list(model.parameters())
        self.opt = make([{"params": self.params, "lr": lr}])
        self.param_groups = self.opt.param_groups
        self.max_grad_norm = max_grad_norm

    def begin_step(self):
        pass

    def end_backward(self):
        pass

    def end_step(self, apply=True):
        norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm or float("inf")))
        if apply and math.isfinite(norm):
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return norm

    def step_zero_gradients(self):
        for p in self.params:
            p.grad = torch.zeros_like(p)
        return self.end_step()

    def state(self, i):
        return self.opt.state[self.params[i]]


def offloaded_state(opt, i):
    """The inner optimizer's state of parameter i of an offloaded optimizer (its host copy's)."""
    p = opt.params[i]
    return opt.inner[p].state[opt.host[p]]


def assert_states_equal_plain(plain, offloaded):
    for i in range(len(plain.params)):
        a, b = plain.state(i), offloaded_state(offloaded, i)
        assert a.keys() == b.keys(), i
        for name in a:
            torch.testing.assert_close(b[name], a[name], rtol=0, atol=0, msg=f"{i} {name}")


def split_head(opt, model):
    """Split the tied head for the loss head that `_head_loss` uses (kept on the model as `loss_head`)."""
    from lowmem_grpo.policy.model import build_head
    model.loss_head = build_head(model)
    return opt.split_tied_head(model, [model.loss_head])


def assert_uploaded(model, opt) -> None:
    """Every device weight is bit for bit its host copy: none missed its last upload."""
    for k, p in model.named_parameters():
        assert torch.equal(p.detach().cpu(), opt.host[p]), f"{k}: the device weight is not its host copy"


def assert_every_weight_moved(model, start: dict) -> None:
    for k, p in model.named_parameters():
        assert not torch.equal(p.detach().cpu(), start[k].cpu()), f"{k} never moved"


@pytest.mark.parametrize("kind", ["adamw", "adamw_8bit", "bf16_sr"])
def test_offloaded_steps_equal_plain_steps(kind):
    # Several steps with the global clip active: the offloaded optimizer (host copies, host states, the
    # global norm on the host) gives bit for bit the parameters and states of the plain path. On this
    # CPU-only machine "device" and host are the same memory, but the offloaded path still copies
    # gradients into its buffers, updates separate host tensors and copies the weights back: the same
    # code as on a GPU.
    dtype = torch.bfloat16 if kind == "bf16_sr" else torch.float32
    plain_model, offloaded = _model(dtype), _model(dtype)
    a = Plain(plain_model, _make(kind), 0.05)
    b = OffloadedOptimizer([{"params": list(offloaded.parameters()), "lr": 1e-2}], _make(kind), 0.05)
    for step in range(4):
        norms = []
        for model, opt in ((plain_model, a), (offloaded, b)):
            torch.manual_seed(10 + step)  # stochastic rounding draws from the global RNG, per parameter
            opt.begin_step()
            _loss(model, step).backward()
            opt.param_groups[0]["lr"] = 1e-2 * (0.5 ** step)  # a scheduler's change must reach the host
            norms.append(opt.end_step())
        assert norms[0] > 0.05 and norms[1] == pytest.approx(norms[0], rel=1e-6)  # clipped, same norm
        assert all(p.grad is None for p in offloaded.parameters())
    assert b.max_live_grads == 1  # device gradients: one at a time, the one being copied off
    for (k, x), (_, y) in zip(plain_model.named_parameters(), offloaded.named_parameters()):
        assert torch.equal(x, y), k
        assert not torch.equal(x, _model(dtype).state_dict()[k]), f"{k} never moved"
    for p in offloaded.parameters():  # the device weight is exactly its host copy
        assert torch.equal(p.detach(), b.host[p])
    assert_states_equal_plain(a, b)


def test_zero_gradient_step_updates_the_device_weights():
    on_device, offloaded = _model(), _model()
    a = Plain(on_device, _make("adamw"), 1.0)
    b = OffloadedOptimizer([{"params": list(offloaded.parameters()), "lr": 1e-2}], _make("adamw"), 1.0)
    for model, opt in ((on_device, a), (offloaded, b)):
        opt.begin_step()
        _loss(model, 0).backward()
        opt.end_step()
        opt.step_zero_gradients()  # Adam moves on its momentum
    for (k, x), (_, y) in zip(on_device.named_parameters(), offloaded.named_parameters()):
        assert torch.equal(x, y), k


def test_a_nonfinite_gradient_is_skipped_and_touches_nothing():
    model = _model()
    opt = OffloadedOptimizer([{"params": list(model.parameters()), "lr": 1e-2}], _make("adamw"), 1.0)
    opt.begin_step()
    _loss(model, 0).backward()
    opt.end_step()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    states = [{k: v.clone() for k, v in s.items()} for s in opt.state_dict()["inner"][0]["state"].values()]
    opt.begin_step()
    (_loss(model, 1) * float("nan")).backward()
    assert math.isnan(opt.end_step())
    assert opt.nonfinite_tensors == len(opt.params)
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights[k]), k
    after = list(opt.state_dict()["inner"][0]["state"].values())
    for s0, s1 in zip(states, after):
        for name in s0:
            assert torch.equal(s0[name], s1[name]), name


def test_state_dict_round_trip_continues_exactly():
    # Save after two steps, load into a fresh model + optimizer (weights first, as the trainer resumes),
    # take two more steps on both: identical.
    model = _model()
    opt = OffloadedOptimizer([{"params": list(model.parameters()), "lr": 1e-2}], _make("adamw_8bit"), 1.0)
    for step in range(2):
        opt.begin_step()
        _loss(model, step).backward()
        opt.end_step()
    saved_weights = {k: v.clone() for k, v in model.state_dict().items()}
    saved_state = opt.state_dict()
    resumed = _model()
    again = OffloadedOptimizer([{"params": list(resumed.parameters()), "lr": 1e-2}],
                                         _make("adamw_8bit"), 1.0)
    resumed.load_state_dict(saved_weights)
    again.load_state_dict(saved_state)
    for p in resumed.parameters():  # host copies follow the loaded weights
        assert torch.equal(p.detach(), again.host[p])
    for step in range(2, 4):
        for m, o in ((model, opt), (resumed, again)):
            o.begin_step()
            _loss(m, step).backward()
            o.end_step()
    for (k, x), (_, y) in zip(model.named_parameters(), resumed.named_parameters()):
        assert torch.equal(x, y), k


def test_host_ram_and_pcie_arithmetic():
    assert host_bytes_per_param(2, "adamw_8bit") == pytest.approx(6.03125)  # bf16 copy + bf16 grad + 8-bit
    assert host_bytes_per_param(4, "adamw") == 16.0  # fp32 copy + fp32 grad + two fp32 moments
    assert pcie_bytes_per_step(1_543_714_304, 2) == 6_174_857_216  # Qwen2.5-1.5B, bf16: grads down, weights up
    assert pcie_bytes_per_step(1_543_714_304, 2, micro_batches=4) == 5 * 3_087_428_608  # each micro-batch's grads


def test_refuses_when_the_host_has_too_little_ram(monkeypatch):
    import lowmem_grpo.optim.host_ram as host_ram
    model = _model()
    monkeypatch.setattr(host_ram, "available_host_ram", lambda: 1024)
    with pytest.raises(MemoryError, match="needs 0.0 GiB of host RAM.*1024|available"):
        OffloadedOptimizer([{"params": list(model.parameters()), "lr": 1e-2}], _make("adamw"), 1.0)


def test_fp32_master_on_the_host_lands_small_updates_in_bf16_weights():
    # bf16 device weights, torch AdamW on fp32 host masters: the masters follow AdamW exactly (reference:
    # the same per-tensor AdamW on fp32 copies, fed the same gradients), the device weights are the masters
    # rounded to nearest, and updates far below a bf16 ulp accumulate instead of being lost.
    lr = 1e-5
    make = lambda groups: torch.optim.AdamW(groups, lr=lr, fused=True)  # noqa: E731
    model, ref_model = _model(torch.bfloat16), _model(torch.bfloat16)
    opt = OffloadedOptimizer([{"params": list(model.parameters()), "lr": lr}], make, None, master_fp32=True)
    ref_master = [p.detach().float().clone() for p in ref_model.parameters()]
    ref_opts = [make([m]) for m in ref_master]
    start = [p.detach().clone() for p in model.parameters()]
    for step in range(6):
        opt.begin_step()
        _loss(model, step).backward()
        opt.end_step()
        _loss(ref_model, step).backward()
        with torch.no_grad():
            for p, m, o in zip(ref_model.parameters(), ref_master, ref_opts):
                m.grad = p.grad.float()
                o.step()
                p.grad = None
                p.copy_(m)
    for (k, p), m, p0 in zip(model.named_parameters(), ref_master, start):
        assert torch.equal(opt.host[p], m), k
        assert torch.equal(p.detach(), m.to(torch.bfloat16)), k
        assert (opt.host[p] != p0.float()).float().mean() > 0.9, k  # the masters moved almost everywhere
    moved_device = sum(int((p.detach() != p0).sum()) for p, p0 in zip(model.parameters(), start))
    moved_master = sum(int((opt.host[p] != p0.float()).sum()) for p, p0 in zip(model.parameters(), start))
    assert moved_device < moved_master  # some updates are still below half a bf16 ulp: kept in the master
    # resume: the master travels in the state dict (the device weights alone would lose it)
    state = opt.state_dict()
    again_model = _model(torch.bfloat16)
    again_model.load_state_dict(model.state_dict())
    again = OffloadedOptimizer([{"params": list(again_model.parameters()), "lr": lr}], make, None,
                                         master_fp32=True)
    again.load_state_dict(state)
    assert all(torch.equal(again.host[q], opt.host[p]) for p, q in zip(model.parameters(), again_model.parameters()))
    with pytest.raises(ValueError, match="no fp32 master weights"):
        again.load_state_dict({k: v for k, v in state.items() if k != "master"})


# --- The tied embedding: the head's gradient contribution on a leaf of its own (offload.py) ---------------

def _head_loss(model, seed, poison=False, rows=3):
    """A loss through the fused head (as the trainer computes it): the tied weight is used twice, by the
    embedding lookup and by the head (via Head.weight: the split's leaf, when there is one)."""
    from lowmem_grpo.kernels import linear_token_logprobs
    from lowmem_grpo.policy.model import build_head, hidden_states
    head = getattr(model, "loss_head", None) or build_head(model)  # split_head's, if split
    ids = torch.randint(0, model.config.vocab_size, (rows, 7), generator=torch.Generator().manual_seed(seed))
    ids = ids.to(model.device)
    hidden = hidden_states(head, ids, torch.ones_like(ids))  # (3, 7, H)
    loss = -linear_token_logprobs(hidden[:, :-1], head.weight, ids[:, 1:]).float().mean()
    if poison:  # a non-finite gradient in the head's contribution only (the lookup's stays finite)
        loss = loss + head.weight[0, 0] * float("nan")
    return loss


def _step(model, opt, seed, **kw):
    torch.manual_seed(100 + seed)  # stochastic rounding draws from the global RNG, per parameter
    opt.begin_step()
    _head_loss(model, seed, **kw).backward()
    return opt.end_step()


@pytest.mark.parametrize("kind", ["adamw", "adamw_8bit", "bf16_sr"])
def test_tied_head_split_steps_equal_the_unsplit_steps(kind):
    # Bit for bit, after several steps with the global clip active: the split (head contribution to the
    # host at once, summed there with the lookup's) against the offloaded optimizer without it and the
    # plain path (both: autograd sums the two contributions on the device).
    dtype = torch.bfloat16 if kind == "bf16_sr" else torch.float32
    models = {name: _model(dtype) for name in ("device", "unsplit", "split")}
    opts = {"device": Plain(models["device"], _make(kind), 0.05)}
    for name in ("unsplit", "split"):
        opts[name] = OffloadedOptimizer([{"params": list(models[name].parameters()), "lr": 1e-2}],
                                                  _make(kind), 0.05)
    split = models["split"]
    assert split_head(opts["split"], split) and opts["split"].tied is split.model.embed_tokens.weight
    from lowmem_grpo.policy.model import build_head
    assert split.loss_head.weight is not split.lm_head.weight  # the head's own leaf ...
    assert split.loss_head.weight.data_ptr() == split.lm_head.weight.data_ptr()  # ... on the same storage
    assert build_head(split).weight is split.lm_head.weight  # only the head given the handle reads it
    assert build_head(models["unsplit"]).weight is models["unsplit"].lm_head.weight
    for step in range(4):
        norms = {name: _step(models[name], opts[name], step) for name in models}
        assert norms["split"] == norms["unsplit"]
        assert norms["split"] == pytest.approx(norms["device"], rel=1e-6) and norms["device"] > 0.05  # clipped
        # both contributions were there: the head's (on the host) and the lookup's
        assert opts["split"].head_host.abs().sum() > 0 and opts["split"].max_live_grads == 1
    for name in ("unsplit", "split"):
        for (k, x), (_, y) in zip(models["device"].named_parameters(), models[name].named_parameters()):
            assert torch.equal(x, y), (name, k)
        assert_states_equal_plain(opts["device"], opts[name])
    assert not torch.equal(split.lm_head.weight, _model(dtype).lm_head.weight)
    assert all(p.grad is None for p in split.parameters())


def test_tied_head_split_drops_nothing():
    # The check above fails if a contribution is lost: dropping the head's makes the weights differ.
    models = [_model(), _model()]
    opts = [OffloadedOptimizer([{"params": list(m.parameters()), "lr": 1e-2}], _make("adamw"), None)
            for m in models]
    split_head(opts[1], models[1])
    opts[1]._head_hook = lambda leaf: setattr(leaf, "grad", None)  # noqa: E731  (the head's contribution, lost)
    opts[1]._head_leaf = None  # the leaf is made again, with the lossy hook
    for step in range(2):
        for m, o in zip(models, opts):
            _step(m, o, step)
    assert not torch.equal(models[0].lm_head.weight, models[1].lm_head.weight)


def test_tied_head_split_skips_a_nonfinite_sum_and_touches_nothing():
    # NaN in the head's contribution only: the sum is non-finite, so the global norm is, and the whole
    # step is skipped (every weight and state left as it was), exactly as without the split.
    models = [_model(), _model()]
    opts = [OffloadedOptimizer([{"params": list(m.parameters()), "lr": 1e-2}], _make("adamw"), 1.0)
            for m in models]
    assert split_head(opts[1], models[1])
    for m, o in zip(models, opts):
        _step(m, o, 0)
    tied_before = models[1].lm_head.weight.detach().clone()
    index = opts[1].params.index(opts[1].tied)
    states_before = {k: v.clone() for k, v in opts[1].state_dict()["inner"][index]["state"][0].items()}
    others_before = {k: v.detach().clone() for k, v in models[1].named_parameters()}
    for m, o in zip(models, opts):
        assert math.isnan(_step(m, o, 1, poison=True))
        assert o.nonfinite_tensors == 1  # the tied weight only
    assert torch.equal(models[1].lm_head.weight, tied_before)
    assert torch.equal(opts[1].host[opts[1].tied], tied_before)
    for name, v in opts[1].state_dict()["inner"][index]["state"][0].items():
        assert torch.equal(v, states_before[name]), name
    moved = [k for k, v in models[1].named_parameters() if not torch.equal(v, others_before[k])]
    assert not moved
    for (k, x), (_, y) in zip(*(m.named_parameters() for m in models)):
        assert torch.equal(x, y), k


def test_tied_head_split_head_only_and_outside_a_step():
    # Hidden states given directly (no lookup): the head's contribution is the whole gradient, applied at
    # end_step. A backward outside a step: the weight's .grad holds both contributions, as without the split.
    from lowmem_grpo.kernels import linear_token_logprobs
    from lowmem_grpo.policy.model import build_head
    models = [_model(), _model()]
    opts = [OffloadedOptimizer([{"params": list(m.parameters()), "lr": 1e-2}], _make("adamw"), None)
            for m in models]
    split_head(opts[1], models[1])
    hidden = torch.randn(5, 32, generator=torch.Generator().manual_seed(0), requires_grad=True)
    ids = torch.randint(0, 64, (5,), generator=torch.Generator().manual_seed(1))
    for m, o in zip(models, opts):
        o.begin_step()
        head = getattr(m, "loss_head", None) or build_head(m)
        (-linear_token_logprobs(hidden, head.weight, ids).mean()).backward()
        o.end_step()
    assert not torch.equal(models[1].lm_head.weight, _model().lm_head.weight)
    for (k, x), (_, y) in zip(*(m.named_parameters() for m in models)):
        assert torch.equal(x, y), k
    for m in models:
        _head_loss(m, 3).backward()  # no begin_step(): e.g. a user's probe
    assert torch.equal(models[0].lm_head.weight.grad, models[1].lm_head.weight.grad)
    assert models[1].loss_head.weight.grad is None


def test_tied_head_split_holds_one_vocabulary_gradient_at_a_time():
    # Measured (the CPU allocator's events, memory.track) on a model whose (V, H) embedding dominates,
    # with SGD inside (its update makes no temporaries: on this CPU the "host" side shares the allocator).
    # Without the split the head's contribution waits in autograd until the lookup and meets the lookup's
    # there: two (V, H) gradients at once. With it, one at a time.
    from transformers import LlamaConfig, LlamaForCausalLM
    from lowmem_grpo.memory import track

    vocab, hidden = 8192, 128
    vh_bytes = vocab * hidden * 4  # 4 MiB
    peaks = {}
    for split in (False, True):
        torch.manual_seed(0)
        m = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                         tie_word_embeddings=True))
        opt = OffloadedOptimizer([{"params": list(m.parameters()), "lr": 1e-2}],
                                           lambda groups: torch.optim.SGD(groups, lr=1e-2), 1.0)
        if split:
            split_head(opt, m)
        with track("cpu") as t:
            _step(m, opt, 1, rows=1)  # 6 tokens: the head's workspace (6 x V fp32) is small beside (V, H)
        peaks[split] = t.peak_bytes
        print(f"split={split}: peak {t.peak_bytes / vh_bytes:.3f} x (V, H) gradient bytes")
        assert opt.max_live_grad_bytes == vh_bytes  # the gradients handed to the optimizer: one at a time
    assert peaks[False] >= 2 * vh_bytes, peaks
    assert peaks[True] < 1.25 * vh_bytes, peaks


def test_tied_head_split_refuses_a_head_gradient_after_the_lookups():
    # The head's contribution must arrive before the lookup's (the head runs last in the forward, so its
    # backward runs first). In a graph where the head ran first, the tied weight is updated before the
    # head's backward: an error, never a silently dropped contribution. (Autograd's own check on the
    # weight, saved by the head and changed in place since, usually speaks first; the split's check is
    # behind it.)
    from lowmem_grpo.kernels import linear_token_logprobs
    from lowmem_grpo.policy.model import hidden_states
    model = _model()
    opt = OffloadedOptimizer([{"params": list(model.parameters()), "lr": 1e-2}], _make("adamw"), None)
    assert split_head(opt, model)
    head = model.loss_head
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(0))
    given = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
    head_first = -linear_token_logprobs(given, head.weight, ids[0, :4]).mean()  # before the lookup: its backward last
    lookup_after = hidden_states(head, ids, torch.ones_like(ids)).float().pow(2).mean()
    opt.begin_step()
    with pytest.raises(RuntimeError, match="arrived after the embedding lookup's|modified by an inplace operation"):
        (head_first + lookup_after).backward()
    assert opt.nonfinite_tensors == 0 and opt._index_of[opt.tied] in opt._fired  # the lookup's update ran first


def test_tied_head_split_follows_a_replaced_weight_storage():
    # The head's leaf shares the weight's storage; when the storage is replaced (`.data =`, as loading
    # weights may do) the next forward gets a new leaf on the new storage, and steps still equal the
    # unsplit optimizer's bit for bit.
    models = [_model(), _model()]
    opts = [OffloadedOptimizer([{"params": list(m.parameters()), "lr": 1e-2}], _make("adamw"), 0.05)
            for m in models]
    assert split_head(opts[1], models[1])
    first_leaf = models[1].loss_head.weight
    for m, o in zip(models, opts):
        _step(m, o, 0)
        m.lm_head.weight.data = m.lm_head.weight.data.clone()  # new storage, same values
        o.refresh_host_weights()
    leaf = models[1].loss_head.weight
    assert leaf is not first_leaf and leaf.data_ptr() == models[1].lm_head.weight.data_ptr()
    for step in range(1, 3):
        for m, o in zip(models, opts):
            _step(m, o, step)
    for (k, x), (_, y) in zip(*(m.named_parameters() for m in models)):
        assert torch.equal(x, y), k
    assert_uploaded(models[1], opts[1])


class LaggingCopies:
    """Stands in for the side stream of a GPU that runs behind the host: a gradient's copy to its host
    buffer lands only when the host waits for its event or a later one (one stream: in order), and
    never by itself. Installed in place of OffloadedOptimizer._to_host, it makes the CPU run
    the CUDA path's bookkeeping (events polled and waited for, updates held back, the head's copy
    waited for through _head_ready): code that read a host buffer before its copy landed would read
    the previous step's gradient."""

    def __init__(self, monkeypatch):
        self.recorded = self.done = self.waits = 0
        self.in_flight = []  # (sequence number, copy to run when it lands)
        monkeypatch.setattr(OffloadedOptimizer, "_copy_to_host",
                            lambda opt, grad, host, kind="gradients", also=(): self.to_host(grad, host, also))

    def to_host(self, grad, host, also=()):
        grad = grad.clone()  # the device copy stays alive until its copy is done (record_stream)
        also = [(source.clone(), target) for source, target in also]  # (a gradient's norm)

        def land():
            host.copy_(grad)
            for source, target in also:
                target.copy_(source)
        self.recorded += 1
        self.in_flight.append((self.recorded, land))
        return _LaggingEvent(self, self.recorded)

    def complete(self, seq):
        while self.in_flight and self.in_flight[0][0] <= seq:
            self.in_flight.pop(0)[1]()
        self.done = max(self.done, seq)


class _LaggingEvent:
    def __init__(self, copies, seq):
        self.copies, self.seq = copies, seq

    def query(self):
        return self.seq <= self.copies.done

    def synchronize(self):
        self.copies.waits += 1
        self.copies.complete(self.seq)


def test_tied_head_split_with_lagging_copies_equals_the_plain_path(monkeypatch):
    # The CUDA path's bookkeeping on the CPU (LaggingCopies): with copies that land late and a small lag,
    # the hooks wait for old copies to bound the gradients in flight, the tied weight's sum waits for both
    # copies, end_step waits for the rest, and the parameters after several clipped steps are bit for bit
    # those of the plain path. The head-only step (no lookup) waits for the head's copy in end_step.
    from lowmem_grpo.kernels import linear_token_logprobs
    from lowmem_grpo.policy.model import build_head
    copies = LaggingCopies(monkeypatch)
    models = [_model(), _model()]
    device = Plain(models[0], _make("adamw"), 0.05)
    split = OffloadedOptimizer([{"params": list(models[1].parameters()), "lr": 1e-2}], _make("adamw"),
                                         0.05, lag_bytes=8 * 1024)
    assert split_head(split, models[1])
    for step in range(4):
        norms = [_step(m, o, step) for m, o in zip(models, (device, split))]
        assert norms[1] == pytest.approx(norms[0], rel=1e-6) and norms[0] > 0.05  # clipped, on the host
        assert split.host_waits > 1 and not copies.in_flight  # held back, waited for, all landed
    hidden = torch.randn(5, 32, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, 64, (5,), generator=torch.Generator().manual_seed(1))
    for m, o in zip(models, (device, split)):  # the head alone: its copy is the whole gradient
        o.begin_step()
        head = getattr(m, "loss_head", None) or build_head(m)
        (-linear_token_logprobs(hidden, head.weight, ids).mean()).backward()
        o.end_step()
    assert not copies.in_flight
    for (k, x), (_, y) in zip(*(m.named_parameters() for m in models)):
        assert torch.equal(x, y), k
    assert_uploaded(models[1], split)
