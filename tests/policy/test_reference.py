"""The reference model kept in CPU RAM: the streamed path gives the same log-probs as a plain forward."""

import copy

import pytest
import torch

from lowmem_grpo.policy.batch import Batch, eos_mask, left_pad
from lowmem_grpo.policy.logprobs import completion_logprobs
from lowmem_grpo.policy.model import build_head
from lowmem_grpo.policy.packing import Packing
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
        assert ref.streamer.copies == 3  # 3 layers, each fetched once for the 3 micro-batches (layer-major)
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


@pytest.mark.parametrize("name", ["qwen3", "llama3.2", "gemma3"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_the_streamed_pass_is_layer_major_and_equals_the_per_micro_batch_one(name, autocast):
    """7 micro-batches of 4 rows (padding, an empty completion), packed and not (Gemma 3 past its window:
    not): the streamed pass fetches each layer once and equals the CPU pass, a micro-batch at a time, within
    fp rounding (the layers see the same micro-batches; the head multiplies every row in one GEMM per
    vocabulary slice, and a GEMM's rounding may depend on its row count)."""
    from .test_architectures import VOCAB, make_model
    from .test_packing import make_batch
    model = make_model(name)
    one = make_batch(VOCAB, seed=1)
    batch = Batch(*[torch.cat([getattr(one, f)] * 3) for f in
                    ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "is_truncated")])
    per_micro_batch = Reference(copy.deepcopy(model), torch.device("cpu"), "cpu")
    streamed = Reference(copy.deepcopy(model), torch.device("cpu"), "stream")
    for pack in [Packing.OFF] + ([Packing.ALWAYS] if name != "gemma3" else []):
        streamed.streamer.copies = 0
        got = streamed.logprobs(batch, temperature=0.9, micro_batch=4, pack=pack, autocast_bf16=autocast)
        want = per_micro_batch.logprobs(batch, temperature=0.9, micro_batch=4, pack=pack, autocast_bf16=autocast)
        tol = 1e-2 if autocast else 1e-5
        torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=str(pack))
        assert streamed.streamer.copies == len(streamed.layers)  # once per layer for the 7 micro-batches


def test_stream_rows_bounds_the_rows_that_share_a_layer_copy():
    """reference_stream_rows=4 with micro-batches of 2: 5 rows in 3 micro-batches, 2 then 1 per layer copy."""
    model = _model()
    ref = Reference(copy.deepcopy(model), torch.device("cpu"), "stream")
    got = ref.logprobs(_batch(), temperature=0.8, micro_batch=2, stream_rows=4)
    assert ref.streamer.copies == 2 * 3  # 3 layers, twice
    torch.testing.assert_close(got, ref.logprobs(_batch(), temperature=0.8, micro_batch=2), rtol=1e-5, atol=1e-5)
