"""Where lowmem-grpo claims TRL's semantics (GRPOTrainer, TRL 1.16), each written out here from TRL's
definition and compared: unscored completions, dropout, LR schedules, reward-function kwargs, metric names."""

import json
import math
import os

import pytest
import torch

from lowmem_grpo.config import LR_SCHEDULES, ConfigError, OptimConfig
from lowmem_grpo.optim.optimizers import build_scheduler
from lowmem_grpo.policy.batch import Batch
from lowmem_grpo.policy.packing import Packing
from lowmem_grpo.rewards import RewardFunction, compute_rewards, reward_metrics, scorable_totals
from lowmem_grpo.training.generation import compute_advantages
from lowmem_grpo.training.micro_batch import computed_tokens
from lowmem_grpo.training.metrics import read_metrics
from lowmem_grpo.training.trainer import Trainer
from tests.training.conftest import TINY_LLAMA

NAN = float("nan")


# ----------------------------------------------------------------- completions no function scored

def _trl_advantages(rewards: torch.Tensor, G: int, scale: str) -> torch.Tensor:
    """TRL >= 1.6 (sum_then_normalize), written out: NaN rewards are left out of each group's mean and
    (Bessel) std; the batch std for scale=batch; NaN advantages become 0."""
    out = torch.zeros_like(rewards)
    scored_all = rewards[~rewards.isnan()]
    for g in range(len(rewards) // G):
        r = rewards[g * G:(g + 1) * G]
        s = r[~r.isnan()]
        std = {"group": s.std() if len(s) > 1 else torch.tensor(NAN), "batch": scored_all.std(),
               "none": torch.tensor(0.0)}[scale]
        adv = r - s.mean()
        if scale != "none":
            adv = adv / (std + 1e-4)
        out[g * G:(g + 1) * G] = torch.nan_to_num(adv, nan=0.0)
    return out


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_unscored_completions_leave_group_statistics_as_trl(scale):
    r = torch.tensor([1.0, NAN, 0.0, 3.0,   NAN, 2.0, 0.5, 1.0,   NAN, NAN, NAN, NAN,   4.0, NAN, NAN, NAN])
    adv, std = compute_advantages(r, 4, scale)
    torch.testing.assert_close(adv, _trl_advantages(r, 4, scale))
    assert torch.equal(adv[r.isnan()], torch.zeros(int(r.isnan().sum())))  # exactly 0
    assert torch.equal(adv[8:], torch.zeros(8))  # groups with fewer than 2 scored completions
    torch.testing.assert_close(std[:2], torch.stack([torch.tensor([1.0, 0.0, 3.0]).std(),
                                                    torch.tensor([2.0, 0.5, 1.0]).std()]))
    assert std[2:].isnan().all()  # TRL's nanstd of fewer than 2 values
    # The old behaviour (None -> 0 in the statistics) would differ: the check can fail.
    assert not torch.allclose(adv[:4], _trl_advantages(torch.nan_to_num(r), 4, scale)[:4])


def test_all_none_rows_are_marked_and_left_out_of_reward():
    def half(prompts, completions, **kw):
        return [None if i % 2 else float(i) for i in range(len(completions))]

    def none(prompts, completions, **kw):
        return [None] * len(completions)

    funcs = [RewardFunction("half", half, 2.0), RewardFunction("none", none, 1.0)]
    per_func, total = compute_rewards(funcs, ["p"] * 4, ["a", "b", "c", "d"], [[1]] * 4, {})
    assert total.tolist() == [0.0, 0.0, 4.0, 0.0]  # nansum, as TRL's weighted sum
    scored = scorable_totals(per_func, total)
    assert scored[[0, 2]].tolist() == [0.0, 4.0] and scored[[1, 3]].isnan().all()
    m = reward_metrics(funcs, per_func, total)
    assert m["reward"] == 2.0  # mean of 0 and 4; rows 1 and 3 (every function None) are not zeros
    assert m["reward_std"] == pytest.approx(torch.tensor([0.0, 4.0]).std().item())  # over the batch, TRL's
    assert math.isnan(m["rewards/none/mean"])


def test_trl_nanstd_agrees_where_trl_is_installed():
    trl_utils = pytest.importorskip("trl.trainer.utils")
    from lowmem_grpo.rewards import nan_std
    x = torch.tensor([[1.0, NAN, 0.0, 3.0], [NAN, NAN, NAN, 2.0], [1.0, 1.0, 1.0, 1.0]])
    torch.testing.assert_close(nan_std(x, dim=1), trl_utils.nanstd(x, dim=1), equal_nan=True)
    torch.testing.assert_close(nan_std(x), trl_utils.nanstd(x))


# ----------------------------------------------------------------- reward kwargs and metric names

SEEN = []


def state_reader(prompts, completions, completion_ids, label, trainer_state, log_metric, log_extra, **kw):
    """A TRL-style reward function: shapes its reward by training progress and logs extras. Returns
    None for completions without token 7 in half the groups' first members (unscorable rows)."""
    SEEN.append({"global_step": trainer_state.global_step, "epoch": trainer_state.epoch,
                 "max_steps": trainer_state.max_steps, "tokens": trainer_state.num_input_tokens_seen,
                 "type": type(trainer_state).__name__})
    log_metric("progress", trainer_state.global_step / trainer_state.max_steps)
    log_extra("n_ids", [len(ids) for ids in completion_ids])
    return [None if i % 4 == 0 else float(sum(t == lab for t in ids)) for i, (ids, lab) in
            enumerate(zip(completion_ids, label))]


def test_trainer_state_metrics_and_unscored_rows_in_a_run(toy_config):
    SEEN.clear()
    cfg = toy_config("reward_funcs=[tests.training.test_trl_semantics:state_reader]", "max_steps=3")
    trainer = Trainer(cfg)
    seen_tokens = 0
    batches = []
    for _ in range(3):
        gb, _, _ = trainer.run_step()
        b = gb.batch
        seen_tokens += int(b.prompt_mask.sum()) + int(b.completion_mask.sum())
        assert gb.info["num_tokens"] == seen_tokens == trainer.num_input_tokens_seen
        assert torch.equal(b.advantages[::4], torch.zeros(len(b) // 4))  # every function returned None
        batches.append(gb)
    assert [s["global_step"] for s in SEEN] == [0, 1, 2] and {s["max_steps"] for s in SEEN} == {3}
    assert {s["type"] for s in SEEN} == {"TrainerState"}
    # epochs of prompts drawn before each batch (2 prompts of 64 per batch), as TrainerState.epoch
    assert [s["epoch"] for s in SEEN] == pytest.approx([0.0, 2 / 64, 4 / 64])
    info = batches[-1].info
    assert info["progress"] == pytest.approx(2 / 3)
    lengths = batches[-1].batch.completion_mask.sum(1).float()  # TRL's lengths count the EOS token
    assert info["completions/mean_length"] == pytest.approx(lengths.mean().item())
    term = lengths[~batches[-1].batch.is_truncated]
    assert info["completions/mean_terminated_length"] == pytest.approx(term.mean().item() if len(term) else 0.0)


def test_evaluation_passes_trainer_state_and_log_functions(toy_config):
    # TRL calls reward functions the same way in evaluation: one that needs trainer_state / log_metric /
    # log_extra must score held-out prompts too (evaluate() and eval_steps).
    SEEN.clear()
    trainer = Trainer(toy_config("reward_funcs=[tests.training.test_trl_semantics:state_reader]", "max_steps=4"))
    trainer.run_step()
    result = trainer.evaluate()
    assert SEEN[-1]["global_step"] == 1 and SEEN[-1]["type"] == "TrainerState"
    assert result["progress"] == pytest.approx(1 / 4)  # log_metric values reach the evaluation's result


def test_logged_names_are_trls(toy_config, tmp_path):
    SEEN.clear()
    cfg = toy_config("reward_funcs=[tests.training.test_trl_semantics:state_reader]")
    Trainer(cfg).train()
    rows = read_metrics(cfg.output.output_dir)
    for key in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "num_tokens",
                "completions/mean_terminated_length", "completions/min_terminated_length",
                "completions/max_terminated_length", "reward_std", "rewards/state_reader/mean",
                "rewards/state_reader/std", "progress", "frac_zero_advantage_skipped"):
        assert all(key in r for r in rows), key
    assert not any(k in r for r in rows for k in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"))
    assert rows[1]["num_tokens"] > rows[0]["num_tokens"] > 0
    samples = [json.loads(x) for x in open(os.path.join(cfg.output.output_dir, "completions.jsonl"))]
    assert all(isinstance(s["extra"]["n_ids"], int) for s in samples)
    assert samples[0]["reward"] is None  # sample 0 is unscored: no reward, advantage 0
    assert samples[0]["advantage"] == 0.0


def clashing_metric(prompts, completions, log_metric, **kw):
    log_metric("reward", 1.0)
    return [1.0] * len(completions)


def test_log_metric_may_not_overwrite_trainer_metrics(toy_config):
    trainer = Trainer(toy_config("reward_funcs=[tests.training.test_trl_semantics:clashing_metric]"))
    with pytest.raises(ValueError, match=r"logged the metric\(s\) \['reward'\].*choose other names"):
        trainer.run_step()


def test_computed_tokens_count_a_packed_prompt_once():
    # two prompts (lengths 3 and 2, left-padded to 4), two completions each, of 2, 1, 3 and 2 tokens
    pm = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 1], [0, 0, 1, 1], [0, 0, 1, 1]], dtype=torch.bool)
    pid = torch.tensor([[0, 5, 6, 7], [0, 5, 6, 7], [0, 0, 8, 9], [0, 0, 8, 9]])
    cm = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    mb = Batch(pid, pm, torch.ones(4, 3, dtype=torch.long), cm, torch.zeros(4, dtype=torch.bool))
    assert computed_tokens(mb, Packing.OFF, None) == 3 + 3 + 2 + 2 + 8
    assert computed_tokens(mb, Packing.ALWAYS, None) == 3 + 2 + 8


