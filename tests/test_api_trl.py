"""The Python API as a TRL user drives it: train(resume_from_checkpoint=...), num_train_epochs, and
GRPOConfig(eval_steps=...) before the trainer gets eval_dataset= (the field-by-field walk of TRL's
GRPOConfig is tests/training/test_trl_config_names.py)."""

import pytest
import torch

from lowmem_grpo import GRPOConfig, GRPOTrainer
from lowmem_grpo.config import ConfigError
from tests.test_api import TOY, tiny_llama, toy_args
from tests.training.conftest import label_reward, toy_rows


def _trainer(tmp_path, name: str, **settings) -> GRPOTrainer:
    """The toy run; TOY's max_steps only where `settings` give neither max_steps nor num_train_epochs."""
    toy = {k: v for k, v in TOY.items() if k != "config" and not (k == "max_steps" and "num_train_epochs" in settings)}
    args = GRPOConfig(**{**toy, "output_dir": str(tmp_path / name), **settings})
    return GRPOTrainer(model=tiny_llama(), reward_funcs=label_reward, args=args, train_dataset=toy_rows(24))


def _weights(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_train_resume_from_checkpoint_loads_the_checkpoint(tmp_path):
    first = _trainer(tmp_path, "run", max_steps=1, save_steps=1)
    first.train()
    for how in (True, str(tmp_path / "run" / "checkpoint-1")):
        resumed = _trainer(tmp_path, "run", max_steps=1)  # nothing left to train: the checkpoint's weights
        assert resumed.train(resume_from_checkpoint=how)["step"] == 1
        assert resumed.loop.resumed_from == tmp_path / "run" / "checkpoint-1"
        got, want = _weights(resumed.model), _weights(first.model)
        assert all(torch.equal(got[k], want[k]) for k in want), f"resume_from_checkpoint={how!r}"


@pytest.mark.slow
def test_train_resume_from_checkpoint_true_or_a_path_continues_the_run(tmp_path):
    straight = _trainer(tmp_path, "straight", max_steps=4)
    straight.train()
    first = _trainer(tmp_path, "run", max_steps=2, save_steps=2)
    first.train()
    assert (tmp_path / "run" / "checkpoint-2").is_dir()
    for how in (True, str(tmp_path / "run" / "checkpoint-2")):
        resumed = _trainer(tmp_path, "run", max_steps=4, save_steps=0, save_total_limit=10)
        result = resumed.train(resume_from_checkpoint=how)
        assert resumed.loop.resumed_from == tmp_path / "run" / "checkpoint-2" and result["step"] == 4
        got, want = _weights(resumed.model), _weights(straight.model)
        assert all(torch.equal(got[k], want[k]) for k in want), f"resume_from_checkpoint={how!r}"
        # the next resume must find checkpoint-2 again, not the step-4 one this run wrote
        for done in (tmp_path / "run").glob("checkpoint-4"):
            import shutil
            shutil.rmtree(done)


def test_resume_from_checkpoint_refuses_a_trainer_that_has_trained(tmp_path):
    trainer = _trainer(tmp_path, "run", max_steps=1, save_steps=1)
    trainer.train()
    with pytest.raises(ConfigError, match="at step 1: resume with a new GRPOTrainer"):
        trainer.train(resume_from_checkpoint=True)
    with pytest.raises(ConfigError, match="hyperparameter-search"):
        trainer.train(trial={"lr": 1})


def test_num_train_epochs_sets_the_steps_from_the_prompts(tmp_path):
    # 24 prompts; a generation batch is 8 completions = 2 prompts (G = 4) and one optimizer step: 12 per epoch
    assert _trainer(tmp_path, "a", num_train_epochs=0.5).loop.cfg.train.max_steps == 6
    assert _trainer(tmp_path, "b", num_train_epochs=2, num_iterations=2).loop.cfg.train.max_steps == 48
    assert _trainer(tmp_path, "c", num_train_epochs=2, max_steps=3).loop.cfg.train.max_steps == 3  # max_steps wins
    trainer = _trainer(tmp_path, "d", max_steps=-1)  # TRL's default: 3 epochs
    assert trainer.loop.cfg.train.max_steps == 36 and trainer.loop.scheduler.last_epoch == 0


def test_eval_steps_set_before_the_eval_dataset_is_given(tmp_path):
    args = GRPOConfig(eval_steps=1)  # TRL: the eval dataset comes with the trainer
    trainer = GRPOTrainer(model=tiny_llama(), reward_funcs=label_reward, train_dataset=toy_rows(24),
                          eval_dataset=toy_rows(4, seed=2), args=toy_args(eval_steps=1, output_dir=str(tmp_path)))
    assert args.eval_steps == 1 and trainer.loop.cfg.eval.eval_steps == 1 and len(trainer.loop.eval_set) == 4
    with pytest.raises(ConfigError, match="eval_steps=1 evaluates on held-out prompts"):
        GRPOTrainer(model=tiny_llama(), reward_funcs=label_reward, train_dataset=toy_rows(24),
                    args=toy_args(eval_steps=1, output_dir=str(tmp_path)))


def test_docs_list_every_trl_name():
    from pathlib import Path

    from lowmem_grpo.config.trl_names import TRL_NAMES
    doc = (Path(__file__).resolve().parents[1] / "docs" / "trl.md").read_text()
    missing = [name for name in TRL_NAMES if f"| `{name}` |" not in doc]
    assert not missing, f"docs/trl.md's table lacks {missing}"


def test_a_new_run_into_a_folder_that_holds_one_is_refused_when_it_trains(tmp_path):
    _trainer(tmp_path, "run", max_steps=1, save_steps=1).train()
    again = _trainer(tmp_path, "run", max_steps=1)  # built: TRL's train(resume_from_checkpoint=...) may follow
    with pytest.raises(ConfigError, match="already holds a run .*continue it with resume_from=latest"):
        again.train()
    assert again.train(resume_from_checkpoint=True)["step"] == 1
