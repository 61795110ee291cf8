"""The reference model kept in CPU RAM: the streamed path gives the same log-probs as a plain forward."""

import copy

import pytest
import torch

from lowmem_grpo.policy.batch import Batch, eos_mask, left_pad
from lowmem_grpo.policy.logprobs import completion_logprobs
from lowmem_grpo.policy.model import build_head
from lowmem_grpo.policy.reference import Reference


def _model():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))


def _batch():
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (3, 5, 4, 2, 6)]
    prompt_ids, prompt_mask = left_pad(prompts, 0)
    completion_ids = torch.randint(3, 96, (5, 7), generator=g)
    completion_ids[1, 3] = 1  # an EOS: the tokens after it are padding
    mask, truncated = eos_mask(completion_ids, [1])
    return Batch(prompt_ids, prompt_mask, completion_ids.masked_fill(~mask, 0), mask, truncated)


@pytest.mark.parametrize("mode", ["cpu", "stream"])
def test_reference_logprobs_match_a_plain_forward(mode):
    model = _model()
    expected = completion_logprobs(build_head(model), _batch(), temperature=0.8, micro_batch=2,
                                   device=torch.device("cpu"))
    ref = Reference(copy.deepcopy(model), torch.device("cpu"), mode)
    got = ref.logprobs(_batch(), temperature=0.8, micro_batch=2)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert (got[1, 4:] == 0).all()
    if mode == "stream":
        assert ref.streamer.copies == 3 * 3  # 3 layers x 3 micro-batches, each layer fetched once per forward
        for layer in ref.streamer.host:  # after the forward every layer points at its host copy again
            for p, h in layer:
                assert p.data.data_ptr() == h.data_ptr()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run by benchmarks/gpu_session.sh)")
def test_streamed_reference_on_cuda_matches_and_keeps_weights_on_the_host():
    model = _model()
    device = torch.device("cuda")
    expected = completion_logprobs(build_head(copy.deepcopy(model).to(device)), _batch(), temperature=0.8,
                                   micro_batch=2, device=device)
    ref = Reference(copy.deepcopy(model), device, "stream")
    got = ref.logprobs(_batch(), temperature=0.8, micro_batch=2)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert all(p.device.type == "cpu" and p.is_pinned() for layer in ref.model.model.layers
               for p in layer.parameters())
