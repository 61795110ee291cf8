"""A step's loss metrics stay on the device until the step is over (training/metrics.py StepSums): the
same logged numbers as reading each micro-batch's loss and metrics at once, without the host reads."""

import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lowmem_grpo.training.metrics import StepSums
from lowmem_grpo.training.trainer import Trainer
from tests.optional import needs_bitsandbytes

TRL_NAMES = {"clip_ratio": "clip_ratio/region_mean", "clip_ratio_low": "clip_ratio/low_mean",
             "clip_ratio_high": "clip_ratio/high_mean"}


def _recording(trainer):
    """Wraps micro_batch_loss: every micro-batch's (loss, metrics, masked tokens), as the loop saw them."""
    seen, real = [], trainer.micro_batch_loss

    def record(mb, num_items, **kw):
        loss, metrics = real(mb, num_items, **kw)
        seen.append((loss.detach().clone(), {k: v.detach().clone() for k, v in metrics.items()},
                     int(mb.completion_mask.sum()), num_items))
        return loss, metrics
    trainer.micro_batch_loss = record
    return seen


def _old_way(seen):
    """The step's loss and metrics computed as the loop did before: .item() per micro-batch, Python sums,
    token-weighted means (entropy over the tokens computed, the rest over num_items), TRL's names."""
    loss_sum, sums, computed = 0.0, {}, 0
    for loss, metrics, n, _ in seen:
        loss_sum += loss.item()
        computed += n
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + v.item() * n
    num_items = seen[0][3]
    out = {k: v / max(computed if k == "entropy" else num_items, 1) for k, v in sums.items()}
    return loss_sum, {TRL_NAMES.get(k, k): v for k, v in out.items()}


@pytest.mark.parametrize("overrides", [
    ("gradient_accumulation_steps=4", "per_device_train_batch_size=2"),  # 4 micro-batches per step
    ("loss_type=grpo", "gradient_accumulation_steps=2", "per_device_train_batch_size=4", "beta=0.04",
     "num_iterations=2"),
    pytest.param(("optimizer_in_backward=true", "optimizer=adamw_8bit", "per_device_train_batch_size=4"),
                 marks=needs_bitsandbytes),
])
def test_logged_metrics_are_those_of_per_micro_batch_reads(toy_config, overrides):
    trainer = Trainer(toy_config(*overrides, "max_steps=3", "skip_zero_advantage=false"))  # every micro-batch runs
    losses = []
    for _ in range(3):
        seen = _recording(trainer)
        _, metrics, _ = trainer.run_step()
        assert len(seen) == trainer.cfg.train.gradient_accumulation_steps
        loss_sum, expected = _old_way(seen)
        assert metrics["loss"] == loss_sum  # bit for bit: the same fp64 sums in the same order
        for k, v in expected.items():
            assert metrics[k] == v, k
        assert set(expected) <= set(metrics) and {"kl", "entropy", "clip_ratio/region_mean"} <= set(expected)
        assert 0 < metrics["entropy"]
        losses.append(metrics["loss"])
    assert any(loss != 0 for loss in losses)


class _HostReads(TorchDispatchMode):
    """Counts host reads (`.item()`, `float()`, ...: on a GPU each waits for every queued kernel) of the
    tensors in `watched`."""

    def __init__(self, watched: list):
        super().__init__()
        self.watched, self.reads = watched, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and any(args[0] is t for t in self.watched):
            self.reads += 1
        return func(*args, **(kwargs or {}))


def test_a_step_reads_no_metric_per_micro_batch(toy_config, monkeypatch):
    # Four micro-batches per step. Reading each one's loss and five metrics at once would be 24 reads
    # of the loss module's outputs; instead the step's sums come back in one read (StepSums.read).
    trainer = Trainer(toy_config("gradient_accumulation_steps=4", "per_device_train_batch_size=2", "max_steps=2",
                                 "skip_zero_advantage=false"))
    trainer.generation = trainer.new_generation_batch()
    outputs, real_loss = [], trainer.micro_batch_loss

    def watched_loss(mb, num_items, **kw):
        loss, metrics = real_loss(mb, num_items, **kw)
        outputs.extend([loss, *metrics.values()])
        return loss, metrics
    monkeypatch.setattr(trainer, "micro_batch_loss", watched_loss)
    reads_of_sums, real_read = [], StepSums.read
    monkeypatch.setattr(StepSums, "read", lambda self: (reads_of_sums.append(1), real_read(self))[1])
    for _ in range(2):
        outputs.clear(), reads_of_sums.clear()
        with _HostReads(outputs) as counter:
            trainer.optimizer_step()
        assert len(outputs) == 4 * 6
        assert counter.reads == 0
        assert len(reads_of_sums) == 1


def test_step_sums_add_in_fp64_as_python_floats():
    # Values chosen so fp32 sums would round differently: the sums are those of Python floats, exactly.
    values = [torch.tensor(v, dtype=torch.float32) for v in (0.1, 1e8, -1e8, 1e-3, -0.0)]
    sums = StepSums()
    python_loss, python_kl = 0.0, 0.0
    for i, v in enumerate(values):
        sums.add_loss(v)
        sums.add_metrics({"kl": v}, tokens=7 + i)
        python_loss += v.item()
        python_kl += v.item() * (7 + i)
    loss, metrics = sums.read()
    assert loss == python_loss and metrics == {"kl": python_kl}
    assert StepSums().read() == (0.0, {})  # nothing computed (every completion skipped): no device read
    only_zero = StepSums()
    only_zero.add_loss(torch.tensor(-0.0))
    assert str(only_zero.read()[0]) == "0.0"  # 0.0 + (-0.0), as the Python sum started from 0.0


# The files of the loss loop whose host reads this change removed; others (the batch's copy to the GPU,
# the model's own, the gradient norm's once per step, bitsandbytes') are not counted here.
LOOP_FILES = {"trainer.py", "metrics.py", "loss.py", "linear_loss.py", "activation_offload.py"}


def _syncs_by_file(step) -> Counter:
    """Runs step() with torch's sync debug mode warning on every synchronising CUDA call; counts the
    warnings by the file of the Python line that made the call."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return Counter(Path(w.filename).name for w in caught if "synchronizing CUDA operation" in str(w.message))


@pytest.mark.cuda
@pytest.mark.parametrize("overrides", [
    ("gradient_accumulation_steps=4", "per_device_train_batch_size=2"),
    pytest.param(("optimizer_in_backward=true", "optimizer=adamw_8bit", "per_device_train_batch_size=4"),
                 marks=needs_bitsandbytes),
])
def test_cuda_a_step_syncs_once_for_its_metrics(toy_config, overrides):
    # Per optimizer step, the loss loop's files read the device once: the step's loss and metric sums
    # (with the optimizer in backward that read is the loss check before backward, its one micro-batch's).
    # Before: six reads per micro-batch in trainer.py and a nonzero() per micro-batch in linear_loss.py.
    trainer = Trainer(toy_config(*overrides, "device=cuda", "skip_zero_advantage=false", "max_steps=3"))
    trainer.generation = trainer.new_generation_batch()
    trainer.optimizer_step()  # the first step makes states (bitsandbytes copies its tables: syncs)
    for _ in range(2):
        syncs = _syncs_by_file(trainer.optimizer_step)
        print(dict(syncs))  # every file's count, for the log
        assert {k: v for k, v in syncs.items() if k in LOOP_FILES} == {"metrics.py": 1}, syncs
