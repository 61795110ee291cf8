"""optim.offload_optimizer in the trainer: the same run as the optimizer in backward on the device, an
exact resume, and the settings it refuses."""

import pytest
import torch

from lowmem_grpo.config import ConfigError
from lowmem_grpo.memory_modes import host_adamw
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
@pytest.mark.parametrize("host_kernel", [False, True], ids=["bnb_on_host", "fused_host_kernel"])
def test_offloaded_run_equals_the_on_device_run(toy_config, tmp_path, monkeypatch, precision, host_kernel):
    # bnb_on_host: the host steps with bitsandbytes' own CPU path, the on-device run's code: bitwise equal.
    # fused_host_kernel (memory_modes/host_adamw.py; its own tests compare it with bitsandbytes op by op):
    # fp32 within 1e-6 of each tensor's scale (torch's CPU sqrt is not correctly rounded, the kernel's is,
    # and an 8-bit state code that flips on the difference carries it on); bf16_sr draws other rounding
    # noise, so runs agree only statistically: the two runs' difference is well under how far the 8-bit-state
    # matrices moved (measured 0.09-0.11 of it; a wrong update would be ~1 or more).
    fused_calls = []
    if host_kernel:
        if host_adamw.library() is None:
            pytest.skip(f"the host kernel did not build here: {host_adamw._load_error}")
        real = host_adamw.adamw8bit_step
        monkeypatch.setattr(host_adamw, "adamw8bit_step", lambda *a, **k: fused_calls.append(1) or real(*a, **k))
    else:
        monkeypatch.setattr(host_adamw, "_library", None)
        monkeypatch.setattr(host_adamw, "_load_error", "off in this test")
    runs = {}
    for offload in (False, True):
        trainer = Trainer(toy_config(*COMMON, f"precision={precision}", f"offload_optimizer={offload}",
                                     output_dir=tmp_path / str(offload)))
        assert isinstance(trainer.optimizer, OffloadedOptimizerInBackward) == offload
        # offloaded: the tied embedding's head gradient comes on a leaf of its own (offload.py); equal all the same
        assert (trainer.head.weight is not trainer.policy.lm_head.weight) == offload
        start = _params(trainer)
        trainer.train()
        runs[offload] = _params(trainer)
    assert bool(fused_calls) == host_kernel
    for k in runs[False]:
        device, offloaded = runs[False][k], runs[True][k]
        if not host_kernel:
            assert torch.equal(device, offloaded), k
        elif precision == "fp32":
            torch.testing.assert_close(offloaded, device, rtol=1e-6, atol=1e-6 * float(device.abs().max()), msg=k)
        elif device.numel() >= 4096:  # 8-bit states (smaller tensors: fp32 states, sr_adamw's path)
            moved = (device.float() - start[k].float()).norm()
            assert (offloaded.float() - device.float()).norm() < 0.25 * moved, k


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
