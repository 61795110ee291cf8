"""optim.offload_optimizer in the trainer: the same run as the plain path (with gradient accumulation) and
as the optimizer in backward on the device (one micro-batch per step, no clipping difference), an exact
resume, and the settings it refuses."""

import random
import threading
import time

import pytest
import torch

from lowmem_grpo.config import ConfigError
from lowmem_grpo.optim import host_adamw
from lowmem_grpo.optim.offload import OffloadedOptimizer
from lowmem_grpo.training.trainer import Trainer
from tests.optional import needs_bitsandbytes
from .conftest import train_until_stopped

# steps_per_generation=2 with per-tensor clipping active (small max_grad_norm): several in-backward steps
# per generation batch, with stored old log-probs
COMMON = ["max_steps=3", "per_device_train_batch_size=4", "steps_per_generation=2", "optimizer_in_backward=true",
          "max_grad_norm=0.1", "optimizer=adamw_8bit", "lr_scheduler_type=cosine"]


def _params(trainer):
    return {k: v.detach().clone() for k, v in trainer.policy.named_parameters()}


def _host_kernel(monkeypatch, on: bool) -> list:
    """The offloaded 8-bit optimizer's host path for this test: host_adamw's fused kernel (its calls are
    recorded in the returned list) or, with on=False, bitsandbytes' own CPU path (the plain run's code)."""
    calls = []
    if on:
        if host_adamw.library() is None:
            pytest.skip(f"the host kernel did not build here: {host_adamw._load_error}")
        real = host_adamw.adamw8bit_step
        monkeypatch.setattr(host_adamw, "adamw8bit_step", lambda *a, **k: calls.append(1) or real(*a, **k))
    else:
        monkeypatch.setattr(host_adamw, "_library", None)
        monkeypatch.setattr(host_adamw, "_load_error", "off in this test")
    return calls


