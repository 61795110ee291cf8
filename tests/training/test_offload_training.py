"""optim.offload_optimizer in the trainer: the same run as the plain path (with gradient accumulation) and
as the optimizer in backward on the device (one micro-batch per step, no clipping difference), an exact
resume, and the settings it refuses."""

import pytest
import torch

from lowmem_grpo.config import ConfigError
from lowmem_grpo.memory_modes.offload import OffloadedOptimizerInBackward
from lowmem_grpo.training.trainer import Trainer
from tests.optional import needs_bitsandbytes

# steps_per_generation=2 with per-tensor clipping active (small max_grad_norm): several in-backward steps
# per generation batch, with stored old log-probs
COMMON = ["max_steps=3", "per_device_train_batch_size=4", "steps_per_generation=2", "optimizer_in_backward=true",
          "max_grad_norm=0.1", "optimizer=adamw_8bit", "lr_scheduler_type=cosine"]


def _params(trainer):
    return {k: v.detach().clone() for k, v in trainer.policy.named_parameters()}


@needs_bitsandbytes
@pytest.mark.parametrize("precision", ["fp32", "bf16_sr"])
def test_offloaded_run_equals_the_plain_run(toy_config, tmp_path, precision):
    # One micro-batch per optimizer step (several per generation batch, with stored old log-probs) and
    # the global clip active: offloaded (optimizer_in_backward=true: accepted, the same) equals the plain
    # path bit for bit. (The on-device optimizer in backward would clip per tensor: a different run.)
    runs = {}
    for offload in (False, True):
        trainer = Trainer(toy_config(*COMMON, f"precision={precision}", f"offload_optimizer={offload}",
                                     f"optimizer_in_backward={offload}", output_dir=tmp_path / str(offload)))
        assert isinstance(trainer.optimizer, OffloadedOptimizerInBackward) == offload
        # offloaded: the tied embedding's head gradient comes on a leaf of its own (offload.py); equal all the same
        assert (trainer.head.weight is not trainer.policy.lm_head.weight) == offload
        trainer.train()
        runs[offload] = _params(trainer)
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
    real_step = interrupted.optimizer_step

    def step_then_stop_at_2():
        out = real_step()
        if interrupted.step == 1:  # the loop counts this step after it returns: stop after step 2
            interrupted.stop.request("test")
        return out

    interrupted.optimizer_step = step_then_stop_at_2
    assert interrupted.train()["step"] == 2
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
@pytest.mark.parametrize("precision, optimizer", [("fp32", "adamw"), ("fp32", "adamw_8bit"), ("bf16_sr", "adamw_8bit")])
def test_accumulated_offloaded_run_equals_the_plain_run(toy_config, tmp_path, precision, optimizer):
    # gradient_accumulation_steps=4 with offload_optimizer (no optimizer_in_backward setting needed): the
    # same run as without offload -- the global clip (small max_grad_norm: it fires, asserted), one update
    # per 4 micro-batches, the tied embedding's head on its own leaf, the same logged grad_norm. fp32 +
    # adamw: torch's fused CPU AdamW on the host against its for-loop AdamW, within 1e-6 relative; the
    # 8-bit optimizers share their code: bit for bit.
    common = ["max_steps=3", "per_device_train_batch_size=2", "gradient_accumulation_steps=4",
              "steps_per_generation=4", "max_grad_norm=0.05", f"optimizer={optimizer}", f"precision={precision}",
              "lr_scheduler_type=cosine"]
    runs, logged = {}, {}
    for offload in (False, True):
        trainer = Trainer(toy_config(*common, f"offload_optimizer={offload}", output_dir=tmp_path / str(offload)))
        assert isinstance(trainer.optimizer, OffloadedOptimizerInBackward) == offload
        assert (trainer.head.weight is not trainer.policy.lm_head.weight) == offload
        logged[offload] = _run_recording_grad_norms(trainer)
        runs[offload] = _params(trainer)
    assert len(logged[True]) == 3 and not any(m["skipped"] for m in logged[True])
    for plain, offloaded in zip(logged[False], logged[True]):
        assert plain["grad_norm"] > 0.05  # the clip fired
        assert offloaded["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-6)
        assert offloaded["loss"] == plain["loss"]
    start = _params(Trainer(toy_config(*common, output_dir=tmp_path / "start")))
    for k in runs[False]:
        assert not torch.equal(runs[True][k], start[k]), f"{k} never moved"
        if optimizer == "adamw":  # relative to the tensor: fused and for-loop AdamW round differently
            assert (runs[True][k] - runs[False][k]).norm() <= 1e-6 * runs[False][k].norm(), k
        else:
            assert torch.equal(runs[False][k], runs[True][k]), k


@pytest.mark.parametrize("overrides, message", [
    (["optimizer_in_backward=true", "gradient_accumulation_steps=2"], "optim.offload_optimizer=true"),
    (["offload_optimizer=true", "optimizer_in_backward=true", "optimizer=paged_adamw_8bit"],
     "set optim.optimizer=adamw_8bit"),
])
def test_settings_it_refuses(toy_config, overrides, message):
    with pytest.raises(ConfigError, match=message):
        toy_config(*overrides)
