"""generation.rollout_quantization in the trainer: rollouts sampled from the compact copy (policy/compact.py),
its log-probs as the sampling log-probs, the importance-sampling correction, the copy quantized again before
each generation batch."""

import json

import pytest
import torch

from lowmem_grpo.config import ConfigError
from lowmem_grpo.policy.compact import CompactPolicy
from lowmem_grpo.policy.logprobs import completion_logprobs
from lowmem_grpo.training.trainer import Trainer


def test_the_trainer_samples_from_the_copy_and_corrects_for_it(toy_config, tmp_path):
    trainer = Trainer(toy_config("rollout_quantization=int8", "max_steps=2", "beta=0.04",
                                 output_dir=tmp_path / "int8"))
    compact = trainer.rollout.compact
    assert isinstance(compact, CompactPolicy)
    q = compact.model.model.layers[0].self_attn.q_proj.qweight.clone()
    trainer.generation = trainer.new_generation_batch()
    sampled, temperature = trainer.generation.batch, trainer.cfg.generation.temperature
    again = completion_logprobs(compact.head, sampled, temperature=temperature, micro_batch=8, device=trainer.device,
                                autocast_bf16=trainer.autocast)
    torch.testing.assert_close(sampled.sampling_logp, again, rtol=0, atol=0)  # the copy's own log-probs
    assert not torch.equal(sampled.old_logp, again)  # which are not the policy's: the loss corrected for them
    assert sampled.is_weight is not None and 0 < trainer.generation.info["sampling/importance_sampling_ratio/mean"] < 2
    trainer.run_step()
    assert torch.equal(q, compact.model.model.layers[0].self_attn.q_proj.qweight)  # not yet quantized again
    trainer.run_step()  # a new generation batch: the copy quantized from the updated weights first
    assert not torch.equal(q, compact.model.model.layers[0].self_attn.q_proj.qweight)


def test_it_runs_end_to_end_with_the_correction_metrics(toy_config, tmp_path):
    trainer = Trainer(toy_config("rollout_quantization=int8", "max_steps=2", output_dir=tmp_path / "e2e"))
    trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "e2e" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward" in r]
    assert len(steps) == 2
    assert all(0 < r["sampling/importance_sampling_ratio/mean"] < 2 for r in steps)


def test_the_setting_is_refused_with_vllm(toy_config):
    with pytest.raises(ConfigError, match="rollout_quantization=int8 is the native engine's compact copy"):
        toy_config("rollout_quantization=int8", "engine=vllm")


def test_the_planner_counts_the_copy_in_every_phase_and_its_log_prob_pass(toy_config, tmp_path):
    from lowmem_grpo.memory.plan import Arch, compact_copy_bytes, plan
    trainer = Trainer(toy_config("rollout_quantization=int8", output_dir=tmp_path / "plan"))
    arch = Arch.from_config(trainer.policy.config)
    assert compact_copy_bytes(arch, 4) == trainer.rollout.compact.nbytes()  # fp32 weights: fp32 scales
    planned = plan(trainer.cfg, arch, autocast=trainer.autocast, device="cpu")
    assert "sampler log-probs" in planned.phases and "old log-probs" in planned.phases  # the correction's pass
    assert all(cats["rollout copy"] == compact_copy_bytes(arch, 4) for cats in planned.phase_categories.values())
    plain = plan(toy_config(output_dir=tmp_path / "plain"), arch, autocast=trainer.autocast, device="cpu")
    assert "sampler log-probs" not in plain.phases and "rollout copy" not in plain.categories