# ----------------------------------------------------------------- dropout

def test_dropout_is_disabled_so_the_first_ratio_is_one(toy_config):
    # attention dropout 0.5; epsilon 1e-6: any token whose train-mode log-prob differs from its eval-mode
    # old log-prob (in the direction of its advantage) is counted as clipped on the first step.
    conf = json.dumps({**TINY_LLAMA, "attention_dropout": 0.5})
    clipped = {}
    for disable in (True, False):
        trainer = Trainer(toy_config(f"model.config={conf}", "num_iterations=2", "epsilon=1e-6",
                                     f"disable_dropout={disable}"))
        _, step, _ = trainer.run_step()
        clipped[disable] = step["clip_ratio/region_mean"]
        if disable:
            assert trainer.policy.model.layers[0].self_attn.attention_dropout == 0.0
    assert clipped[True] == 0.0 and clipped[False] > 0.05, clipped


def test_disable_dropout_reaches_modules_attributes_and_config():
    from lowmem_grpo.config import ModelConfig
    from lowmem_grpo.policy.model import load_model
    conf = {"model_type": "gpt2", "vocab_size": 40, "n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 32,
            "resid_pdrop": 0.3, "embd_pdrop": 0.3, "attn_pdrop": 0.3, "bos_token_id": 1, "eos_token_id": 1}
    x = torch.randint(0, 40, (2, 10))
    for disable in (True, False):
        model = load_model(ModelConfig(config=dict(conf), disable_dropout=disable), seed=0)
        model.train()
        a, b = model(x).logits, model(x).logits
        assert torch.equal(a, b) == disable
        assert (model.config.resid_pdrop == 0.0) == disable


