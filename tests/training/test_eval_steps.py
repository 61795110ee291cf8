"""eval.eval_steps: held-out evaluation during train, on a tiny random Llama.

Rows at the right steps, training unchanged by evaluating (even when evaluation draws random numbers),
step_time without the evaluation, and resume neither repeating nor losing an evaluation."""

import random
import time
import types

import numpy as np
import pytest
import torch

from lowmem_grpo.config import ConfigError
from lowmem_grpo.training.evaluate import evaluation_during, training_rng_untouched
from lowmem_grpo.training.metrics import read_metrics
from lowmem_grpo.training import trainer as trainer_module
from lowmem_grpo.training.trainer import Trainer

TIMING = {"step_time", "generation_time", "tokens_per_second", "peak_memory_bytes", "eval_runtime"}


def random_drawing_reward(prompts, completions, completion_ids, label, **kwargs):
    """The toy label reward, drawing from every global RNG on each call (as a sampling judge might)."""
    random.random()
    np.random.rand()
    torch.rand(1)
    return [float(sum(t == lab for t in ids)) for ids, lab in zip(completion_ids, label)]


def _eval_rows(output_dir):
    return [r for r in read_metrics(output_dir) if "eval_reward" in r]


def _train_rows(output_dir):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in read_metrics(output_dir) if "eval_reward" not in r]


def test_eval_rows_at_every_eval_steps_and_not_in_step_time(toy_config, monkeypatch):
    trainer = Trainer(toy_config("max_steps=5", "eval_steps=2"))
    calls = []
    # The trainer's clock, with each evaluation taking 1000 s: a step_time that counted one would show it,
    # however loaded the machine is.
    clock = {"offset": 0.0}
    monkeypatch.setattr(trainer_module, "time", types.SimpleNamespace(
        perf_counter=lambda: time.perf_counter() + clock["offset"]))

    def slow_eval():
        calls.append(trainer.step)
        clock["offset"] += 1000.0
        return {"samples": 8, "reward": 0.5, "rewards/label_reward/mean": 0.5, "pass_rate/label_reward": 0.25,
                "mean_length": 3.0, "seconds": 1.0}

    monkeypatch.setattr(trainer, "evaluate", slow_eval)
    trainer.train()
    assert calls == [2, 4]  # not at 5: like transformers, the last step is evaluated only on the schedule
    rows = read_metrics(trainer.cfg.output.output_dir)
    assert [(r["step"], "eval_reward" in r) for r in rows] == [
        (1, False), (2, False), (2, True), (3, False), (4, False), (4, True), (5, False)]
    assert rows[2] == {"step": 2, "eval_samples": 8, "eval_reward": 0.5, "eval_rewards/label_reward/mean": 0.5,
                       "eval_pass_rate/label_reward": 0.25, "eval_completions/mean_length": 3.0, "eval_runtime": 1.0}
    assert all(r["step_time"] < 1000.0 for r in rows if "step_time" in r)


def test_evaluating_changes_nothing_in_training(toy_config, tmp_path):
    # The reward draws from Python's, NumPy's and torch's RNG on every call, so an evaluation that did not
    # put the streams back would shift the training samples after it and change the weights.
    common = ["max_steps=4", "reward_funcs=[tests.training.test_eval_steps:random_drawing_reward]"]
    plain = Trainer(toy_config(*common, output_dir=tmp_path / "plain"))
    plain.train()
    evaluated = Trainer(toy_config(*common, "eval_steps=1", output_dir=tmp_path / "eval"))
    evaluated.train()
    for (k, a), (_, b) in zip(plain.policy.named_parameters(), evaluated.policy.named_parameters()):
        assert torch.equal(a, b), k
    assert _train_rows(tmp_path / "plain") == _train_rows(tmp_path / "eval")
    assert [r["step"] for r in _eval_rows(tmp_path / "eval")] == [1, 2, 3, 4]
    assert evaluated.policy.training
    assert (tmp_path / "eval" / "run.png").is_file()


def test_rng_streams_are_put_back(tmp_path):
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    with training_rng_untouched(torch.device("cpu")):
        torch.rand(5), random.random(), np.random.rand(7)
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]


