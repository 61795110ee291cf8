"""cast_lm_head_to_fp32=True in lowmem_grpo.integrations.trl.GRPOTrainer against TRL's own GRPOTrainer on a
tiny bf16 model: our head runs in fp32 like TRL's (fp32 hidden states and weight, autocast off), and two steps
with the same seed give TRL's losses and gradients within bf16 tolerances. Needs TRL; skipped without it."""

import importlib.util

import pytest
import torch

from tests.integrations.helpers import same_rollouts, tiny_qwen2

pytestmark = pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="needs trl (pip install '.[bench]')")

# Both heads compute in fp32 and agree to ~1e-6 there (observed here: gradients within 1e-7 of their largest
# entry), but the backbone is bf16: the head's gradient is rounded to bf16 (one ulp is 2^-8 = 3.9e-3
# relative) on its way back, so a last-bit difference in the head can flip a rounding and move a backbone
# gradient entry by up to ~4e-3 of its size; step 2 then starts from weights updated with it. The bounds
# allow a couple of such flips and stay far below a wrong head (bf16 head, wrong temperature: 1e-1 or more).
LOSS_RTOL, GRAD_RTOL = 1e-3, 1e-2


def _train(trainer_cls, tmp_path):
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig

    model = tmp_path / "tiny-qwen2-bf16"
    tokenizer = tiny_qwen2(model)
    grads = []

    class KeepGrads(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            grads.append({n: p.grad.detach().float().clone() for n, p in model.named_parameters()
                          if p.grad is not None})

    def reward(completions, **kwargs):  # favours digits: advantages of both signs in every group
        return [float(sum(c.isdigit() for c in text)) for text in completions]

    args = GRPOConfig(output_dir=str(tmp_path / trainer_cls.__module__), per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=6, max_steps=2, learning_rate=1e-2, beta=0.04,
                      num_iterations=2, report_to="none", logging_steps=1, save_strategy="no", seed=0,
                      use_cpu=True, bf16=True, cast_lm_head_to_fp32=True, model_init_kwargs={"dtype": torch.bfloat16})
    dataset = Dataset.from_dict({"prompt": ["12+7=", "3*4=", "9-5=", "8+8="] * 4})
    trainer = trainer_cls(model=str(model), reward_funcs=[reward], args=args, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[KeepGrads()], **same_rollouts(trainer_cls))
    assert trainer.model.lm_head.weight.dtype == torch.float32  # TRL's construction cast the head
    assert trainer.model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16  # the backbone is bf16
    trainer.train()
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    return losses, grads


def test_fp32_head_gives_trls_losses_and_gradients(tmp_path, monkeypatch):
    import trl

    import lowmem_grpo.integrations.trl as integration

    dtypes = []
    real = integration.linear_token_logprobs

    def spy(hidden, weight, *args, **kwargs):
        dtypes.append((hidden.dtype, weight.dtype, torch.is_autocast_enabled(hidden.device.type)))
        return real(hidden, weight, *args, **kwargs)

    monkeypatch.setattr(integration, "linear_token_logprobs", spy)
    trl_losses, trl_grads = _train(trl.GRPOTrainer, tmp_path)
    our_losses, our_grads = _train(integration.GRPOTrainer, tmp_path)
    assert dtypes and set(dtypes) == {(torch.float32, torch.float32, False)}  # our head ran, in fp32
    assert len(trl_losses) == len(our_losses) == 2 and len(trl_grads) == len(our_grads) == 2
    torch.testing.assert_close(torch.tensor(our_losses), torch.tensor(trl_losses), rtol=LOSS_RTOL, atol=1e-4)
    for ours, theirs in zip(our_grads, trl_grads):
        assert ours.keys() == theirs.keys() and len(ours) > 0
        for name in theirs:
            scale = theirs[name].abs().max().clamp(min=1e-12)
            err = (ours[name] - theirs[name]).abs().max() / scale
            assert err <= GRAD_RTOL, f"{name}: gradient differs by {err:.2e} of its largest entry"
