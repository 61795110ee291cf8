"""Tiny random models and task files for trainer tests (CPU, seconds each)."""

import json

import pytest

from lowmem_grpo.config import load_config

# vocab 32: 0 pad, 1 eos, 2 <think>, 3 </think>, 4 <answer>, 5 </answer>, 6..31 ordinary tokens
TINY_LLAMA = {"model_type": "llama", "vocab_size": 32, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64, "tie_word_embeddings": True, "bos_token_id": None,
              "eos_token_id": 1, "pad_token_id": 0}


def toy_rows(n: int, seed: int = 0) -> list[dict]:
    import random
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        ids = [rng.randrange(6, 32) for _ in range(rng.randint(2, 5))]
        rows.append({"prompt_ids": ids, "label": ids[0]})
    return rows


def write_jsonl(path, rows) -> str:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


def label_reward(prompts, completions, completion_ids, label, **kwargs):
    """Dense toy reward: how often the label token appears (so tiny batches have reward variance)."""
    return [float(sum(t == lab for t in ids)) for ids, lab in zip(completion_ids, label)]


def spread_reward(prompts, completions, completion_ids, label, **kwargs):
    """The toy label reward plus a tie-breaker under 0.01 from the tokens: a group's rewards differ unless its
    completions are the same, so even a batch of two prompts has something to learn, whatever the sampled stream."""
    return [sum(t == lab for t in ids) + 0.01 * (sum((i + 1) * t for i, t in enumerate(ids)) % 97) / 97
            for ids, lab in zip(completion_ids, label)]


@pytest.fixture
def toy_config(tmp_path):
    """A function: overrides -> Config for the toy token task on a tiny random Llama."""
    train = write_jsonl(tmp_path / "train.jsonl", toy_rows(64))
    evalf = write_jsonl(tmp_path / "eval.jsonl", toy_rows(8, seed=1))

    def make(*overrides, output_dir=None):
        base = {
            "model.config": json.dumps(TINY_LLAMA), "model.tokenizer": "none", "data.train_file": train,
            "data.eval_file": evalf, "num_generations": 4, "max_prompt_length": 8, "max_completion_length": 6,
            "per_device_train_batch_size": 8, "max_steps": 2, "learning_rate": 1e-3, "optimizer": "adamw",
            "reward_funcs": "[tests.training.conftest:label_reward]", "output_dir": str(output_dir or tmp_path / "run"),
            "progress_bar": "false", "save_steps": 0, "device": "cpu",  # CUDA paths have their own tests
        }
        items = [f"{k}={v}" for k, v in base.items()] + list(overrides)
        return load_config(None, items)

    return make


def train_until_stopped(trainer, stop_after: int) -> None:
    """trainer.train(), stopped (as a signal would stop it: a checkpoint, then return) once `stop_after`
    optimizer steps are done."""
    real_step = trainer.optimizer_step

    def step_then_stop():
        out = real_step()
        if trainer.step == stop_after - 1:  # the loop counts this step after it returns
            trainer.stop.request("test")
        return out

    trainer.optimizer_step = step_then_stop
    assert trainer.train()["step"] == stop_after
