"""Skipping zero-advantage completions (train.skip_zero_advantage) changes no parameter: with beta == 0
their gradient is exactly zero, the loss denominators still count them and the optimizer still steps."""

import pytest
import torch

from lowmem_grpo.policy.batch import Batch
from lowmem_grpo.training.generation import compute_advantages
from lowmem_grpo.training.micro_batch import skipped_rows_scale, trained_rows
from lowmem_grpo.training.metrics import read_metrics
from lowmem_grpo.training.trainer import Trainer
from tests.optional import needs_bitsandbytes


def half_constant(prompts, completion_ids, label, **kwargs):
    """0 for prompts with an even label (a zero-std group: skipped), else the count of even tokens."""
    return [0.0 if lab % 2 == 0 else float(sum(t % 2 == 0 for t in ids)) for ids, lab in zip(completion_ids, label)]


def _train(toy_config, tmp_path, name, skip, *overrides):
    cfg = toy_config(f"skip_zero_advantage={skip}", "reward_funcs=[tests.training.test_zero_advantage:half_constant]",
                     *overrides, output_dir=tmp_path / name)
    trainer = Trainer(cfg)
    trainer.train()
    return trainer, read_metrics(cfg.output.output_dir)


def _assert_same_run(a, b, rows_a, rows_b, atol):
    for (k, p), (_, q) in zip(a.policy.named_parameters(), b.policy.named_parameters()):
        torch.testing.assert_close(p.float(), q.float(), rtol=0, atol=atol, msg=k)
    for ra, rb in zip(rows_a, rows_b):
        for key in ("loss", "reward", "clip_ratio/region_mean", "grad_norm"):
            assert ra[key] == pytest.approx(rb[key], rel=1e-4, abs=1e-6), key


# Partial skips inside a micro-batch and fully skipped micro-batches are exercised (about half the
# prompts give a zero-std group); the logs are checked for a skipped fraction strictly between 0 and 1.
# Steps with every completion skipped have their own test below.
CASES = {
    "grpo": ["loss_type=grpo"],
    "bnpo": ["loss_type=bnpo"],
    "dapo-accumulation": ["loss_type=dapo", "per_device_train_batch_size=4", "gradient_accumulation_steps=2"],
    "dr_grpo": ["loss_type=dr_grpo"],
    "gspo-mu2": ["loss_type=grpo", "importance_sampling_level=sequence", "num_iterations=2", "epsilon=0.05"],
    "dapo-mu2-steps2": ["loss_type=dapo", "num_iterations=2", "per_device_train_batch_size=4",
                        "steps_per_generation=2", "epsilon=0.05"],
}


@pytest.mark.parametrize("case", CASES)
def test_skipping_gives_the_same_parameters(toy_config, tmp_path, case):
    common = ["max_steps=4", "max_completion_length=4", "beta=0.0", *CASES[case]]
    skipped, rows_s = _train(toy_config, tmp_path, "skip", True, *common)
    plain, rows_p = _train(toy_config, tmp_path, "plain", False, *common)
    fractions = [r["frac_zero_advantage_skipped"] for r in rows_s]
    assert any(0 < f < 1 for f in fractions), fractions  # the test must exercise skipping
    assert all(r["frac_zero_advantage_skipped"] == 0 for r in rows_p)
    # 1e-4: 10% of one Adam step at the toy's learning rate (1e-3). The two runs sum their rows in different
    # shapes, and Adam divides a near-zero gradient's rounding by its own size (seed- and CPU-dependent: up to
    # 3e-6 seen on an Intel Xeon, 1.4e-5 on an AMD EPYC Zen 3); a row skipped that should count, or counted
    # twice, moves a parameter by whole steps.
    _assert_same_run(skipped, plain, rows_s, rows_p, atol=1e-4)


@needs_bitsandbytes
@pytest.mark.parametrize("precision, in_backward", [("fp32", True), ("bf16_sr", False), ("bf16_sr", True)])
def test_skipping_gives_the_same_parameters_optim(toy_config, tmp_path, precision, in_backward):
    common = ["max_steps=4", "max_completion_length=4", "beta=0.0", "optimizer=adamw_8bit", f"precision={precision}",
              f"optimizer_in_backward={in_backward}", "per_device_train_batch_size=4", "steps_per_generation=2",
              "num_iterations=2", "learning_rate=1e-2"]
    skipped, rows_s = _train(toy_config, tmp_path, "skip", True, *common)
    plain, rows_p = _train(toy_config, tmp_path, "plain", False, *common)
    assert any(0 < r["frac_zero_advantage_skipped"] < 1 for r in rows_s)
    # bf16 weights: stochastic rounding draws from the global RNG in the order parameters are updated,
    # which is the same in both runs; any drift would show as whole bf16 ulps.
    _assert_same_run(skipped, plain, rows_s, rows_p, atol=1e-6 if precision == "fp32" else 0)


