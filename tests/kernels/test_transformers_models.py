"""The fused head on real transformers models (tiny, random weights): the same loss and the same
gradient on every parameter as the model's own logits, tied embeddings included."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from lowmem_grpo.kernels import linear_grpo_loss, spec

MODELS = {
    # Qwen2.5 ties the lm_head to the embedding and has no lm_head bias
    "qwen2-tied": (Qwen2ForCausalLM, Qwen2Config, dict(tie_word_embeddings=True)),
    "llama-untied": (LlamaForCausalLM, LlamaConfig, dict(tie_word_embeddings=False)),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_fused_head_matches_model_logits(name):
    model_cls, config_cls, extra = MODELS[name]
    torch.manual_seed(0)
    config = config_cls(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **extra)
    model = model_cls(config).float()
    B, P, C = 3, 4, 6  # prompts of P tokens, completions of C tokens
    input_ids = torch.randint(0, 1000, (B, P + C))
    mask = torch.ones(B, C, dtype=torch.bool)
    mask[1, 4:] = False
    completion_ids = input_ids[:, P:]
    old = torch.randn(B, C) * 0.1 - 7.0
    ref = torch.randn(B, C) * 0.1 - 7.0
    adv = torch.tensor([1.0, -0.5, 0.3])
    kwargs = dict(mask=mask, old_logp=old, ref_logp=ref, beta=0.04, epsilon_high=0.28, loss_type="grpo")

    def grads(loss):
        model.zero_grad()
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    # ours: the decoder's hidden states at the positions that predict the completion, and the head's weight
    hidden = model.model(input_ids).last_hidden_state[:, P - 1:-1]  # (B, C, H)
    ours, _ = linear_grpo_loss(hidden, model.lm_head.weight, completion_ids, adv, **kwargs)
    ours_grads = grads(ours)
    # the spec on the model's own logits, log-softmax in fp32
    logits = model(input_ids).logits[:, P - 1:-1]  # (B, C, V)
    spec_loss = _spec_loss_from_logits(logits, completion_ids, adv, **kwargs)
    spec_grads = grads(spec_loss)

    torch.testing.assert_close(ours, spec_loss)
    assert ours_grads.keys() == spec_grads.keys()
    for n in ours_grads:
        torch.testing.assert_close(ours_grads[n], spec_grads[n], msg=n)
    if config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight


def _spec_loss_from_logits(logits, ids, adv, *, mask, old_logp, ref_logp, beta, epsilon_high, loss_type):
    terms = spec.grpo_token_loss(logits, ids, adv, mask=mask, old_logp=old_logp, ref_logp=ref_logp, beta=beta,
                                 epsilon_high=epsilon_high)
    m = mask.float()
    assert loss_type == "grpo"
    return ((terms["loss"] * m).sum(-1) / m.sum(-1).clamp(min=1)).mean()
