"""The offloaded optimizer's host update on its worker thread (optim/update_thread.py; docs/memory-modes.md,
"The update thread"): the same parameters, states and RNG stream as the inline update, a forward right after
end_step that waits for exactly the weights it reads, and a worker's error raised on the caller's thread."""

import time

import pytest
import torch

from lowmem_grpo.config import OptimConfig
from lowmem_grpo.optim.offload import OffloadedOptimizer
from lowmem_grpo.optim.optimizers import build_optimizer
from lowmem_grpo.policy.model import build_head

from .test_offload import _head_loss, _make, _model

MICRO_BATCHES = 3
CLIP = 0.05  # below every step's global norm here: the clip fires (asserted)


def _untied_model(dtype=torch.float32, device="cpu"):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                         attn_implementation="eager"))
    return model.to(device, dtype)


def _optimizer(kind: str, model, update_thread: bool) -> OffloadedOptimizer:
    """`kind`: adamw / adamw_8bit built directly on fp32 weights, or build_* through the real build path
    (optimizers.build_optimizer with offload_optimizer) on bf16 weights: 8-bit AdamW with stochastic
    rounding (host_adamw.py's kernel), torch AdamW on fp32 masters."""
    if kind.startswith("build_"):
        cfg = OptimConfig(optimizer=kind[len("build_"):], offload_optimizer=True, learning_rate=1e-2,
                          max_grad_norm=CLIP)
        opt = build_optimizer(model, cfg, stochastic_rounding=True)
        opt.update_thread = update_thread
        return opt
    return OffloadedOptimizer([{"params": list(model.parameters()), "lr": 1e-2}], _make(kind), CLIP,
                                        update_thread=update_thread)


def _setup(kind, tied, update_thread, device="cpu"):
    dtype = torch.bfloat16 if kind.startswith("build_") else torch.float32
    model = _model(dtype, device) if tied else _untied_model(dtype, device)
    opt = _optimizer(kind, model, update_thread)
    model.loss_head = build_head(model)  # what _head_loss uses; the trainer's head
    opt.wait_in_forward(model, [model.loss_head])
    assert opt.split_tied_head(model, [model.loss_head]) == tied
    return model, opt


def _optimizer_step(model, opt, step, forward=True) -> float:
    """One optimizer step of MICRO_BATCHES backwards through the fused head; right after end_step, as the
    trainer does, the scheduler changes the learning rate, then (`forward`) a forward runs."""
    opt.begin_step()
    for i in range(MICRO_BATCHES):
        (_head_loss(model, 10 * step + i) / MICRO_BATCHES).backward()
        opt.end_backward()
    norm = opt.end_step()
    for group in opt.param_groups:
        group["lr"] *= 0.7  # must not reach the step just handed over
    if forward:
        with torch.no_grad():
            _head_loss(model, 1000 + step)  # (e.g. generation's): it waits for every weight it reads
    return norm


def _run(kind, tied, update_thread, steps=3):
    model, opt = _setup(kind, tied, update_thread)
    opt.start = {k: v.detach().clone() for k, v in model.named_parameters()}
    torch.manual_seed(1234)
    norms, samples = [], []
    for step in range(steps):
        norms.append(_optimizer_step(model, opt, step))
        samples.append(torch.rand(8))  # the caller's own draws after the forward (e.g. sampling)
    return model, opt, norms, samples


def _assert_same_run(a, b):
    (model_a, opt_a, norms_a, samples_a), (model_b, opt_b, norms_b, samples_b) = a, b
    assert norms_a == norms_b and min(norms_a) > CLIP, "the clip must fire"
    state_a, state_b = opt_a.state_dict(), opt_b.state_dict()  # (the async one synchronizes itself)
    for sa, sb in zip(state_a["inner"], state_b["inner"]):
        assert sa["param_groups"] == sb["param_groups"]
        for key in sa["state"]:
            for name, value in sa["state"][key].items():
                torch.testing.assert_close(sb["state"][key][name], value, rtol=0, atol=0, msg=name)
    for ma, mb in zip(state_a.get("master", []), state_b.get("master", [])):
        assert torch.equal(ma, mb)
    for (k, x), (_, y) in zip(model_a.named_parameters(), model_b.named_parameters()):
        assert torch.equal(x, y), k
        assert not torch.equal(x, opt_a.start[k]), f"{k} never moved"
    for x, y in zip(samples_a, samples_b):  # the global RNG stream: the same draws either way
        assert torch.equal(x, y)


@pytest.mark.parametrize("kind, tied", [("adamw", True), ("adamw_8bit", True), ("adamw_8bit", False),
                                        ("build_adamw_8bit", True), ("build_adamw_8bit", False),
                                        ("build_adamw", True)])
