"""End-to-end trainer behaviour on a tiny random Llama: smoke, loss parity, resume, stop/save paths."""

import json
import math
import os
import signal

import pytest
import torch
import torch.nn.functional as F

from lowmem_grpo.training.checkpoint import list_checkpoints
from lowmem_grpo.training.metrics import read_metrics
from lowmem_grpo.policy.model import position_ids_for
from lowmem_grpo.policy.batch import Batch
from lowmem_grpo.training.generation import compute_advantages
from lowmem_grpo.training.trainer import Trainer, TrainingStopped
from tests.optional import needs_bitsandbytes
from .conftest import train_until_stopped

REQUIRED_METRICS = ["step", "reward", "reward_std", "frac_reward_zero_std", "rewards/label_reward/mean", "kl",
                    "entropy", "clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_mean",
                    "completions/mean_length", "completions/clipped_ratio", "completions/mean_terminated_length",
                    "num_tokens", "loss", "grad_norm", "learning_rate", "step_time", "tokens_per_second",
                    "peak_memory_bytes"]
TIMING = {"step_time", "generation_time", "tokens_per_second", "peak_memory_bytes"}


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


@pytest.mark.parametrize("optimizer, precision, in_backward", [
    ("adamw", "fp32", False), *(pytest.param(*p, marks=needs_bitsandbytes) for p in (
        ("adamw_8bit", "fp32", False), ("adamw_8bit", "bf16_sr", False), ("adamw_8bit", "bf16_sr", True)))])
