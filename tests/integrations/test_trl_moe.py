"""lowmem_grpo.integrations.trl.GRPOTrainer against TRL's own GRPOTrainer on tiny random mixture-of-experts
models (Qwen3-MoE, GPT-OSS), whose router load-balancing loss TRL adds by default: two steps with the same
seed give TRL's losses, aux_loss metric and gradients (fp32, 1e-5 relative; the second step's gradients 1e-3).
Needs TRL; skipped without it."""

import importlib.util

import pytest
import torch

from tests.integrations.helpers import same_rollouts

pytestmark = pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="needs trl (pip install '.[bench]')")


def _tiny_moe(family, tokenizer):
    """A tiny random MoE causal LM of `family` (4 experts, 2 per token, 2 layers)."""
    common = dict(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, num_experts_per_tok=2, pad_token_id=tokenizer.pad_token_id,
                  eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    if family == "qwen3_moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        return Qwen3MoeForCausalLM(Qwen3MoeConfig(num_experts=4, moe_intermediate_size=16, intermediate_size=64,
                                                  decoder_sparse_step=1, **common))
    from transformers import GptOssConfig, GptOssForCausalLM

    return GptOssForCausalLM(GptOssConfig(num_local_experts=4, intermediate_size=16, sliding_window=8,
                                          layer_types=["sliding_attention", "full_attention"], **common))


def _train(trainer_cls, tmp_path, family):
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig

    from lowmem_grpo.policy.char_tokenizer import char_tokenizer

    tokenizer = char_tokenizer()
    model = tmp_path / f"tiny-{family}"
    if not model.exists():
        torch.manual_seed(0)
        _tiny_moe(family, tokenizer).save_pretrained(model)
        tokenizer.save_pretrained(model)
    grads = []

    class KeepGrads(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})

    def reward(completions, **kwargs):  # favours digits: advantages of both signs in every group
        return [float(sum(c.isdigit() for c in text)) for text in completions]

    args = GRPOConfig(output_dir=str(tmp_path / trainer_cls.__module__), per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=6, max_steps=2, learning_rate=1e-2, beta=0.04,
                      num_iterations=2, report_to="none", logging_steps=1, save_strategy="no", seed=0,
                      use_cpu=True, bf16=False, model_init_kwargs={"dtype": torch.float32})
    dataset = Dataset.from_dict({"prompt": ["12+7=", "3*4=", "9-5=", "8+8="] * 4})
    trainer = trainer_cls(model=str(model), reward_funcs=[reward], args=args, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[KeepGrads()], **same_rollouts(trainer_cls))
    assert trainer.aux_loss_enabled  # TRL's default for an MoE model: the router loss is on
    trainer.train()
    rows = [row for row in trainer.state.log_history if "loss" in row]
    return [row["loss"] for row in rows], [row["aux_loss"] for row in rows], grads


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_two_moe_steps_give_trls_losses_aux_losses_and_gradients(tmp_path, family):
    import trl

    from lowmem_grpo.integrations.trl import GRPOTrainer

    trl_losses, trl_aux, trl_grads = _train(trl.GRPOTrainer, tmp_path, family)
    our_losses, our_aux, our_grads = _train(GRPOTrainer, tmp_path, family)
    assert len(trl_losses) == len(our_losses) == 2 and len(trl_grads) == len(our_grads) == 2
    assert all(a > 0 for a in trl_aux)  # a real router loss is compared, not two zeros
    torch.testing.assert_close(torch.tensor(our_losses), torch.tensor(trl_losses), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(torch.tensor(our_aux), torch.tensor(trl_aux), rtol=1e-5, atol=1e-7)
    # Step 1's gradients agree to fp32 rounding (observed ~3e-7). Step 2 starts from weights that Adam moved by
    # +-lr wherever a gradient is at rounding level, its sign a coin toss between the two heads' sums; with
    # GPT-OSS's router and sinks that leaves step 2's gradients ~1e-4 apart (transformers 5.24; the losses still
    # agree to 1e-5), so step 2 is held to 1e-3.
    for step, (ours, theirs) in enumerate(zip(our_grads, trl_grads), 1):
        assert ours.keys() == theirs.keys() and any("router" in name or "gate" in name for name in theirs)
        bound = 1e-5 if step == 1 else 1e-3
        for name in theirs:
            scale = theirs[name].abs().max().clamp(min=1e-12)
            err = (ours[name] - theirs[name]).abs().max() / scale
            assert err <= bound, f"step {step}, {name}: gradient differs by {err:.2e} of its largest entry"


def test_router_loss_is_the_model_familys_own(monkeypatch):
    """The fused forward returns aux_loss from the family's load_balancing_loss_func, weighted into `loss`."""
    import transformers.models.qwen3_moe.modeling_qwen3_moe as family

    from lowmem_grpo.integrations.trl import add_fused_lm_head
    from lowmem_grpo.policy.char_tokenizer import char_tokenizer

    torch.manual_seed(0)
    model = _tiny_moe("qwen3_moe", char_tokenizer())
    model.config.output_router_logits = True
    add_fused_lm_head(model)
    calls = []
    real = family.load_balancing_loss_func
    monkeypatch.setattr(family, "load_balancing_loss_func", lambda *a, **k: calls.append(1) or real(*a, **k))
    ids = torch.randint(3, 20, (2, 7))
    mask = torch.ones_like(ids)
    out = model(input_ids=ids, attention_mask=mask, labels=ids, fused_lm_head=True)
    reference = type(model).forward(model, input_ids=ids, attention_mask=mask, labels=ids)
    assert calls and out.aux_loss is not None
    torch.testing.assert_close(out.aux_loss, reference.aux_loss)
    torch.testing.assert_close(out.loss, reference.loss, rtol=1e-5, atol=1e-6)  # NLL + coef * aux, like HF's
    out.loss.backward()
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0  # the router loss reaches the router


def test_moe_without_a_family_router_loss_uses_mixtrals(monkeypatch):
    """A family without its own load_balancing_loss_func (GLM-4-MoE, Nemotron-H) is not refused: its router loss
    is Mixtral's, the function TRL's head uses for every family."""
    import transformers.models.qwen3_moe.modeling_qwen3_moe as family
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from lowmem_grpo.integrations.trl import add_fused_lm_head
    from lowmem_grpo.policy.char_tokenizer import char_tokenizer

    torch.manual_seed(0)
    model = _tiny_moe("qwen3_moe", char_tokenizer())
    model.config.output_router_logits = True
    monkeypatch.delattr(family, "load_balancing_loss_func")
    add_fused_lm_head(model)
    ids = torch.randint(3, 20, (2, 7))
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids, fused_lm_head=True)
    router_logits = model.model(input_ids=ids, output_router_logits=True).router_logits
    expected = load_balancing_loss_func(router_logits, 4, 2, torch.ones_like(ids))
    torch.testing.assert_close(out.aux_loss, expected)