# ----------------------------------------------------------------- learning-rate schedules

KWARGS = {"cosine_with_min_lr": {"min_lr_rate": 0.1}, "cosine_warmup_with_min_lr": {"min_lr_rate": 0.1},
          "warmup_stable_decay": {"num_decay_steps": 4}, "cosine_with_restarts": {"num_cycles": 2}}


def _lrs(scheduler, n):
    out = []
    for _ in range(n):
        out.append(scheduler.get_last_lr()[0])
        scheduler.optimizer.step()
        scheduler.step()
    return out


def _opt(lr=0.5):
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=lr)


@pytest.mark.parametrize("name", LR_SCHEDULES)
def test_schedules_follow_transformers(name):
    from transformers import get_scheduler
    warm = {"warmup_steps": 3} if name != "constant" else {}
    cfg = OptimConfig(learning_rate=0.5, lr_scheduler_type=name, lr_scheduler_kwargs=KWARGS.get(name), **warm)
    ours = _lrs(build_scheduler(_opt(), cfg, 12), 12)
    theirs = _lrs(get_scheduler(name, _opt(), num_warmup_steps=warm.get("warmup_steps", 0), num_training_steps=12,
                                scheduler_specific_kwargs=KWARGS.get(name)), 12)
    assert ours == theirs
    # resume: a fresh scheduler loaded from the state after 5 steps continues the same sequence
    first = build_scheduler(_opt(), cfg, 12)
    _lrs(first, 5)
    second = build_scheduler(_opt(), cfg, 12)
    second.load_state_dict(first.state_dict())
    assert _lrs(second, 7) == ours[5:]


def test_schedule_values_by_hand():
    lin = _lrs(build_scheduler(_opt(1.0), OptimConfig(learning_rate=1.0, lr_scheduler_type="linear",
                                                      warmup_steps=2), 6), 6)
    assert lin == pytest.approx([0.0, 0.5, 1.0, 0.75, 0.5, 0.25])  # warm-up from 0, then to 0 at max_steps
    assert _lrs(build_scheduler(_opt(1.0), OptimConfig(learning_rate=1.0), 4), 4) == [1.0] * 4
    ratio = _lrs(build_scheduler(_opt(1.0), OptimConfig(learning_rate=1.0, lr_scheduler_type="constant_with_warmup",
                                                        warmup_ratio=0.25), 10), 4)
    assert ratio == pytest.approx([0.0, 1 / 3, 2 / 3, 1.0])  # ceil(0.25 * 10) = 3 warm-up steps


def test_constant_with_warmup_is_an_error_naming_the_fix(toy_config):
    with pytest.raises(ConfigError, match=r"constant has no warm-up.*lr_scheduler_type=constant_with_warmup"):
        toy_config("lr_scheduler_type=constant", "warmup_steps=5")
    with pytest.raises(ConfigError, match=r"lr_scheduler_type must be one of.*did you mean 'cosine'"):
        toy_config("lr_scheduler_type=cosin")
    with pytest.raises(ValueError, match=r"lr_scheduler_kwargs=.*min_lr"):
        build_scheduler(_opt(), OptimConfig(lr_scheduler_type="cosine_with_min_lr"), 10)


def test_trainer_logs_the_schedule(toy_config):
    cfg = toy_config("lr_scheduler_type=linear", "warmup_steps=1", "max_steps=3", "learning_rate=0.03")
    Trainer(cfg).train()
    assert [r["learning_rate"] for r in read_metrics(cfg.output.output_dir)] == pytest.approx([0.0, 0.03, 0.015])
