"""The policy machinery on today's small architectures, at tiny size on the CPU: Qwen3 (q/k norms, a head_dim
that is not hidden / heads), Llama 3.2 (tied head, llama3 rope scaling) and Gemma 3 (sliding-window layers
mixed with full ones, the embedding scale, query_pre_attn_scalar).

For each: the rollout's greedy tokens equal transformers' generate() with the dynamic and the static
decode step (or, where a step cannot express the model, the rollout says why and falls back to
generate()); packed log-probs and gradients equal unpacked (or packing is refused, naming the window);
activation offload's gradients equal none; the model's own head at its real vocabulary size gives the
log-probs of its logits. The fused head at vocabularies 151936 and 262144 in bf16, both paths, against
the fp32 spec: tests/kernels/test_linear_loss.py (test_variants_at_real_vocabulary_sizes_in_bf16).
"""

import dataclasses

import pytest
import torch

from lowmem_grpo.config import GenerationConfig
from lowmem_grpo.kernels import linear_token_logprobs
from lowmem_grpo.policy.logprobs import completion_hidden
from lowmem_grpo.policy.model import build_head, enable_checkpointing
from lowmem_grpo.policy.packing import Packing, PackingError, packed_completion_hidden
from lowmem_grpo.policy.rollout import generate
from lowmem_grpo.policy.sampling import fast_sampling_problem, sample
from lowmem_grpo.policy.static_decode import static_decode_problem
from lowmem_grpo.training.activation_offload import offload_activations

from .test_packing import make_batch
from .test_sampling import CPU, PAD, frequent_token, random_prompts

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=128, initializer_range=0.2, bos_token_id=None, eos_token_id=None,
             pad_token_id=PAD)
