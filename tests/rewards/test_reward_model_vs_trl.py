"""Reward models scored by TRL's GRPOTrainer (TRL 1.16, `_calculate_rewards`) and by ours, on the same
completions: plain-text and conversational prompts, a random reward model and one trained to like the
letter e, mixed with a reward function and weights. Needs TRL (the `bench` extra; `make test-compare`)."""

import importlib.util

import pytest
import torch

from lowmem_grpo.policy.char_tokenizer import char_tokenizer
from lowmem_grpo.rewards import ModelSettings, compute_rewards, load_reward_functions

from .tiny_reward_models import e_reward_model, random_reward_model

pytestmark = pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="needs trl (pip install '.[bench]')")

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"


def digits(completions, **kwargs):
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [float(sum(ch.isdigit() for ch in t)) for t in texts]


def _trl_scores(tmp_path, rm_folder, tokenizer, prompts, completions, weights):
    from datasets import Dataset
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from trl import GRPOConfig, GRPOTrainer
    torch.manual_seed(0)
    policy = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                                          num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                          pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id))
    args = GRPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=4, num_generations=4,
                      report_to="none", use_cpu=True, bf16=False, reward_weights=weights)
    trainer = GRPOTrainer(model=policy, reward_funcs=[str(rm_folder), digits], args=args,
                          train_dataset=Dataset.from_dict({"prompt": ["x"] * 4}), processing_class=tokenizer,
                          reward_processing_classes=[tokenizer, None])
    inputs = [{"prompt": p} for p in prompts]
    per_func = trainer._calculate_rewards(inputs, prompts, completions, [[1]] * len(prompts))
    return per_func.cpu(), trainer.reward_func_names


@pytest.mark.parametrize("trained", [False, True])
@pytest.mark.parametrize("conversational", [False, True])
def test_our_scores_are_trls(tmp_path, trained, conversational):
    rm_folder, tok_folder = (e_reward_model(tmp_path, steps=60) if trained else random_reward_model(tmp_path))
    tokenizer = char_tokenizer()
    tokenizer.chat_template = TEMPLATE
    if conversational:
        prompts = [[{"role": "user", "content": q}] for q in ("2+2?", "owl mud:", "say e", "12*3")]
        completions = [[{"role": "assistant", "content": c}] for c in ("4", "eee e", "e e e e e e e", "36 x")]
    else:
        prompts = ["2+2=", "owl mud:", "say e ", "12*3="]
        completions = ["4", "eee e", "e e e e e e e", "36 x"]
    weights = [2.0, 0.5]
    trl_per_func, names = _trl_scores(tmp_path, rm_folder, tokenizer, prompts, completions, weights)
    funcs = load_reward_functions([str(rm_folder), digits], weights,
                                  models=ModelSettings(placement="stream", batch_size=3,
                                                       processing_classes=[tokenizer, None]))
    per_func, total = compute_rewards(funcs, prompts, completions, [[1]] * 4, {})
    assert [f.name for f in funcs] == names  # TRL's label: the model folder's last name
    assert torch.allclose(per_func, trl_per_func, atol=1e-5, rtol=1e-5), (per_func, trl_per_func)
    assert torch.allclose(total, (trl_per_func * torch.tensor(weights)).sum(1), atol=1e-5)
