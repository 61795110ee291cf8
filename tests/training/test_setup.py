"""training/setup.py: the trainer's set-up, one function per concern, each taking its config section and the
live objects it needs. One Head per model, shared by the loss, the trainer and the step mode; data given as
objects needs no file name in the config."""

import pytest

from lowmem_grpo.config import ConfigError
from lowmem_grpo.training.data import DataError
from lowmem_grpo.training.step_modes import OffloadStep
from lowmem_grpo.training.trainer import Trainer

from .conftest import toy_rows


@pytest.mark.parametrize("overrides", [
    [],
    ["optimizer_in_backward=true"],
    ["offload_optimizer=true", "gradient_accumulation_steps=2", "steps_per_generation=2"],
])
def test_the_head_is_one_object(toy_config, overrides):
    trainer = Trainer(toy_config(*overrides))
    assert trainer.loss_module.head is trainer.head
    assert trainer.rollout.head is trainer.head
    if isinstance(trainer.step_mode, OffloadStep):
        assert trainer.step_mode.head is trainer.head
        # the one head reads the split's leaf: the same storage as the tied weight, a gradient of its own
        tied = trainer.policy.lm_head.weight
        assert trainer.head.weight is not tied and trainer.head.weight.data_ptr() == tied.data_ptr()
    trainer.generation = trainer.new_generation_batch()
    assert trainer.optimizer_step()["grad_norm"] > 0


def test_rows_given_as_objects_need_no_file_name(toy_config):
    cfg = toy_config()
    cfg.data.train_file, cfg.data.eval_file = None, None
    trainer = Trainer(cfg, train_data=toy_rows(16), eval_data=toy_rows(4, seed=1))
    assert len(trainer.train_set) == 16 and len(trainer.eval_set) == 4
    assert trainer.cfg.data.train_file is None  # the config is not given a label for them
    bad = toy_config()
    bad.data.train_file = None
    with pytest.raises(DataError, match="train_dataset index 1: prompt_ids"):
        Trainer(bad, train_data=[{"prompt_ids": [6, 7]}, {"prompt_ids": "seven"}])


def test_no_rows_at_all_names_both_ways_to_give_them(toy_config):
    cfg = toy_config()
    cfg.data.train_file = None
    with pytest.raises(ConfigError, match="data.train_file is not set.*train_data="):
        Trainer(cfg)
