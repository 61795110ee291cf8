"""lowmem_grpo.integrations.trl.GRPOTrainer against TRL's own GRPOTrainer: two steps on a tiny model with
the same seed give TRL's losses and gradients (fp32, 1e-5 relative) for each loss type, with and without
beta. Needs TRL (the `bench` extra); skipped without it."""

import importlib.util

import pytest
import torch

from tests.integrations.helpers import same_rollouts, tiny_qwen2

pytestmark = pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="needs trl (pip install '.[bench]')")

LOSS_TYPES = ["dapo", "grpo", "bnpo", "dr_grpo", "cispo", "sapo", "luspo"]
FAST = {("dapo", 0.04), ("grpo", 0.0)}  # the rest of the matrix is `slow` (~25 s a case on 2 CPU cores)
CASES = [pytest.param(t, b, marks=() if (t, b) in FAST else pytest.mark.slow) for t in LOSS_TYPES for b in (0.0, 0.04)]


def _train(trainer_cls, tmp_path, loss_type, beta, bf16=False):
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig

    model = tmp_path / "tiny-qwen2"  # a folder: TRL builds the reference model (beta > 0) from the path
    tokenizer = tiny_qwen2(model)
    grads = []

    class KeepGrads(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})

    def reward(completions, **kwargs):  # favours digits: advantages of both signs in every group
        return [float(sum(c.isdigit() for c in text)) for text in completions]

    args = GRPOConfig(output_dir=str(tmp_path / trainer_cls.__module__), per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=6, max_steps=2, learning_rate=1e-2,
                      loss_type=loss_type, beta=beta, epsilon_high=5.0 if loss_type == "cispo" else 0.2,
                      num_iterations=2, report_to="none", logging_steps=1, save_strategy="no", seed=0,
                      use_cpu=True, bf16=bf16, model_init_kwargs={"dtype": torch.float32})
    dataset = Dataset.from_dict({"prompt": ["12+7=", "3*4=", "9-5=", "8+8="] * 4})
    trainer = trainer_cls(model=str(model), reward_funcs=[reward], args=args, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[KeepGrads()], **same_rollouts(trainer_cls))
    trainer.train()
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    return losses, grads


@pytest.mark.parametrize("loss_type, beta", CASES)
def test_two_steps_give_trls_losses_and_gradients(tmp_path, loss_type, beta):
    import trl

    from lowmem_grpo.integrations.trl import GRPOTrainer

    trl_losses, trl_grads = _train(trl.GRPOTrainer, tmp_path, loss_type, beta)
    our_losses, our_grads = _train(GRPOTrainer, tmp_path, loss_type, beta)
    assert len(trl_losses) == len(our_losses) == 2 and len(trl_grads) == len(our_grads) == 2
    torch.testing.assert_close(torch.tensor(our_losses), torch.tensor(trl_losses), rtol=1e-5, atol=1e-7)
    for ours, theirs in zip(our_grads, trl_grads):
        assert ours.keys() == theirs.keys() and len(ours) > 0
        for name in theirs:
            scale = theirs[name].abs().max().clamp(min=1e-12)
            err = (ours[name] - theirs[name]).abs().max() / scale
            assert err <= 1e-5, f"{name}: gradient differs by {err:.2e} of its largest entry"


def test_at_trls_default_bf16_the_two_agree_to_bf16_rounding(tmp_path):
    """bf16=True (TRL's default; autocast on the CPU): both trainers compute in bf16 and round differently,
    so the fp32 test's 1e-5 does not hold; the bounds here are bf16's (docs/trl.md states the measured gap)."""
    import trl

    from lowmem_grpo.integrations.trl import GRPOTrainer

    trl_losses, trl_grads = _train(trl.GRPOTrainer, tmp_path, "dapo", 0.04, bf16=True)
    our_losses, our_grads = _train(GRPOTrainer, tmp_path, "dapo", 0.04, bf16=True)
    torch.testing.assert_close(torch.tensor(our_losses), torch.tensor(trl_losses), rtol=2e-2, atol=1e-6)
    first_ours, first_trl = our_grads[0], trl_grads[0]  # the second step starts from weights that differ
    for name in first_trl:
        err = (first_ours[name] - first_trl[name]).abs().max() / first_trl[name].abs().max().clamp(min=1e-12)
        assert err <= 5e-2, f"{name}: first-step gradient differs by {err:.2e} of its largest entry"


def test_the_drop_in_runs_our_head(tmp_path, monkeypatch):
    """Guard against a vacuous comparison: the drop-in's passes go through linear_token_logprobs."""
    import lowmem_grpo.integrations.trl as integration
    from lowmem_grpo.integrations.trl import GRPOTrainer

    calls = []
    real = integration.linear_token_logprobs
    monkeypatch.setattr(integration, "linear_token_logprobs", lambda *a, **k: calls.append(1) or real(*a, **k))
    _train(GRPOTrainer, tmp_path, "dapo", 0.04)
    assert len(calls) >= 4  # policy passes of both steps, plus old/reference passes


def test_unsupported_model_is_refused():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from lowmem_grpo.integrations.trl import add_fused_lm_head

    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    model.config.logits_scaling = 8.0
    with pytest.raises(ValueError, match="logits_scaling=8.0.*trl.GRPOTrainer"):
        add_fused_lm_head(model)