def test_worker_thread_steps_equal_the_inline_steps(kind, tied):
    # Bit for bit, after 3 optimizer steps of 3 micro-batches with the global clip firing: the update on the
    # worker thread against the inline one -- parameters, states (through state_dict(), which waits for
    # the worker itself), fp32 masters, and the caller's draws from the global RNG made while the worker
    # ran (the stochastic rounding draws from a copy of it, not from it).
    if kind != "adamw":
        pytest.importorskip("bitsandbytes")
    inline = _run(kind, tied, update_thread=False)
    rng_inline = torch.get_rng_state()
    threaded = _run(kind, tied, update_thread=True)
    threaded[1].synchronize()
    assert torch.equal(torch.get_rng_state(), rng_inline)  # the global generator ends where the inline one did
    assert threaded[1]._worker is not None and inline[1]._worker is None  # the worker did run the updates
    _assert_same_run(inline, threaded)


def _slow_late_updates(monkeypatch, opt, slow: set, log: list, seconds=0.3):
    """The worker sleeps before each update of the parameters in `slow`; `log` gets ("updated", index)."""
    update = opt._update

    def slowed(index, *args):
        if index in slow:
            time.sleep(seconds)
        update(index, *args)
        log.append(("updated", index))
    monkeypatch.setattr(opt, "_update", slowed)


@pytest.mark.parametrize("tied", [True, False])
def test_a_forward_right_after_end_step_waits_for_the_updates(tied, monkeypatch):
    # The last parameters' updates are slowed down on the worker (tied: the embedding, which the fused
    # head also reads through its own leaf; untied: the final norm and the output embedding, read by the
    # head through Head.weight, not a module forward). A forward right after end_step must give the output
    # of a forward after synchronize(), while end_step returned before those updates were done.
    model, opt = _setup("adamw", tied, update_thread=True)
    late = {0} if tied else {len(opt.params) - 2, len(opt.params) - 1}
    log: list = []
    _slow_late_updates(monkeypatch, opt, late, log)
    _optimizer_step(model, opt, 0, forward=False)
    log.append(("end_step returned", None))
    with torch.no_grad():
        right_after = _head_loss(model, 99)
    opt.synchronize()
    with torch.no_grad():
        after_synchronize = _head_loss(model, 99)
    assert torch.equal(right_after, after_synchronize)
    returned = log.index(("end_step returned", None))
    assert all(log.index(("updated", i)) > returned for i in late), log  # handed over, not done in end_step
    assert len(log) == len(opt.params) + 1


@pytest.mark.parametrize("where", ["forward", "synchronize", "begin_step"])
def test_an_error_on_the_worker_is_raised_at_the_next_wait(where, monkeypatch):
    # An update that fails on the worker: end_step has returned; the error comes out, with its message, at
    # the next wait on the caller's thread, once; the worker takes the next step as usual.
    model, opt = _setup("adamw", True, update_thread=True)
    update = opt._update

    def failing(index, *args):
        if index == 3:
            raise ValueError("host update of parameter 3 failed")
        update(index, *args)
    monkeypatch.setattr(opt, "_update", failing)
    _optimizer_step(model, opt, 0, forward=False)  # returns: the update runs on the worker
    with pytest.raises(ValueError, match="host update of parameter 3 failed"):
        if where == "forward":
            with torch.no_grad():
                _head_loss(model, 99)
        elif where == "synchronize":
            opt.synchronize()
        else:
            opt.begin_step()
    opt.synchronize()  # raised once, not again
    monkeypatch.setattr(opt, "_update", update)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    _optimizer_step(model, opt, 1)
    opt.synchronize()
    assert opt._worker.is_alive()
    for k, p in model.named_parameters():
        assert not torch.equal(p, before[k]), f"{k}: the worker did not take the next step"


def test_state_dict_after_a_threaded_step_is_the_inline_one():
    # state_dict() right after end_step (no synchronize first) has the step's states: it waits itself.
    runs = [_run("adamw", True, update_thread=flag, steps=1) for flag in (False, True)]
    a, b = (opt.state_dict() for _, opt, _, _ in runs)
    for sa, sb in zip(a["inner"], b["inner"]):
        for key in sa["state"]:
            for name, value in sa["state"][key].items():
                torch.testing.assert_close(sb["state"][key][name], value, rtol=0, atol=0, msg=name)
    assert all(s["state"] for s in b["inner"])  # every parameter was stepped


def test_without_forward_waits_the_update_stays_inline():
    # Until wait_in_forward is called nothing waits for the worker, so end_step updates inline.
    model = _model()
    opt = OffloadedOptimizer([{"params": list(model.parameters()), "lr": 1e-2}], _make("adamw"), CLIP)
    assert opt.update_thread
    opt.begin_step()
    _head_loss(model, 0).backward()
    opt.end_step()
    assert opt._worker is None
    for p in model.parameters():
        assert torch.equal(p.detach(), opt.host[p])


def test_a_draw_before_the_updates_are_waited_for_is_not_repeated(caplog):
    # The caller draws from the global generator right after end_step, while the worker may still be
    # rounding from its copy: the global generator is not moved back over those draws later (their numbers
    # would come again), and a warning says how to keep the run the inline one's.
    model, opt = _setup("adamw", True, update_thread=True)
    torch.manual_seed(5)
    opt.begin_step()
    _head_loss(model, 0).backward()
    opt.end_step()
    early = torch.rand(8)
    opt.synchronize()
    assert not torch.equal(torch.rand(8), early)
    assert "call optimizer.synchronize() before such draws" in caplog.text


