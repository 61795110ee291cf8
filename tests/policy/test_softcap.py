"""Gemma 2's final_logit_softcapping in lowmem-grpo's own trainer: the policy head, the reference model (in RAM
and streamed) and the loss all compute transformers' own soft-capped log-probs."""

import copy

import pytest
import torch

from lowmem_grpo.policy.logprobs import completion_logprobs
from lowmem_grpo.policy.model import build_head
from lowmem_grpo.policy.reference import Reference
from tests.policy.test_packing import make_batch

TEMPERATURE = 0.7
GEMMA2 = dict(model_type="gemma2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=1, head_dim=16, final_logit_softcapping=3.0,
              eos_token_id=1, pad_token_id=0)


def _gemma2():
    from transformers import AutoConfig, AutoModelForCausalLM

    conf = dict(GEMMA2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(conf.pop("model_type"), **conf),
                                             dtype=torch.float32)
    with torch.no_grad():  # logits of several units, so that the cap at 3 changes them
        model.lm_head.weight.mul_(20.0)
    return model.eval()


def _transformers_logprobs(model, batch, softcap=True):
    """Completion log-probs from the model's own forward (capped by it) / T: (N, C), 0 on padding."""
    ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1)
    mask = torch.cat([batch.prompt_mask, batch.completion_mask], 1)
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        if softcap:
            logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        else:
            logits = model.lm_head(model.model(input_ids=ids, attention_mask=mask, position_ids=positions)[0])
    P = batch.prompt_ids.shape[1]
    logp = torch.log_softmax(logits[:, P - 1:-1] / TEMPERATURE, -1).gather(-1, batch.completion_ids[..., None])[..., 0]
    return logp * batch.completion_mask


@pytest.mark.parametrize("where", ["policy", "reference-cpu", "reference-stream"])
def test_log_probs_are_transformers_soft_capped_ones(where):
    model = _gemma2()
    batch = make_batch(model.config.vocab_size)
    expected = _transformers_logprobs(model, batch)
    assert (expected - _transformers_logprobs(model, batch, softcap=False)).abs().max() > 0.5  # the cap matters
    head = build_head(model)
    assert head.softcap == 3.0
    if where == "policy":
        got = completion_logprobs(head, batch, temperature=TEMPERATURE, micro_batch=4, device=torch.device("cpu"))
    else:
        ref = Reference(copy.deepcopy(model), torch.device("cpu"), where.split("-")[1])
        got = ref.logprobs(batch, temperature=TEMPERATURE, micro_batch=4)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)