def _assert_runs_agree(plain: dict, offloaded: dict, start: dict, precision: str, fused: bool) -> None:
    """bitsandbytes' path on the host: bit for bit. The fused kernel, fp32: within 1e-6 of each tensor's
    scale, except where an 8-bit state code flipped on a last-bit difference (torch's CPU sqrt is not
    correctly rounded, the kernel's is) and the flip carried on: a few elements, each off by a small part
    of one update (measured: one element in each of two tensors, at most 2.9e-6 against a 2e-3 move; a
    wrong update would be off by about the whole move). bf16_sr draws other rounding noise, so runs agree only statistically: their
    difference is well under how far the 8-bit-state matrices moved (measured 0.09-0.11 of it; a wrong
    update would be ~1 or more)."""
    for k in plain:
        if not fused:
            assert torch.equal(plain[k], offloaded[k]), k
        elif precision == "fp32":
            off = (offloaded[k] - plain[k]).abs()
            flipped = off > 1e-6 * float(plain[k].abs().max())
            moved = float((plain[k] - start[k]).abs().max())
            assert int(flipped.sum()) <= max(2, flipped.numel() // 1000), (k, int(flipped.sum()))
            assert float(off.max()) < 0.01 * moved, (k, float(off.max()), moved)
        elif plain[k].numel() >= 4096:  # 8-bit states (smaller tensors: fp32 states, sr_adamw's path)
            moved = (plain[k].float() - start[k].float()).norm()
            assert (offloaded[k].float() - plain[k].float()).norm() < 0.25 * moved, k


@needs_bitsandbytes
@pytest.mark.parametrize("precision", ["fp32", "bf16_sr"])
@pytest.mark.parametrize("host_kernel", [False, True], ids=["bnb_on_host", "fused_host_kernel"])
def test_offloaded_run_equals_the_plain_run(toy_config, tmp_path, monkeypatch, precision, host_kernel):
    # One micro-batch per optimizer step (several per generation batch, with stored old log-probs) and
    # the global clip active: offloaded (optimizer_in_backward=true: accepted, the same) against the plain
    # path. (The on-device optimizer in backward would clip per tensor: a different run.)
    # bnb_on_host: the host steps with bitsandbytes' own CPU path, the plain run's code: bitwise equal.
    # fused_host_kernel (optim/host_adamw.py; its own tests compare it with bitsandbytes op by op):
    # fp32 within 1e-6 of each tensor's scale (torch's CPU sqrt is not correctly rounded, the kernel's is,
    # and an 8-bit state code that flips on the difference carries it on); bf16_sr draws other rounding
    # noise, so runs agree only statistically: the two runs' difference is well under how far the 8-bit-state
    # matrices moved (measured 0.09-0.11 of it; a wrong update would be ~1 or more).
    fused_calls = _host_kernel(monkeypatch, host_kernel)
    runs = {}
    for offload in (False, True):
        trainer = Trainer(toy_config(*COMMON, f"precision={precision}", f"offload_optimizer={offload}",
                                     f"optimizer_in_backward={offload}", output_dir=tmp_path / str(offload)))
        assert isinstance(trainer.optimizer, OffloadedOptimizer) == offload
        # offloaded: the tied embedding's head gradient comes on a leaf of its own (offload.py); equal all the same
        assert (trainer.head.weight is not trainer.policy.lm_head.weight) == offload
        start = _params(trainer)
        trainer.train()
        runs[offload] = _params(trainer)
    assert bool(fused_calls) == host_kernel
    _assert_runs_agree(runs[False], runs[True], start, precision, host_kernel)


@needs_bitsandbytes
@pytest.mark.parametrize("precision", ["fp32", "bf16_sr"])
def test_a_slow_update_thread_changes_nothing(toy_config, tmp_path, monkeypatch, precision):
    # The host update runs on the worker thread while the next rollout's forward starts (offload.py, "Off
    # the autograd thread"). Each update delayed at random on the worker: a read of any weight that did
    # not wait for its update (a module without the pre-hook, the fused head's weight, a rollout path that
    # bypasses the module) would see the old weight, and the run would differ from the plain one.
    _host_kernel(monkeypatch, False)  # bitsandbytes' path: the plain run's code, so bit for bit
    real_update, workers = OffloadedOptimizer._update, set()
    rng = random.Random(0)

    def slow_update(self, *args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            workers.add(threading.current_thread().name)
            time.sleep(0.01 + rng.random() * 0.04)
        return real_update(self, *args, **kwargs)

    monkeypatch.setattr(OffloadedOptimizer, "_update", slow_update)
    runs = {}
    for offload in (False, True):
        trainer = Trainer(toy_config(*COMMON, f"precision={precision}", f"offload_optimizer={offload}",
                                     f"optimizer_in_backward={offload}", output_dir=tmp_path / str(offload)))
        trainer.train()
        runs[offload] = _params(trainer)
    assert workers == {"lowmem-grpo-host-update"}  # the trainer's updates ran on the worker thread
    for k in runs[False]:
        assert torch.equal(runs[False][k], runs[True][k]), k


@needs_bitsandbytes
@pytest.mark.parametrize("optimizer", ["adamw_8bit", "adamw"])  # adamw: fp32 masters on the host
def test_offloaded_resume_is_exact(toy_config, tmp_path, optimizer):
    common = COMMON + ["max_steps=4", "precision=bf16_sr", "offload_optimizer=true", "beta=0.05",
                       f"optimizer={optimizer}"]
    straight = Trainer(toy_config(*common, output_dir=tmp_path / "a"))
    straight.train()
    interrupted = Trainer(toy_config(*common, output_dir=tmp_path / "b"))
    train_until_stopped(interrupted, 2)
    resumed = Trainer(toy_config(*common, "resume_from=latest", output_dir=tmp_path / "b"))
    for p in resumed.policy.parameters():  # host copies hold the resumed weights, not the initial ones
        assert torch.equal(p.detach(), resumed.optimizer.host[p].to(p.dtype))
    resumed.train()
    a, b = _params(straight), _params(resumed)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _run_recording_grad_norms(trainer):
    """trainer.train(), returning each optimizer step's logged metrics."""
    steps, real_step = [], trainer.optimizer_step

    def step():
        out = real_step()
        steps.append(out)
        return out
    trainer.optimizer_step = step
    trainer.train()
    return steps


@needs_bitsandbytes
@pytest.mark.parametrize("precision, optimizer, host_kernel", [
    ("fp32", "adamw", False), ("fp32", "adamw_8bit", False), ("bf16_sr", "adamw_8bit", False),
    ("fp32", "adamw_8bit", True)])  # (bf16_sr + the fused kernel: other rounding draws, so the RNG stream and
# the next generation batches differ; test_offloaded_run_equals_the_plain_run and test_host_adamw.py cover it)
def test_accumulated_offloaded_run_equals_the_plain_run(toy_config, tmp_path, monkeypatch, precision, optimizer,
                                                        host_kernel):
    # gradient_accumulation_steps=4 with offload_optimizer (no optimizer_in_backward setting needed): the
    # same run as without offload -- the global clip (small max_grad_norm: it fires, asserted), one update
    # per 4 micro-batches, the tied embedding's head on its own leaf, the same logged grad_norm. fp32 +
    # adamw: torch's fused CPU AdamW on the host against its for-loop AdamW, within 1e-6 relative; the
    # 8-bit optimizers on bitsandbytes' host path share their code: bit for bit; the fused host kernel, as
    # _assert_runs_agree says.
    fused_calls = _host_kernel(monkeypatch, host_kernel) if optimizer == "adamw_8bit" else []
    common = ["max_steps=3", "per_device_train_batch_size=2", "gradient_accumulation_steps=4",
              "steps_per_generation=4", "max_grad_norm=0.05", f"optimizer={optimizer}", f"precision={precision}",
              "lr_scheduler_type=cosine", "reward_funcs=[tests.training.conftest:spread_reward]"]
    runs, logged = {}, {}
    for offload in (False, True):
        trainer = Trainer(toy_config(*common, f"offload_optimizer={offload}", output_dir=tmp_path / str(offload)))
        assert isinstance(trainer.optimizer, OffloadedOptimizer) == offload
        assert (trainer.head.weight is not trainer.policy.lm_head.weight) == offload
        logged[offload] = _run_recording_grad_norms(trainer)
        runs[offload] = _params(trainer)
    assert len(logged[True]) == 3 and not any(m["skipped"] for m in logged[True])
    assert bool(fused_calls) == host_kernel
    for step, (plain, offloaded) in enumerate(zip(logged[False], logged[True])):
        assert plain["grad_norm"] > 0.05  # the clip fired
        assert offloaded["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-6)
        # (later steps of the fused kernel start from weights 1e-9 away: losses equal to rounding)
        assert offloaded["loss"] == (pytest.approx(plain["loss"], rel=1e-5, abs=1e-7) if step and host_kernel
                                     else plain["loss"])
    start = _params(Trainer(toy_config(*common, output_dir=tmp_path / "start")))
    for k in runs[False]:
        assert not torch.equal(runs[True][k], start[k]), f"{k} never moved"
    if optimizer == "adamw":  # relative to the tensor: fused and for-loop AdamW round differently
        for k in runs[False]:
            assert (runs[True][k] - runs[False][k]).norm() <= 1e-6 * runs[False][k].norm(), k
    else:
        _assert_runs_agree(runs[False], runs[True], start, precision, host_kernel)


@pytest.mark.parametrize("overrides, message", [
    (["optimizer_in_backward=true", "gradient_accumulation_steps=2"], "optim.offload_optimizer=true"),
    (["offload_optimizer=true", "optimizer_in_backward=true", "optimizer=paged_adamw_8bit"],
     "set optim.optimizer=adamw_8bit"),
])
def test_settings_it_refuses(toy_config, overrides, message):
    with pytest.raises(ConfigError, match=message):
        toy_config(*overrides)