ARCHS = {
    "qwen3": dict(model_type="qwen3", head_dim=32, tie_word_embeddings=False),
    "llama3.2": dict(model_type="llama", head_dim=16, tie_word_embeddings=True,
                     rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    # a window of 8 that the test sequences pass; one sliding layer, one full
    "gemma3": dict(model_type="gemma3_text", head_dim=16, tie_word_embeddings=True, sliding_window=8,
                   layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=16,
                   final_logit_softcapping=None, attn_logit_softcapping=None),
}
REAL_VOCAB = {"qwen3": 151936, "llama3.2": 128256, "gemma3": 262144}


def make(name: str, vocab: int = 64, seed: int = 0, **changes):
    from transformers import AutoConfig, AutoModelForCausalLM
    conf = {**SMALL, **ARCHS[name], "vocab_size": vocab, **changes}
    config = AutoConfig.for_model(conf.pop("model_type"), **conf)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()


def greedy_generate(model, prompts, cfg, eos):
    return generate(model, prompts, dataclasses.replace(cfg, fast_rollout=False), eos_ids=[eos], pad_id=PAD,
                    device=CPU, greedy=True).completion_ids


@pytest.mark.parametrize("name", list(ARCHS))
@pytest.mark.parametrize("decode", ["dynamic", "static"])
def test_rollout_greedy_equals_generate(name, decode):
    """Refill active (6 prompts x 3 samples through micro-batches of 4), prompts and completions together
    longer than Gemma's window."""
    model = make(name)
    distinct = random_prompts([3, 7, 5, 9, 4, 6], 64)
    cfg = GenerationConfig(max_completion_length=16, generation_micro_batch_size=4, max_prompt_length=16)
    eos = frequent_token(model, distinct, cfg)
    want = greedy_generate(model, [p for p in distinct for _ in range(3)], cfg, eos)
    problem = fast_sampling_problem(model, cfg, greedy=True) or (static_decode_problem(model) if decode == "static"
                                                                  else None)
    if name == "gemma3":  # its sliding-window cache is not a plain growing one: refused, with the reason
        assert problem and "cache" in problem
        got = generate(model, [p for p in distinct for _ in range(3)], cfg, eos_ids=[eos], pad_id=PAD, device=CPU,
                       greedy=True).completion_ids  # the rollout falls back to generate()
    else:
        assert problem is None
        got = sample(model, distinct, 3, cfg, eos_ids=[eos], pad_id=PAD, device=CPU, greedy=True, decode=decode)
    assert got.shape == want.shape and torch.equal(got, want), f"\n{got}\n{want}"
    lengths = (want != PAD).sum(1)
    assert lengths.min() < lengths.max()  # rows end at different steps: refill ran


def _logprobs_and_grads(model, batch, pack):
    model.zero_grad()
    head = build_head(model)
    hidden = completion_hidden(head, batch, Packing.ALWAYS if pack else Packing.OFF)  # (B, C, H)
    ids = batch.completion_ids.masked_fill(~batch.completion_mask, 0)
    logp = linear_token_logprobs(hidden.reshape(-1, hidden.shape[-1]), head.weight, ids.reshape(-1))
    logp = logp.view(ids.shape) * batch.completion_mask
    logp.sum().backward()
    return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", list(ARCHS))
def test_packed_logprobs_and_gradients_equal_unpacked(name):
    """Gemma 3 with its window past the sequences (the window is then a no-op in both layouts) packs
    exactly; with a window the sequences reach, packing is refused naming the window."""
    changes = {"sliding_window": 64} if name == "gemma3" else {}
    model = make(name, vocab=97, **changes).train()
    batch = make_batch(97)
    plain_logp, plain_grads = _logprobs_and_grads(model, batch, pack=False)
    packed_logp, packed_grads = _logprobs_and_grads(model, batch, pack=True)
    torch.testing.assert_close(packed_logp, plain_logp, rtol=1e-5, atol=1e-5)
    assert plain_grads.keys() == packed_grads.keys()
    for k in plain_grads:
        scale = plain_grads[k].abs().max().item()  # (the tied embedding sums two gradients of ~20)
        torch.testing.assert_close(packed_grads[k], plain_grads[k], rtol=1e-4, atol=1e-5 * max(scale, 1.0))
    if name == "gemma3":
        narrow = make(name, vocab=97, sliding_window=4)
        with pytest.raises(PackingError, match="sliding window"):
            packed_completion_hidden(build_head(narrow).decoder, batch)
        assert Packing.resolve(None, narrow, max_length=13) is Packing.OFF


@pytest.mark.parametrize("name", list(ARCHS))
def test_activation_offload_gradients_equal_none(name):
    def grads(hooks):
        model = make(name, vocab=64)
        enable_checkpointing(model)
        model.train()
        ids = torch.randint(1, 64, (3, 24), generator=torch.Generator().manual_seed(1))
        with hooks:
            loss = model(input_ids=ids).logits.float().pow(2).mean()
        loss.backward()
        return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    hooks = offload_activations(min_bytes=1, copy_on_cpu=True)
    plain = grads(torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
    moved = grads(hooks)
    assert hooks.offloaded_bytes > 0
    assert plain.keys() == moved.keys()
    for k in plain:
        torch.testing.assert_close(moved[k], plain[k], rtol=0, atol=0, msg=k)


@pytest.mark.parametrize("name", list(ARCHS))
def test_the_models_head_at_its_real_vocabulary(name):
    """build_head's view (decoder + output embedding, tied or not) through the fused log-probs at the real
    vocabulary equals log_softmax of the model's own logits (fp32)."""
    vocab = REAL_VOCAB[name]
    model = make(name, vocab=vocab, hidden_size=16, intermediate_size=32, head_dim=8)
    head = build_head(model)
    assert (head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()) == ARCHS[name][
        "tie_word_embeddings"]
    ids = torch.randint(1, vocab, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(input_ids=ids).logits.float().log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
        hidden = head.decoder(input_ids=ids).last_hidden_state[:, :-1]
        got = linear_token_logprobs(hidden.reshape(-1, hidden.shape[-1]), head.weight, ids[:, 1:].reshape(-1))
    torch.testing.assert_close(got.view(want.shape), want, rtol=1e-5, atol=1e-5)
