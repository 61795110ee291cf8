"""optim.offload_optimizer in the trainer: the same run as the optimizer in backward on the device, an
exact resume, and the settings it refuses."""

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
def test_offloaded_run_equals_the_on_device_run(toy_config, tmp_path, precision):
    runs = {}
    for offload in (False, True):
        trainer = Trainer(toy_config(*COMMON, f"precision={precision}", f"offload_optimizer={offload}",
                                     output_dir=tmp_path / str(offload)))
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


@pytest.mark.parametrize("overrides, message", [
    (["offload_optimizer=true"], "set train.optimizer_in_backward=true"),
    (["offload_optimizer=true", "optimizer_in_backward=true", "optimizer=paged_adamw_8bit"],
     "set optim.optimizer=adamw_8bit"),
])
def test_settings_it_refuses(toy_config, overrides, message):
    with pytest.raises(ConfigError, match=message):
        toy_config(*overrides)