def test_rounding_draws_do_not_race_the_callers_draws(monkeypatch, caplog):
    # bf16 weights with stochastic rounding (the build path): the caller draws from the global generator
    # while the worker is still rounding (slowed down half-way). The weights are the inline run's all the
    # same: the rounding draws come from the step's own generator, whatever the caller draws meanwhile.
    pytest.importorskip("bitsandbytes")
    weights = {}
    for update_thread in (False, True):
        model, opt = _setup("build_adamw_8bit", False, update_thread)
        if update_thread:
            _slow_late_updates(monkeypatch, opt, {len(opt.params) // 2}, [], seconds=0.2)
        torch.manual_seed(7)
        _optimizer_step(model, opt, 0, forward=False)
        torch.rand(1000)  # while the worker runs (threaded), after the update (inline)
        opt.synchronize()
        weights[update_thread] = {k: v.detach().clone() for k, v in model.named_parameters()}
    for k, w in weights[False].items():
        assert torch.equal(w, weights[True][k]), k


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind, tied", [("adamw", True), ("build_adamw_8bit", False), ("build_adamw", True)])
def test_cuda_worker_thread_equals_inline_and_the_forward_waits_for_the_uploads(kind, tied, monkeypatch):
    # On a GPU the uploads go up on the side stream from the worker thread; the forward's compute stream
    # waits for each parameter's upload event. Bit for bit the inline run (the same host kernels), with
    # a forward right after each end_step whose loss must equal the inline run's (it saw every new weight
    # although the late updates were slowed down), and every device weight its host copy at the end.
    if kind != "adamw":
        pytest.importorskip("bitsandbytes")
    runs = {}
    for update_thread in (False, True):
        model, opt = _setup(kind, tied, update_thread, device="cuda")
        if update_thread:
            _slow_late_updates(monkeypatch, opt, {0, len(opt.params) - 1}, [], seconds=0.05)
        torch.manual_seed(1234)
        losses = []
        for step in range(3):
            _optimizer_step(model, opt, step, forward=False)
            with torch.no_grad():
                losses.append(_head_loss(model, 1000 + step).cpu())  # right after end_step
        opt.synchronize()
        torch.cuda.synchronize()
        for p in model.parameters():
            assert torch.equal(p.detach().cpu(), opt.host[p].to(p.dtype))  # (an fp32 master: rounded to nearest)
        runs[update_thread] = (losses, {k: v.detach().cpu() for k, v in model.named_parameters()})
    for a, b in zip(runs[False][0], runs[True][0]):
        assert torch.equal(a, b)
    for k, w in runs[False][1].items():
        assert torch.equal(w, runs[True][1][k]), k


@pytest.mark.parametrize("kind", ["adamw", "build_adamw_8bit"])
def test_an_optimizer_nobody_holds_is_collected_and_its_thread_ends(kind):
    # A notebook builds a second trainer after the first: the first one's offloaded optimizer (host RAM
    # for the states and copies, pinned blocks on CUDA) must go with it. The worker thread holds it only
    # weakly; the optimizer's finalizer ends the thread.
    if kind != "adamw":
        pytest.importorskip("bitsandbytes")
    import gc
    import weakref
    model, opt = _setup(kind, tied=True, update_thread=True)
    _optimizer_step(model, opt, 0)
    worker, gone = opt._worker, weakref.ref(opt)
    assert worker is not None and worker.is_alive()
    del model, opt
    gc.collect()
    assert gone() is None, "the offloaded optimizer outlived every reference to it"
    worker.join(timeout=10)
    assert not worker.is_alive()


_EXIT_RIGHT_AFTER_END_STEP = """
import sys, time
import torch
from tests.optim.test_offload_update_thread import _optimizer_step, _setup
model, opt = _setup("build_adamw_8bit", tied=False, update_thread=True)
update = opt._update
def slowed(index, *args):
    time.sleep(0.05)
    update(index, *args)
    with open(sys.argv[1], "a") as log:
        log.write(f"{index}\\n")
opt._update = slowed
_optimizer_step(model, opt, 0, forward=False)
print(len(opt.params), flush=True)
"""


def test_the_process_exits_after_the_handed_over_step_is_done(tmp_path):
    # A script that ends right after end_step (a benchmark, a notebook cell run as a script): the update
    # thread is a daemon, and Python tears daemon threads down mid-call at exit, which aborted the process
    # ("terminate called without an active exception", exit -6; seen in CI's rehearsal of trainer_step.py).
    # The optimizer's finalizer runs at exit and joins the thread after the step it holds: every update is
    # done, and the exit is clean.
    pytest.importorskip("bitsandbytes")
    import subprocess
    import sys
    from pathlib import Path
    log = tmp_path / "updated.txt"
    done = subprocess.run([sys.executable, "-c", _EXIT_RIGHT_AFTER_END_STEP, str(log)], capture_output=True,
                          text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
    assert "terminate called" not in done.stderr
    n_params = int(done.stdout.split()[-1])
    assert sorted(map(int, log.read_text().split())) == list(range(n_params)), "updates lost at exit"