def test_evaluation_during_puts_the_model_back_in_train_mode(tmp_path):
    from lowmem_grpo.training.metrics import RunLog
    model = torch.nn.Linear(2, 2).train()

    def run_eval():
        model.eval()  # what generate() does; a failure half-way must not leave it so either
        return {"samples": 1, "reward": 1.0, "seconds": 0.1}

    log = RunLog(tmp_path)
    row = evaluation_during(run_eval, model, log, 7)
    assert model.training and row == {"eval_samples": 1, "eval_reward": 1.0, "eval_runtime": 0.1}
    assert read_metrics(tmp_path) == [{"step": 7, **row}]

    def failing_eval():
        model.eval()
        raise RuntimeError("reward server down")

    with pytest.raises(RuntimeError):
        evaluation_during(failing_eval, model, log, 8)
    assert model.training


def test_eval_steps_without_held_out_prompts_is_a_clear_error(toy_config):
    with pytest.raises(ConfigError, match="eval_steps=2 .*data.eval_file or data.eval_holdout"):
        toy_config("eval_steps=2", "data.eval_file=null")
    with pytest.raises(ConfigError, match="eval_steps must be > 0"):
        toy_config("eval_steps=0")
    toy_config("eval_steps=2", "data.eval_file=null", "eval_holdout=4")  # held out from the training file: fine
    trainer = Trainer(toy_config("data.eval_file=null"))  # set after validation (e.g. edited in a notebook)
    trainer.cfg.eval.eval_steps = 2
    with pytest.raises(ConfigError, match="eval_steps=2 needs held-out prompts"):
        trainer.train()
    assert trainer.step == 0


def _stop_after(trainer, step):
    real = trainer.optimizer_step

    def step_then_stop():
        out = real()
        if trainer.step == step - 1:  # the loop increments after this returns
            trainer.stop.request("test")
        return out

    trainer.optimizer_step = step_then_stop


def test_resume_neither_repeats_nor_loses_an_evaluation(toy_config, tmp_path):
    common = ["max_steps=4", "eval_steps=2", "save_steps=2", "save_total_limit=3"]
    straight = tmp_path / "straight"
    Trainer(toy_config(*common, output_dir=straight)).train()
    expected = [{k: v for k, v in r.items() if k not in TIMING} for r in _eval_rows(straight)]
    assert [r["step"] for r in expected] == [2, 4]

    # Resumed from checkpoint-2, which came after step 2's evaluation: the row is kept, not redone.
    Trainer(toy_config(*common, f"resume_from={straight / 'checkpoint-2'}", output_dir=straight)).train()
    assert [{k: v for k, v in r.items() if k not in TIMING} for r in _eval_rows(straight)] == expected

    # Stopped during step 2 (its evaluation skipped to stop fast; saved at 2): the resumed run evaluates step 2 first.
    stopped = tmp_path / "stopped"
    first = Trainer(toy_config(*common, output_dir=stopped))
    _stop_after(first, 2)
    assert first.train()["step"] == 2 and _eval_rows(stopped) == []
    Trainer(toy_config(*common, "resume_from=latest", output_dir=stopped)).train()
    assert [{k: v for k, v in r.items() if k not in TIMING} for r in _eval_rows(stopped)] == expected


def test_each_end_evaluation_is_kept_when_a_resumed_run_ends_again(toy_config, tmp_path):
    from lowmem_grpo.training.plot import draw_run
    out = tmp_path / "ends"
    first = Trainer(toy_config("max_steps=2", "eval_on_end=true", output_dir=out)).train()["eval_end"]
    second = Trainer(toy_config("max_steps=4", "eval_on_end=true", "resume_from=latest", output_dir=out))
    again = second.train()["eval_end"]
    rows = _eval_rows(out)
    assert [r["step"] for r in rows] == [2, 4]  # the first end's evaluation survives the second's eval_end.json
    assert rows[0]["eval_reward"] == pytest.approx(first["reward"]) and rows[1]["eval_reward"] == pytest.approx(
        again["reward"])
    held_out = draw_run(out).axes[1]  # PANELS: "held-out score"
    assert [list(line.get_xdata()) for line in held_out.get_lines() if line.get_label() == "reward"] == [[2, 4]]
    # with eval_steps landing on the last step, the end adds no second row there
    Trainer(toy_config("max_steps=2", "eval_steps=2", "eval_on_end=true", output_dir=tmp_path / "both")).train()
    assert [r["step"] for r in _eval_rows(tmp_path / "both")] == [2]
