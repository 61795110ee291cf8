"""The policy machinery on tiny random Qwen3, Llama 3.2 and Gemma 3 (gemma3_text) models, on the CPU.

Qwen3: q/k norms, head_dim != hidden / heads. Llama 3.2: tied head, llama3 rope scaling. Gemma 3: sliding
window 8 (shorter than the sequences here) on some layers, embedding scale, query_pre_attn_scalar, no soft-caps.
Qwen3 and Llama: greedy rollouts equal transformers' generate() (dynamic and static steps, refill active),
packed log-probs and gradients equal unpacked in fp32. Gemma 3: the fast rollout and the static step are
refused with the reason (rollouts run generate()), packing is refused past the window and exact within it.
All three: activation offload gives the gradients of no offload; build_head's head (tied where the model
ties) at the real vocabulary in bf16 matches the fp32 spec on the torch and interpreter paths. The loss
variants at those vocabularies: tests/kernels/test_linear_loss.py::test_variants_at_real_vocabulary_sizes_in_bf16.
"""

import dataclasses
import logging

import pytest
import torch

from lowmem_grpo.config import GenerationConfig
from lowmem_grpo.kernels import HAS_TRITON, spec, use_backend
from lowmem_grpo.kernels._backend import interpreter_enabled
from lowmem_grpo.policy.model import build_head, check_logits_are_linear
from lowmem_grpo.policy import sampling
from lowmem_grpo.policy.packing import Packing, PackingError, packing_supported
from lowmem_grpo.policy.sampling import SamplingStats, decode_mode, sample
from lowmem_grpo.training.activation_offload import offload_activations

from .test_packing import logp_and_grads, make_batch
from .test_sampling import CPU, PAD, frequent_token, random_prompts
from .test_static_decode import generate
from tests.kernels.helpers import assert_as_close_as_low_precision
from tests.kernels.test_linear_loss import _batch, _compare

VOCAB = 128
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, bos_token_id=None,
              eos_token_id=None, pad_token_id=PAD)
CONFIGS = {
    "qwen3": dict(model_type="qwen3", head_dim=32, tie_word_embeddings=False, **COMMON),  # 4 x 32 != 64
    "llama3.2": dict(model_type="llama", tie_word_embeddings=True, rope_theta=500000.0,
                     rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                       original_max_position_embeddings=8192), **COMMON),
    "gemma3": dict(model_type="gemma3_text", head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                   rope_local_base_freq=10000.0, final_logit_softcapping=None, attn_logit_softcapping=None,
                   tie_word_embeddings=True, **COMMON),
}
WINDOW = 8


def make_model(name: str, attn: str = "sdpa", seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM
    conf = dict(CONFIGS[name])
    config = AutoConfig.for_model(conf.pop("model_type"), **conf)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)
    with torch.no_grad():  # random norm weights, so q/k norms and Gemma's (1 + w) norms matter
        for n, p in model.named_parameters():
            if "norm" in n:
                p.normal_(0, 0.3)
    return model.eval()


def test_configs_are_what_they_claim():
    qwen, llama, gemma = (make_model(n).config for n in CONFIGS)
    assert qwen.head_dim * qwen.num_attention_heads != qwen.hidden_size
    assert llama.tie_word_embeddings and llama.rope_scaling["rope_type"] == "llama3"
    assert gemma.model_type == "gemma3_text" and set(gemma.layer_types) == {"sliding_attention", "full_attention"}
    assert gemma.final_logit_softcapping is None and gemma.attn_logit_softcapping is None


