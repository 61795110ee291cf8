"""training/step_modes.py: the trainer picks one step mode per memory mode and drives them the same way;
the offload mode owns the loss head's handle on a tied weight (no registry the optimizer writes to)."""

import pytest
import torch

from lowmem_grpo.policy.model import build_head
from lowmem_grpo.training.step_modes import InBackwardStep, OffloadStep, PlainStep
from lowmem_grpo.training.trainer import Trainer
from tests.optional import needs_bitsandbytes


@needs_bitsandbytes
@pytest.mark.parametrize("overrides, mode", [
    ([], PlainStep),
    (["optimizer_in_backward=true"], InBackwardStep),
    (["offload_optimizer=true", "gradient_accumulation_steps=2", "steps_per_generation=2"], OffloadStep),
    (["offload_optimizer=true", "optimizer_in_backward=true"], OffloadStep),
])
def test_each_memory_mode_has_its_step_mode(toy_config, overrides, mode):
    trainer = Trainer(toy_config("optimizer=adamw_8bit", *overrides))
    assert type(trainer.step_mode) is mode
    tied = trainer.policy.lm_head.weight
    if mode is OffloadStep:
        # the heads the loss and the old log-probs use read the split's leaf: the same values, its own gradient
        for head in (trainer.head, trainer.loss_module.head):
            assert head.weight is not tied and head.weight.data_ptr() == tied.data_ptr()
    else:
        assert trainer.head.weight is tied and trainer.loss_module.head.weight is tied
    # A head made elsewhere (the reference, a user's) reads the weight itself, whatever the mode: the
    # handle belongs to the heads it was given, not to the model.
    assert build_head(trainer.policy).weight is tied
    trainer.generation = trainer.new_generation_batch()
    metrics = trainer.optimizer_step()
    assert metrics["grad_norm"] > 0 and not metrics["skipped"]
    assert all(p.grad is None for p in trainer.policy.parameters())


def test_a_step_mode_finishes_a_skipped_step_like_the_plain_path(toy_config, monkeypatch):
    # Every completion skipped (zero advantages): each mode steps Adam on a zero gradient, norm 0.
    import lowmem_grpo.training.micro_batch as micro_batch_module
    for overrides in ([], ["offload_optimizer=true", "gradient_accumulation_steps=2", "steps_per_generation=2"]):
        trainer = Trainer(toy_config(*overrides))
        trainer.generation = trainer.new_generation_batch()
        monkeypatch.setattr(micro_batch_module, "trained_rows", lambda mb, t: torch.zeros(len(mb.completion_mask),
                                                                                     dtype=torch.bool))
        before = {k: v.detach().clone() for k, v in trainer.policy.named_parameters()}
        metrics = trainer.optimizer_step()
        assert metrics["grad_norm"] == 0.0 and metrics["skipped"] == 0
        monkeypatch.undo()
        # the first step from zero states on a zero gradient: Adam's update is 0 (m = 0), every weight stays
        assert all(torch.equal(v, before[k]) for k, v in trainer.policy.named_parameters())