def informative_then_constant(prompts, completions, completion_ids, label, **kwargs):
    """The toy label reward for the first two generation batches, then 1.0 for everything."""
    informative_then_constant.calls += 1
    if informative_then_constant.calls > 2:
        return [1.0] * len(completion_ids)
    return [float(sum(t == lab for t in ids)) for ids, lab in zip(completion_ids, label)]


@pytest.mark.parametrize("in_backward", [False, pytest.param(True, marks=needs_bitsandbytes)])
def test_steps_with_every_completion_skipped_still_move_adam(toy_config, tmp_path, in_backward):
    # Steps 3 and 4 have every advantage at 0: nothing is computed, yet Adam moves on its momentum,
    # exactly as the plain run's zero-gradient steps do.
    runs, after_2 = {}, {}
    for skip in (True, False):
        informative_then_constant.calls = 0
        common = ["max_steps=4", "learning_rate=1e-2", f"optimizer_in_backward={in_backward}",
                  "reward_funcs=[tests.training.test_zero_advantage:informative_then_constant]"]
        cfg = toy_config(f"skip_zero_advantage={skip}", *common, output_dir=tmp_path / str(skip))
        trainer = Trainer(cfg)
        real_step = trainer.optimizer_step

        def step_and_snapshot(trainer=trainer, real_step=real_step, skip=skip):
            out = real_step()
            if trainer.step == 1:  # the loop increments after this returns: weights after step 2
                after_2[skip] = {k: p.detach().clone() for k, p in trainer.policy.named_parameters()}
            return out

        trainer.optimizer_step = step_and_snapshot
        trainer.train()
        runs[skip] = (trainer, read_metrics(cfg.output.output_dir))
    (skipped, rows_s), (plain, rows_p) = runs[True], runs[False]
    assert [r["frac_zero_advantage_skipped"] for r in rows_s][2:] == [1.0, 1.0]
    moved = [k for k, p in skipped.policy.named_parameters() if not torch.equal(p, after_2[True][k])]
    assert moved, "Adam did not step on the all-skipped steps"
    _assert_same_run(skipped, plain, rows_s, rows_p, atol=1e-6)


def test_equal_rewards_give_exact_zero_advantages():
    # Eight rewards of 0.7: their float32 mean misses 0.7 by an ulp, which TRL's formula divides by
    # (std + 1e-4) into advantages of ~6e-4 that are pure rounding noise.
    r = torch.tensor([0.7] * 8 + [0.0, 1.0, 3.0, 0.0, 1.0, 3.0, 0.0, 1.0])
    grouped = r.view(2, 8)
    naive = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)
    assert naive[0].abs().max() > 1e-4  # the noise this guards against
    adv, _ = compute_advantages(r, 8, "group")
    assert torch.equal(adv[:8], torch.zeros(8))
    torch.testing.assert_close(adv[8:], naive[1])


def test_denominator_scale_per_loss_type():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    mb = Batch(torch.zeros(4, 2, dtype=torch.long), torch.ones(4, 2, dtype=torch.bool), torch.zeros(4, 4, dtype=torch.long),
               mask, torch.zeros(4, dtype=torch.bool), advantages=torch.tensor([0.0, 1.0, 0.0, -2.0]))
    keep = torch.tensor([False, True, False, True])
    assert skipped_rows_scale(mb, keep, "grpo") == 2 / 4  # sequences kept / sequences
    assert skipped_rows_scale(mb, keep, "dr_grpo") == 2 / 4
    assert skipped_rows_scale(mb, keep, "bnpo") == 5 / 10  # tokens kept / tokens
    assert skipped_rows_scale(mb, keep, "dapo") == 1.0  # its denominator is global already


def test_nothing_skipped_with_a_kl_term(toy_config):
    trainer = Trainer(toy_config("beta=0.1"), training=False)
    mb = Batch(torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1, dtype=torch.bool), torch.zeros(2, 1, dtype=torch.long),
               torch.ones(2, 1, dtype=torch.bool), torch.zeros(2, dtype=torch.bool), advantages=torch.zeros(2))
    assert trained_rows(mb, trainer.cfg.train).all()  # the KL term has a gradient even where A == 0


def test_equal_scored_rewards_with_unscored_members_give_exact_zeros():
    # Unscored completions (NaN: no reward function scored them) are left out of the equality test too:
    # the six scored members agree, so the whole group is skippable.
    r = torch.tensor([0.7] * 6 + [float("nan")] * 2 + [0.0, 1.0, float("nan"), 1.0, 0.0, 1.0, 3.0, 0.0])
    adv, std = compute_advantages(r, 8, "group")
    assert torch.equal(adv[:8], torch.zeros(8)) and torch.isfinite(adv).all()
    assert adv[10] == 0 and (adv[8:] != 0).sum() == 7