def test_smoke_two_steps_change_every_parameter(toy_config, optimizer, precision, in_backward):
    cfg = toy_config(f"optimizer={optimizer}", f"precision={precision}", "beta=0.04", "num_iterations=2",
                     f"optimizer_in_backward={in_backward}")
    trainer = Trainer(cfg)
    expected = torch.bfloat16 if precision == "bf16_sr" else torch.float32
    assert all(p.dtype == expected for p in trainer.policy.parameters())
    assert all(p.dtype == expected for p in trainer.ref.model.parameters())
    before = snapshot(trainer.policy)
    trainer.train()
    after = snapshot(trainer.policy)
    unchanged = [k for k in before if torch.equal(before[k], after[k])]
    assert not unchanged, f"parameters not updated: {unchanged}"
    rows = read_metrics(cfg.output.output_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        for key in REQUIRED_METRICS:
            assert key in row and row[key] is not None and math.isfinite(row[key]), (key, row.get(key))
    assert rows[1]["kl"] > 0  # beta > 0 and the policy moved once before the second step's loss
    samples = [json.loads(x) for x in open(os.path.join(cfg.output.output_dir, "completions.jsonl"))]
    assert samples and {"prompt", "completion", "reward", "rewards", "advantage"} <= samples[0].keys()
    assert list_checkpoints(cfg.output.output_dir)[-1][0] == 2


def test_advantages_match_trl_formula():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    adv, std = compute_advantages(r, 4, "group")
    s = torch.tensor([1.0, 0.0, 0.0, 0.0]).std()  # unbiased: 0.5
    expected = torch.tensor([0.75, -0.25, -0.25, -0.25]) / (s + 1e-4)
    torch.testing.assert_close(adv[:4], expected)
    assert torch.equal(adv[4:], torch.zeros(4)) and std[1] == 0
    adv_none, _ = compute_advantages(r, 4, "none")
    torch.testing.assert_close(adv_none[:4], torch.tensor([0.75, -0.25, -0.25, -0.25]))
    adv_batch, _ = compute_advantages(r, 4, "batch")
    torch.testing.assert_close(adv_batch, (r - torch.tensor([0.25] * 4 + [2.0] * 4)) / (r.std() + 1e-4))


def _reference_loss(model, mb: Batch, loss_type, level, beta, eps, eps_high, temperature, max_len, num_items):
    """TRL's GRPO loss written out from full logits: the spec the fused path must equal."""
    ids = torch.cat([mb.prompt_ids, mb.completion_ids], 1)
    att = torch.cat([mb.prompt_mask, mb.completion_mask], 1)
    logits = model(input_ids=ids, attention_mask=att, position_ids=position_ids_for(att)).logits.float()
    P, C = mb.prompt_ids.shape[1], mb.completion_ids.shape[1]
    logits = logits[:, P - 1:P + C - 1] / temperature  # positions predicting the completion
    logp = F.log_softmax(logits, -1).gather(-1, mb.completion_ids[..., None]).squeeze(-1)  # (B, C)
    m = mb.completion_mask.float()
    A = mb.advantages[:, None]
    log_ratio = logp - (logp.detach() if mb.old_logp is None else mb.old_logp)
    if level == "sequence":
        log_ratio = ((log_ratio * m).sum(-1) / m.sum(-1))[:, None]
    rho = log_ratio.exp()
    per_token = -torch.min(rho * A, rho.clamp(1 - eps, 1 + eps_high) * A)
    if beta:
        d = mb.ref_logp - logp
        per_token = per_token + beta * (d.exp() - d - 1)
    if loss_type == "grpo":
        return ((per_token * m).sum(-1) / m.sum(-1)).mean()
    if loss_type == "bnpo":
        return (per_token * m).sum() / m.sum()
    if loss_type == "dapo":
        return (per_token * m).sum() / num_items
    return (per_token * m).sum() / (m.shape[0] * max_len)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_loss_parity_with_reference_formula(toy_config, loss_type, level):
    # the plain k3 KL of the formula below (the bias-corrected one, TRL's default, is checked against TRL in
    # test_loss_variants_vs_trl.py)
    cfg = toy_config(f"loss_type={loss_type}", f"importance_sampling_level={level}", "beta=0.1", "epsilon=0.1",
                     "epsilon_high=0.3", "temperature=0.7", "num_iterations=2", "use_bias_correction_kl=false")
    trainer = Trainer(cfg)
    gb = trainer.new_generation_batch()
    batch = gb.batch
    # Move the stored old/ref log-probs off the current policy so ratios and clipping are exercised.
    g = torch.Generator().manual_seed(0)
    batch.old_logp = batch.old_logp + 0.6 * torch.randn(batch.old_logp.shape, generator=g) * batch.completion_mask
    batch.ref_logp = batch.ref_logp + 0.2 * torch.randn(batch.ref_logp.shape, generator=g) * batch.completion_mask
    batch.advantages = torch.randn(len(batch), generator=g)  # non-zero everywhere, whatever was sampled
    mb = batch.rows(0, 8)
    num_items = int(batch.completion_mask.sum()) + 5  # a global denominator different from this micro-batch's
    loss, metrics = trainer.micro_batch_loss(mb, num_items)
    loss.backward()
    grads = {k: p.grad.clone() for k, p in trainer.policy.named_parameters()}
    trainer.policy.zero_grad()
    ref = _reference_loss(trainer.policy, mb, loss_type, level, 0.1, 0.1, 0.3, 0.7, 6, num_items)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    for k, p in trainer.policy.named_parameters():
        torch.testing.assert_close(grads[k], p.grad, rtol=1e-4, atol=1e-6, msg=k)
    assert 0 < metrics["clip_ratio"] < 1


def _run(cfg):
    trainer = Trainer(cfg)
    trainer.train()
    return trainer


@needs_bitsandbytes  # every case uses adamw_8bit
@pytest.mark.parametrize("precision, in_backward, reference", [("fp32", False, "cpu"), ("bf16_sr", False, "cpu"),
                                                               ("bf16_sr", True, "stream")])
def test_resume_gives_identical_parameters_and_metrics(toy_config, tmp_path, precision, in_backward, reference):
    # num_iterations=2 and steps_per_generation=2: checkpoint 2 falls inside a generation batch, so resume
    # must restore the stored completions, old/ref log-probs, RNG (stochastic rounding draws from it too),
    # optimizer, scheduler and data position.
    common = ["max_steps=4", "num_iterations=2", "beta=0.05", "per_device_train_batch_size=4",
              "steps_per_generation=2", "lr_scheduler_type=cosine", "warmup_steps=1", "optimizer=adamw_8bit",
              f"precision={precision}", f"optimizer_in_backward={in_backward}", f"reference_compute={reference}"]
    straight = _run(toy_config(*common, output_dir=tmp_path / "a"))
    interrupted = Trainer(toy_config(*common, output_dir=tmp_path / "b"))
    train_until_stopped(interrupted, 2)
    resumed = Trainer(toy_config(*common, "resume_from=latest", output_dir=tmp_path / "b"))
    assert resumed.step == 2 and resumed.generation is not None and resumed.generation.steps_done == 2
    resumed.train()
    for (k, a), (_, b) in zip(straight.policy.named_parameters(), resumed.policy.named_parameters()):
        assert torch.equal(a, b), k
    rows_a = read_metrics(tmp_path / "a")
    rows_b = read_metrics(tmp_path / "b")
    assert [r["step"] for r in rows_b] == [1, 2, 3, 4]
    for ra, rb in zip(rows_a, rows_b):
        assert {k: v for k, v in ra.items() if k not in TIMING} == {k: v for k, v in rb.items() if k not in TIMING}


def test_keeps_last_k_checkpoints_and_each_loads(toy_config):
    from transformers import AutoModelForCausalLM
    cfg = toy_config("max_steps=4", "save_steps=1", "save_total_limit=2")
    trainer = _run(cfg)
    found = list_checkpoints(cfg.output.output_dir)
    assert [s for s, _ in found] == [3, 4]
    assert not [p for p in os.listdir(cfg.output.output_dir) if p.startswith(".tmp")]
    loaded = AutoModelForCausalLM.from_pretrained(found[-1][1])
    for (k, a), (_, b) in zip(trainer.policy.named_parameters(), loaded.named_parameters()):
        assert torch.equal(a, b), k


def _sigint_at_second_call(prompts, completions, completion_ids, label, **kwargs):
    _sigint_at_second_call.calls += 1
    if _sigint_at_second_call.calls == 2:
        os.kill(os.getpid(), signal.SIGINT)  # as if the user pressed Ctrl-C during step 2
    return [float(sum(t == lab for t in ids)) for ids, lab in zip(completion_ids, label)]


def test_ctrl_c_saves_then_exits(toy_config, monkeypatch):
    import tests.training.test_trainer as me
    me._sigint_at_second_call.calls = 0
    cfg = toy_config("max_steps=10", "reward_funcs=[tests.training.test_trainer:_sigint_at_second_call]")
    result = Trainer(cfg).train()
    assert result["stopped_by"] == "SIGINT" and result["step"] == 2
    assert [s for s, _ in list_checkpoints(cfg.output.output_dir)] == [2]
    resumed = Trainer(toy_config("max_steps=3", "resume_from=latest"))
    assert resumed.step == 2


def test_crash_mid_run_saves_what_it_has(toy_config, monkeypatch):
    trainer = Trainer(toy_config("max_steps=10"))
    real = trainer.new_generation_batch
    calls = {"n": 0}

    def failing():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("disk on fire")
        return real()

    monkeypatch.setattr(trainer, "new_generation_batch", failing)
    with pytest.raises(RuntimeError, match="disk on fire"):
        trainer.train()
    assert [s for s, _ in list_checkpoints(trainer.cfg.output.output_dir)] == [2]


@pytest.mark.parametrize("in_backward", [False, True])
def test_nonfinite_steps_are_skipped_then_stop_with_checkpoint(toy_config, monkeypatch, in_backward):
    trainer = Trainer(toy_config("max_steps=10", "max_nonfinite_steps=3", f"optimizer_in_backward={in_backward}"))
    before = snapshot(trainer.policy)
    real = trainer.micro_batch_loss
    monkeypatch.setattr(trainer, "micro_batch_loss",
                        lambda mb, n, **kw: (lambda loss, m: (loss * float("nan"), m))(*real(mb, n, **kw)))
    with pytest.raises(TrainingStopped, match="3 optimizer steps in a row had a non-finite loss"):
        trainer.train()
    after = snapshot(trainer.policy)
    assert all(torch.equal(before[k], after[k]) for k in before)  # skipped steps never touched the weights
    rows = read_metrics(trainer.cfg.output.output_dir)
    assert [r["skipped"] for r in rows] == [1, 1, 1]
    assert [s for s, _ in list_checkpoints(trainer.cfg.output.output_dir)] == [3]


def test_eval_reports_rewards_and_pass_rate(toy_config):
    trainer = Trainer(toy_config(), training=False)
    result = trainer.evaluate()
    assert result["samples"] == 8 and "rewards/label_reward/mean" in result and "pass_rate/label_reward" in result


def test_tensorboard_logging(toy_config):
    cfg = toy_config("max_steps=1", "report_to=tensorboard")
    Trainer(cfg).train()
    events = list((__import__("pathlib").Path(cfg.output.output_dir) / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


def test_library_messages_go_through_logging(toy_config, tmp_path):
    # `logging`, not print: a notebook or a service can route or silence them (issue 13).
    import logging

    class Collect(logging.Handler):
        def __init__(self):
            super().__init__()
            self.messages = []

        def emit(self, record):
            self.messages.append((record.name, record.getMessage()))

    collect = Collect()
    library = logging.getLogger("lowmem_grpo")
    assert not library.propagate and library.level == logging.INFO  # the default: INFO to stderr, once
    library.addHandler(collect)
    try:
        Trainer(toy_config("max_steps=2", output_dir=tmp_path / "run")).train()
        Trainer(toy_config("max_steps=3", "resume_from=latest", output_dir=tmp_path / "run")).train()
    finally:
        library.removeHandler(collect)
    texts = [m for _, m in collect.messages]
    assert any(m.startswith("saved ") and "checkpoint-2" in m for m in texts), texts
    assert any(m.startswith("resumed from ") and m.endswith("at step 2") for m in texts), texts
    assert {name for name, _ in collect.messages} <= {"lowmem_grpo.training.trainer", "lowmem_grpo.training.plot"}
