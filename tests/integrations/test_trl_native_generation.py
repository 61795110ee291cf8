"""The TRL drop-in's rollouts on lowmem-grpo's native engine: at top_k=1 they are TRL's generate() path's
tokens, EOS cut included; sampled, the first token follows the distribution TRL's settings define (temperature,
top_k, top_p through transformers' own warpers); a training run samples through the engine only; settings
the engine does not take go to TRL's own path, with the reason logged once. Needs TRL; skipped without it."""

import importlib.util
import logging

import pytest
import torch

from tests.integrations.helpers import tiny_qwen2

pytestmark = pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="needs trl (pip install '.[bench]')")

PROMPTS = ["12+7=", "3*4=", "9-5=", "8+8="]


def _trainer(tmp_path, native=True, **config):
    from datasets import Dataset
    from trl import GRPOConfig

    from lowmem_grpo.integrations.trl import GRPOTrainer

    model = tmp_path / "tiny-qwen2"
    tokenizer = tiny_qwen2(model)
    settings = dict(per_device_train_batch_size=4, num_generations=4, max_completion_length=8, max_steps=2,
                    learning_rate=1e-2, report_to="none", logging_steps=1, save_strategy="no", seed=0,
                    use_cpu=True, bf16=False, model_init_kwargs={"dtype": torch.float32})
    args = GRPOConfig(output_dir=str(tmp_path / "out"), **{**settings, **config})
    dataset = Dataset.from_dict({"prompt": PROMPTS * 4})
    return GRPOTrainer(model=str(model), reward_funcs=[lambda completions, **kw: [float(len(c)) for c in completions]],
                       args=args, train_dataset=dataset, processing_class=tokenizer, native_generation=native)


def _make_eos(trainer, token: int) -> None:
    """Make `token` the trainer's EOS for both generation paths (TRL reads its own list and its config)."""
    trainer.eos_token_ids = [token]
    trainer.generation_config.eos_token_id = [token]
    trainer.generation_kwargs["eos_token_id"] = [token]


def _spy(monkeypatch):
    """Counts of calls into the native engine and into TRL's own generation path."""
    import trl

    import lowmem_grpo.integrations.trl_generation as native

    calls = {"native": 0, "trl": 0}
    real_native, real_trl = native.generate, trl.GRPOTrainer._generate_single_turn

    def counted_native(*a, **k):
        calls["native"] += 1
        return real_native(*a, **k)

    def counted_trl(*a, **k):
        calls["trl"] += 1
        return real_trl(*a, **k)

    monkeypatch.setattr(native, "generate", counted_native)
    monkeypatch.setattr(trl.GRPOTrainer, "_generate_single_turn", counted_trl)
    return calls


def test_top_k_1_gives_trls_generate_tokens_and_eos_cut(tmp_path, monkeypatch):
    import trl

    trainer = _trainer(tmp_path, top_k=1)
    prompt_ids, images, fields = trainer._tokenize_prompts([p for p in PROMPTS for _ in range(4)])
    theirs, _ = trl.GRPOTrainer._generate_single_turn(trainer, prompt_ids, images, fields, 4)
    inner = [t for row in theirs for t in row[1:-1]]  # a token some completion has after its first one
    _make_eos(trainer, max(set(inner), key=inner.count))
    theirs, _ = trl.GRPOTrainer._generate_single_turn(trainer, prompt_ids, images, fields, 4)
    calls = _spy(monkeypatch)
    ours, logprobs = trainer._generate_single_turn(prompt_ids, images, fields, 4)
    assert calls == {"native": 1, "trl": 0} and logprobs is None
    assert ours == theirs
    assert any(len(row) < 8 for row in theirs) and all(row[-1] in trainer.eos_token_ids for row in theirs
                                                         if len(row) < 8)