@pytest.mark.parametrize("name", list(CONFIGS))
def test_build_head_accepts_the_model(name):
    model = make_model(name)
    check_logits_are_linear(model.config)
    head = build_head(model)
    assert head.weight.shape == (VOCAB, 64)
    if model.config.tie_word_embeddings:
        assert head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        hidden = head.decoder(input_ids=ids).last_hidden_state
    torch.testing.assert_close(hidden @ head.weight.T, logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("decode", ["dynamic", "static"])
@pytest.mark.parametrize("name", ["qwen3", "llama3.2"])
def test_greedy_rollout_matches_generate(name, decode):
    """Token for token with generate(), with refills."""
    model = make_model(name, seed=1)
    distinct = random_prompts([3, 7, 5, 9, 4, 6], VOCAB, seed=2)
    cfg = GenerationConfig(max_completion_length=20, generation_micro_batch_size=4, max_prompt_length=16)
    eos = frequent_token(model, distinct, cfg)
    slow = generate(model, [p for p in distinct for _ in range(3)], cfg, eos)
    stats = SamplingStats()
    fast = sample(model, distinct, 3, cfg, eos_ids=[eos], pad_id=PAD, device=CPU, greedy=True, stats=stats,
                  decode=decode)
    assert fast.shape == slow.shape and torch.equal(fast, slow), f"\n{fast}\n{slow}"
    lengths = (slow != PAD).sum(1)
    assert lengths.min() < lengths.max()
    assert stats.refills > 0


def test_gemma3_rollouts_fall_back_to_generate(caplog, monkeypatch):
    """Gemma's sliding layers keep a windowed cache the fast path cannot edit row by row, and the static
    step's one mask would reach past the window: sample() refuses with the reason, the static step is
    never chosen, and rollout.generate (fast_rollout on) logs the reason and runs generate()."""
    from lowmem_grpo.policy.rollout import generate as rollout_generate
    from lowmem_grpo.policy.static_decode import static_decode_problem
    model = make_model("gemma3", seed=1)
    distinct = random_prompts([3, 7, 5, 9], VOCAB, seed=2)
    cfg = GenerationConfig(max_completion_length=12, generation_micro_batch_size=4, max_prompt_length=16,
                           compile_decode=True)
    with pytest.raises(ValueError, match="DynamicSlidingWindowLayer"):
        sample(model, distinct, 2, cfg, eos_ids=[1], pad_id=PAD, device=CPU, greedy=True)
    assert "sliding-window attention (window 8)" in static_decode_problem(model)
    assert decode_mode(model, cfg, CPU) == "dynamic"
    prompts = [p for p in distinct for _ in range(2)]
    monkeypatch.setattr(sampling, "_fallbacks_logged", set())  # each reason is logged once per process
    kw = dict(eos_ids=[1], pad_id=PAD, device=CPU, greedy=True)
    with caplog.at_level(logging.WARNING, logger="lowmem_grpo.policy.sampling"):
        fast = rollout_generate(model, prompts, dataclasses.replace(cfg, fast_rollout=True), **kw)
    slow = rollout_generate(model, prompts, dataclasses.replace(cfg, fast_rollout=False), **kw)
    assert "using transformers' generate() instead" in caplog.text and "DynamicSlidingWindowLayer" in caplog.text
    assert torch.equal(fast.completion_ids, slow.completion_ids)
    assert fast.completion_ids.shape[1] + 9 > WINDOW


@pytest.mark.parametrize("name", ["qwen3", "llama3.2"])
def test_packed_matches_unpacked(name):
    model = make_model(name).train()
    assert packing_supported(model, max_length=64) == (True, "")
    mb = make_batch(VOCAB)
    logp, grads = logp_and_grads(model, mb, pack=Packing.OFF)
    logp_p, grads_p = logp_and_grads(model, mb, pack=Packing.ALWAYS)
    assert_as_close_as_low_precision(logp_p, logp, floor=1e-5, name="logp")
    assert grads.keys() == grads_p.keys()
    for n in grads:
        assert_as_close_as_low_precision(grads_p[n], grads[n], floor=1e-5, name=n)


def test_gemma3_packs_only_within_its_window(caplog):
    """A ready 4D mask replaces Gemma's sliding-window mask: packing past the window is refused with the
    reason; sequences that fit the window pack, and equal unpacked."""
    model = make_model("gemma3").train()
    ok, reason = packing_supported(model, max_length=WINDOW + 1)
    assert not ok and "sliding-window" in reason and "pack_prompts=false" in reason
    with caplog.at_level(logging.INFO, logger="lowmem_grpo.policy.packing"):
        assert Packing.resolve(None, model, max_length=WINDOW + 1) is Packing.OFF
    assert "sliding-window" in caplog.text
    with pytest.raises(PackingError, match="sliding-window"):
        Packing.resolve(True, model, max_length=WINDOW + 1)
    mb = make_batch(VOCAB).rows(0, 3)  # prompt 5 + completion 6 columns: more than the window...
    mb = dataclasses.replace(mb, prompt_ids=mb.prompt_ids[:, 3:], prompt_mask=mb.prompt_mask[:, 3:],
                             completion_ids=mb.completion_ids[:, :4], completion_mask=mb.completion_mask[:, :4])
    assert mb.prompt_ids.shape[1] + mb.completion_ids.shape[1] <= WINDOW  # ...so cut to 4 + 4
    assert Packing.resolve(True, model, max_length=WINDOW) is Packing.ALWAYS
    logp, grads = logp_and_grads(model, mb, pack=Packing.OFF)
    logp_p, grads_p = logp_and_grads(model, mb, pack=Packing.ALWAYS)
    assert_as_close_as_low_precision(logp_p, logp, floor=1e-5, name="logp")
    for n in grads:
        assert_as_close_as_low_precision(grads_p[n], grads[n], floor=1e-5, name=n)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_activation_offload_gives_the_same_gradients(name):
    from lowmem_grpo.policy.model import enable_checkpointing
    ids = torch.randint(1, VOCAB, (3, 24), generator=torch.Generator().manual_seed(1))  # past Gemma's window

    def grads(offload):
        model = make_model(name).train()
        enable_checkpointing(model)
        with offload:
            loss = (model.model(input_ids=ids).last_hidden_state.float() ** 2).mean()
        loss.backward()
        return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    plain = grads(torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
    hooks = offload_activations(min_bytes=1, copy_on_cpu=True)
    moved = grads(hooks)
    assert hooks.offloaded_bytes > 0 and plain.keys() == moved.keys()
    for k in plain:
        torch.testing.assert_close(moved[k], plain[k], rtol=0, atol=0, msg=k)


REAL_VOCAB = {"qwen3": 151936, "llama3.2": 128256, "gemma3": 262144}
HEAD_PATHS = ["torch"] + ([pytest.param("triton", marks=pytest.mark.slow)]  # 4-9 s each in the interpreter
                           if HAS_TRITON and interpreter_enabled() else [])


@pytest.mark.parametrize("backend", HEAD_PATHS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_model_head_at_the_real_vocabulary_in_bf16(name, backend):
    """The head build_head takes from a one-layer bf16 model at the real vocabulary (tied for Llama and
    Gemma: the embedding's own storage) against the fp32 spec, by test_linear_loss's comparison."""
    from transformers import AutoConfig, AutoModelForCausalLM
    conf = dict(CONFIGS[name], vocab_size=REAL_VOCAB[name], hidden_size=32, intermediate_size=32,
                num_hidden_layers=1, layer_types=None)
    if name == "gemma3":
        conf["layer_types"] = ["sliding_attention"]
    else:
        conf.pop("layer_types")
    config = AutoConfig.for_model(conf.pop("model_type"), **conf)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    head = build_head(model)
    assert head.weight.shape == (REAL_VOCAB[name], 32) and head.weight.dtype == torch.bfloat16
    assert (head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()) == config.tie_word_embeddings
    ids = torch.randint(1, REAL_VOCAB[name], (2, 4), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden = head.decoder(input_ids=ids).last_hidden_state
    batch = _batch("cpu", dtype=torch.bfloat16, B=2, T=4, H=32, V=8, with_bias=False)
    batch = dict(batch, hidden=hidden.detach().requires_grad_(), weight=head.weight,
                 ids=ids.masked_fill(~batch["mask"], -100))
    with torch.no_grad():
        logp = spec.linear_token_logprobs(batch["hidden"], head.weight, ids)
    batch.update(old_logp=logp + 0.3 * torch.randn(2, 4), ref_logp=logp + 0.5 * torch.randn(2, 4))
    with use_backend(backend):
        _compare(batch, dtype=torch.bfloat16, loss_type="grpo")
