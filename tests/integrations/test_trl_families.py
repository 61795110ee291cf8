"""The TRL drop-in on model families TRL's GRPOTrainer trains and the drop-in used to refuse: GLM-4-MoE and
Nemotron-H (router logits, no family load_balancing_loss_func; TRL adds a router loss only where the config
asks for one) and Gemma 2 (final_logit_softcapping, applied in the fused head). Tiny random models built from
configs; two steps with the same seed give TRL's losses and gradients (fp32, 1e-5 relative), and Gemma 2's
fused head gives transformers' own log-probs, cap included. Needs TRL; skipped without it."""

import importlib.util

import pytest
import torch

from tests.integrations.helpers import same_rollouts

pytestmark = pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="needs trl (pip install '.[bench]')")

FAMILIES = ["glm4_moe", "nemotron_h", "gemma2"]


def _tiny(family, vocab, pad, eos):
    """A tiny random causal LM of `family` (2-3 layers, hidden size 32; MoE: 4 experts, 2 per token)."""
    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, pad_token_id=pad, eos_token_id=eos, tie_word_embeddings=False)
    if family == "glm4_moe":
        from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

        return Glm4MoeForCausalLM(Glm4MoeConfig(num_hidden_layers=2, moe_intermediate_size=16, n_routed_experts=4,
                                                num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                                                n_group=1, topk_group=1, **common))
    if family == "nemotron_h":
        from transformers import NemotronHConfig, NemotronHForCausalLM

        return NemotronHForCausalLM(NemotronHConfig(
            num_hidden_layers=3, layers_block_type=["mamba", "moe", "attention"], mamba_num_heads=4,
            mamba_head_dim=8, ssm_state_size=8, n_groups=1, n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=16, moe_shared_expert_intermediate_size=16, **common))
    from transformers import Gemma2Config, Gemma2ForCausalLM

    model = Gemma2ForCausalLM(Gemma2Config(num_hidden_layers=2, final_logit_softcapping=3.0, **common))
    with torch.no_grad():  # logits of several units, so that the cap at 3 changes them
        model.lm_head.weight.mul_(20.0)
    return model


def _train(trainer_cls, tmp_path, family):
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig

    from lowmem_grpo.policy.char_tokenizer import char_tokenizer

    tokenizer = char_tokenizer()
    model = tmp_path / f"tiny-{family}"
    if not model.exists():
        torch.manual_seed(0)
        _tiny(family, len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id).save_pretrained(model)
        tokenizer.save_pretrained(model)
    grads = []

    class KeepGrads(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})

    def reward(completions, **kwargs):  # favours digits: advantages of both signs in every group
        return [float(sum(c.isdigit() for c in text)) for text in completions]

    args = GRPOConfig(output_dir=str(tmp_path / trainer_cls.__module__), per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=6, max_steps=2, learning_rate=1e-2, beta=0.04,
                      temperature=0.7, num_iterations=2, report_to="none", logging_steps=1, save_strategy="no",
                      seed=0, use_cpu=True, bf16=False, model_init_kwargs={"dtype": torch.float32})
    dataset = Dataset.from_dict({"prompt": ["12+7=", "3*4=", "9-5=", "8+8="] * 4})
    trainer = trainer_cls(model=str(model), reward_funcs=[reward], args=args, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[KeepGrads()], **same_rollouts(trainer_cls))
    trainer.train()
    return [row["loss"] for row in trainer.state.log_history if "loss" in row], grads


@pytest.mark.parametrize("family", FAMILIES)
def test_two_steps_give_trls_losses_and_gradients(tmp_path, family):
    import trl

    from lowmem_grpo.integrations.trl import GRPOTrainer

    trl_losses, trl_grads = _train(trl.GRPOTrainer, tmp_path, family)
    our_losses, our_grads = _train(GRPOTrainer, tmp_path, family)
    assert len(trl_losses) == len(our_losses) == 2 and len(trl_grads) == len(our_grads) == 2
    torch.testing.assert_close(torch.tensor(our_losses), torch.tensor(trl_losses), rtol=1e-5, atol=1e-7)
    for ours, theirs in zip(our_grads, trl_grads):
        assert ours.keys() == theirs.keys()
        for name in theirs:
            scale = theirs[name].abs().max().clamp(min=1e-12)
            err = (ours[name] - theirs[name]).abs().max() / scale
            assert err <= 1e-5, f"{name}: gradient differs by {err:.2e} of its largest entry"


def test_gemma2_fused_head_gives_transformers_capped_log_probs():
    """Gemma 2's fused head: transformers' own logits (soft-capped by the model) / T, log-softmaxed, gathered;
    forward and the gradient of every parameter. Without the cap they would differ (checked)."""
    from lowmem_grpo.integrations.trl import add_fused_lm_head

    torch.manual_seed(0)
    model = _tiny("gemma2", 50, 0, 1)
    ids = torch.randint(2, 50, (2, 9))
    temperature = 0.7
    logits = model(input_ids=ids).logits[:, :-1]  # capped by the model itself
    expected = torch.log_softmax(logits / temperature, -1).gather(-1, ids[:, 1:, None])[..., 0]
    expected_grads = torch.autograd.grad(expected.sum(), list(model.parameters()))
    uncapped = torch.log_softmax(model.lm_head(model.model(input_ids=ids).last_hidden_state[:, :-1]) / temperature,
                                 -1).gather(-1, ids[:, 1:, None])[..., 0]
    assert (uncapped - expected).abs().max() > 1.0  # the cap matters on this model
    add_fused_lm_head(model, temperature=temperature)
    out = model(input_ids=ids, labels=ids, fused_lm_head=True)
    torch.testing.assert_close(out.log_probs, expected, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(out.log_probs.sum(), list(model.parameters()))
    for (name, _), got, want in zip(model.named_parameters(), grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=name)