def test_sampled_first_token_follows_trls_settings(tmp_path):
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    trainer = _trainer(tmp_path, temperature=0.7, top_k=6, top_p=0.8, max_completion_length=1)
    with torch.no_grad():
        trainer.model.model.norm.weight.mul_(2.0)  # logits spread enough for the temperature to show
    prompt_ids, _, _ = trainer._tokenize_prompts(["12+7="])
    n = 3000
    torch.manual_seed(1)
    rows, _ = trainer._generate_single_turn(prompt_ids * n, None, {}, n)
    counts = torch.bincount(torch.tensor([row[0] for row in rows]), minlength=trainer.model.config.vocab_size)
    with torch.no_grad():
        ids = torch.tensor(prompt_ids)
        logits = trainer.model(input_ids=ids).logits[:, -1].float()
    warpers = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(6), TopPLogitsWarper(0.8)])
    expected = torch.softmax(warpers(ids, logits), dim=-1)[0]  # generate()'s order: temperature, top-k, top-p
    assert (counts[expected == 0] == 0).all(), "a token outside top-k/top-p was drawn"
    assert (expected > 0).sum() >= 2, "the test needs more than one token to draw from"
    freq = counts.double() / n
    bound = 5 * (expected.double() * (1 - expected.double()) / n).sqrt() + 1e-3
    assert ((freq - expected.double()).abs() <= bound).all(), (freq[expected > 0], expected[expected > 0])


def test_training_samples_through_the_native_engine(tmp_path, monkeypatch):
    calls = _spy(monkeypatch)
    trainer = _trainer(tmp_path)
    trainer.train()
    assert calls["native"] >= 2 and calls["trl"] == 0
    logged = [row for row in trainer.state.log_history if "loss" in row]
    assert len(logged) == 2 and all(torch.isfinite(torch.tensor(row["loss"])) for row in logged)
    assert all(row["completions/max_length"] <= 8 for row in logged)


def test_bf16_mixed_precision_samples_under_autocast(tmp_path, monkeypatch):
    """GRPOConfig(bf16=True): the engine decodes under bf16 autocast, as accelerate runs the model's forward."""
    import lowmem_grpo.integrations.trl_generation as native_module

    seen = []
    real = native_module.generate

    def spied(*a, **k):
        seen.append(k["autocast_bf16"])
        return real(*a, **k)

    monkeypatch.setattr(native_module, "generate", spied)
    trainer = _trainer(tmp_path, bf16=True)
    assert trainer.accelerator.mixed_precision == "bf16"
    trainer.train()
    assert seen and all(seen)
    logged = [row for row in trainer.state.log_history if "loss" in row]
    assert len(logged) == 2 and all(torch.isfinite(torch.tensor(row["loss"])) for row in logged)
    assert all(1 <= row["completions/mean_length"] <= 8 for row in logged)


@pytest.mark.parametrize("native, config, reason", [
    (False, {}, None),
    (True, {"generation_kwargs": {"no_repeat_ngram_size": 2}}, "generation_kwargs"),
    (True, {"cache_implementation": "static"}, "cache_implementation"),
])
def test_what_the_engine_does_not_take_goes_to_trls_path(tmp_path, monkeypatch, caplog, native, config, reason):
    import lowmem_grpo.integrations.trl_generation as native_module

    monkeypatch.setattr(native_module, "_logged", set())
    trainer = _trainer(tmp_path, native=native, **config)
    prompt_ids, images, fields = trainer._tokenize_prompts(PROMPTS)
    calls = _spy(monkeypatch)
    with caplog.at_level(logging.WARNING, logger=native_module.__name__):
        rows, _ = trainer._generate_single_turn(prompt_ids, images, fields, 1)
        trainer._generate_single_turn(prompt_ids, images, fields, 1)
    assert calls == {"native": 0, "trl": 2} and len(rows) == len(PROMPTS)
    warnings = [r.getMessage() for r in caplog.records if "TRL's generate() path" in r.getMessage()]
    assert (warnings == []) if reason is None else (len(warnings) == 1 and reason in warnings[0])
