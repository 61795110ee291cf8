"""Shared-prompt packing gives the unpacked per-token log-probs and parameter gradients.

Every comparison runs the same weights through `completion_hidden` with `Packing.OFF` and `Packing.ALWAYS`
and then through the fused head, as the loss and the log-prob passes do. fp32 must agree to rounding;
in bf16 (bf16 weights, or fp32 weights under bf16 autocast) packed must be as close to an fp32
unpacked run as the bf16 unpacked run is (the project's tolerance rule), within a factor. The
log-probs get factor 2: on a Xeon with native bf16 (AVX512-BF16) packed and unpacked came out
bitwise equal, but on an AMD EPYC without it sdpa rounds the masked (packed) and unmasked paths
differently, and the packed error reached 1.8x the unpacked one (SmolLM2 shapes, sdpa, both bf16
modes); each is still one bf16 rounding per operation. The parameter gradients get factor 2: packed, the
gradient reaching a prompt token is one bf16 sum over the completions that share it, rounded once
per layer, where unpacked keeps G separately rounded copies whose errors the fp32 weight GEMM adds
like a random walk. With coherent terms that error is G * eps against sqrt(G) * eps, i.e. up to
sqrt(G) = 1.7 times the unpacked one for the G = 3 completions here (measured: median ratio 1.00,
largest 1.75 over these models); the relative precision of each sum is still one bf16 rounding.
"""

import copy

import pytest
import torch
from torch import nn

from lowmem_grpo.kernels import linear_token_logprobs
from lowmem_grpo.memory.presets import preset
from lowmem_grpo.policy.batch import Batch
from lowmem_grpo.policy.logprobs import completion_hidden, completion_logprobs
from lowmem_grpo.policy.model import build_head, enable_checkpointing
from lowmem_grpo.policy.packing import (Packing, PackingError, pack, packed_completion_hidden, packing_supported,
                                        planned_token_counts, probe_packing, resolve_pack_prompts, should_pack,
                                        token_counts)
from lowmem_grpo.policy.reference import Reference
from tests.kernels.helpers import assert_as_close_as_low_precision

SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
CONFIGS = {
    "llama": dict(model_type="llama", tie_word_embeddings=True, **SMALL),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=False, **SMALL),  # q/k/v biases
    # SmolLM2-135M's widths, heads (9 query, 3 kv, head_dim 64) and RoPE; two layers and a small vocabulary
    # (the head is the same fused op for any vocab; 49152 rows x 576 make each test ~10 s on 2 cores)
    "smollm2": {**preset("SmolLM2-135M"), "num_hidden_layers": 2, "vocab_size": 512},
}
TEMPERATURE = 0.7
GRAD_BF16_FACTOR = 2.0  # see the module docstring: sqrt(G) for G = 3, and a margin
LOGP_BF16_FACTOR = 2.0  # see the module docstring: CPUs without native bf16 round the two sdpa paths differently


def make_model(name: str, dtype=torch.float32, attn="sdpa", seed=0) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM
    conf = dict(CONFIGS[name])
    config = AutoConfig.for_model(conf.pop("model_type"), **conf)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)
    with torch.no_grad():  # Qwen2 initialises its biases to zero; give them values so they matter
        for n, p in model.named_parameters():
            if n.endswith(".bias"):
                p.normal_(0, 0.5)
    return model.to(dtype)


def make_batch(vocab: int, seed: int = 0) -> Batch:
    """3 prompts (5, 2 and 7 real tokens, left-padded to 7) x 3 completions (lengths 0..6, one fully masked)."""
    g = torch.Generator().manual_seed(seed)
    lengths, G, C = [5, 2, 7], 3, 6
    prompt_ids = torch.zeros(9, 7, dtype=torch.long)
    prompt_mask = torch.zeros(9, 7, dtype=torch.bool)
    for k, n in enumerate(lengths):
        prompt_ids[k * G:(k + 1) * G, 7 - n:] = torch.randint(3, vocab, (n,), generator=g)
        prompt_mask[k * G:(k + 1) * G, 7 - n:] = True
    completion_lengths = torch.tensor([6, 3, 1, 4, 0, 6, 2, 5, 6])  # row 4: fully masked
    completion_mask = torch.arange(C)[None, :] < completion_lengths[:, None]
    completion_ids = torch.randint(3, vocab, (9, C), generator=g).masked_fill(~completion_mask, 0)
    return Batch(prompt_ids, prompt_mask, completion_ids, completion_mask, torch.zeros(9, dtype=torch.bool))


def logp_and_grads(model, mb: Batch, pack: Packing, autocast: bool = False):
    """(log-probs (B, C) fp32, {name: grad fp32}) of sum(logp * w * mask) with fixed random weights w."""
    head = build_head(model)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        hidden = completion_hidden(head, mb, pack)  # (B, C, H)
        ids = mb.completion_ids.masked_fill(~mb.completion_mask, 0)
        logp = linear_token_logprobs(hidden, head.weight, ids, bias=head.bias, temperature=TEMPERATURE)
    w = torch.randn(logp.shape, generator=torch.Generator().manual_seed(1)).to(logp.device)
    (logp.float() * w * mb.completion_mask).sum().backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return (logp.float() * mb.completion_mask).detach(), grads


WINDOWS = [(0, 9), (2, 7)]  # whole batch; a micro-batch with a partial first and last group


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_packed_matches_unpacked_fp32(name, attn, checkpointing):
    model = make_model(name, attn=attn).train()
    if checkpointing:
        enable_checkpointing(model)
    for start, stop in WINDOWS:
        mb = make_batch(model.config.vocab_size).rows(start, stop)
        logp, grads = logp_and_grads(model, mb, pack=Packing.OFF)
        logp_p, grads_p = logp_and_grads(model, mb, pack=Packing.ALWAYS)
        assert_as_close_as_low_precision(logp_p, logp, floor=1e-5, name="logp")
        assert grads.keys() == grads_p.keys()
        for n in grads:
            assert_as_close_as_low_precision(grads_p[n], grads[n], floor=1e-5, name=n)


@pytest.mark.parametrize("precision", ["bf16_weights", "bf16_autocast"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_packed_bf16_as_close_as_unpacked(name, attn, checkpointing, precision):
    bf16_weights = precision == "bf16_weights"
    low = make_model(name, dtype=torch.bfloat16 if bf16_weights else torch.float32, attn=attn).train()
    ref = copy.deepcopy(low).float()  # the same (bf16-rounded) weights, computed in fp32
    if checkpointing:
        enable_checkpointing(low)
    mb = make_batch(low.config.vocab_size).rows(*WINDOWS[1])
    logp32, grads32 = logp_and_grads(ref, mb, pack=Packing.OFF)
    logp, grads = logp_and_grads(low, mb, pack=Packing.OFF, autocast=not bf16_weights)
    logp_p, grads_p = logp_and_grads(low, mb, pack=Packing.ALWAYS, autocast=not bf16_weights)
    assert_as_close_as_low_precision(logp_p, logp32, logp, factor=LOGP_BF16_FACTOR, floor=1e-5, name="logp")
    for n in grads32:
        assert_as_close_as_low_precision(grads_p[n], grads32[n], grads[n], factor=GRAD_BF16_FACTOR, floor=1e-5,
                                         name=n)


def test_layout_of_a_packed_micro_batch():
    mb = make_batch(50).rows(2, 7)  # prompt 0 (1 completion), prompt 1 (3), prompt 2 (1)
    assert mb.prompt_ids.shape[1] == 7  # prompt 2 keeps all its columns
    packed = pack(mb)
    assert packed.shape == (3, 2 + 4 + 0 + 6)  # the longest packed row: prompt 1 (2) + c 4 + c 0 + c 6
    # prompt 0: 5 tokens then its one completion (1 token) at positions 5
    assert packed.position_ids[0, :6].tolist() == [0, 1, 2, 3, 4, 5]
    assert packed.segment_ids[0].tolist() == [0] * 5 + [1] + [-1] * 6
    # prompt 1: 2 tokens, completions of 4, 0 and 6 tokens, each from position 2
    assert packed.position_ids[1].tolist() == [0, 1, 2, 3, 4, 5, 2, 3, 4, 5, 6, 7]
    assert packed.segment_ids[1].tolist() == [0, 0] + [2] * 4 + [4] * 6
    assert torch.equal(packed.input_ids[1, 2:6], mb.completion_ids[1, :4])
    # completion row 3 (of prompt 1, 6 tokens): token 0 is predicted by the last prompt token,
    # token j by token j - 1 of its own completion
    L = packed.shape[1]
    assert packed.gather[3].tolist() == [L + 1, L + 6, L + 7, L + 8, L + 9, L + 10]
    assert packed.gather[2].tolist() == [L + 1] * 6  # the fully masked row points at valid hidden states
    visible = packed.visible()[:, 0]  # (R, L, L)
    assert not visible[1, 6:, 2:6].any()  # the third completion does not see the first
    assert visible[1, 6:, :2].all()  # but sees the whole prompt
    assert (visible.sum(-1) >= 1).all()  # no fully masked query row
    assert visible[0, 7].sum() == 1 and visible[0, 7, 7]  # padding sees only itself


def test_packing_computes_fewer_tokens():
    mb = make_batch(50)
    counts = token_counts(mb)
    assert counts.unpacked == 9 * (7 + 6)
    assert counts.packed_rows == 3
    assert counts.packed_length == max(5 + 10, 2 + 10, 7 + 13)  # prompt + its completions' real tokens
    assert counts.packed == 60 < counts.unpacked
    assert (counts.unpacked_pairs, counts.packed_pairs) == (9 * 13 ** 2, 3 * 20 ** 2)
    assert counts.mask_bytes() == 3 * 20 ** 2 and counts.mask_bytes(4) == 4 * counts.mask_bytes()
    # the planner's worst case bounds every micro-batch of the same shape
    plan = planned_token_counts(micro_batch=5, num_generations=3, prompt_length=7, completion_length=6)
    assert (plan.packed_rows, plan.packed_length) == (3, 7 + 3 * 6)
    # G = 8 completions in a micro-batch of 8: one row when aligned, worst case two rows (4 + 4 or 1 + 7)
    assert planned_token_counts(8, 8, 100, 50).packed == 2 * (100 + 7 * 50)
    for start in range(0, 5):
        got = token_counts(make_batch(50).rows(start, start + 5))
        assert got.packed_rows <= plan.packed_rows and got.packed_length <= plan.packed_length


def test_identical_prompts_of_different_groups_share_a_row():
    mb = make_batch(50)
    mb.prompt_ids[3:6], mb.prompt_mask[3:6] = mb.prompt_ids[0], mb.prompt_mask[0]
    assert pack(mb).shape[0] == 2


def test_completion_logprobs_packed_in_micro_batches():
    model = make_model("qwen2").eval()
    head, batch = build_head(model), make_batch(model.config.vocab_size)
    kw = dict(temperature=TEMPERATURE, micro_batch=4, device=torch.device("cpu"))
    plain = completion_logprobs(head, batch, **kw)
    packed = completion_logprobs(head, batch, **kw, pack=Packing.ALWAYS)
    torch.testing.assert_close(packed, plain, rtol=1e-5, atol=1e-5)
    assert (packed[4] == 0).all() and (packed[2, 1:] == 0).all()


@pytest.mark.parametrize("mode", ["cpu", "stream"])
def test_reference_packed(mode):
    model = make_model("llama").eval()
    ref = Reference(copy.deepcopy(model), torch.device("cpu"), mode)
    batch = make_batch(model.config.vocab_size)
    plain = ref.logprobs(batch, temperature=TEMPERATURE, micro_batch=4)
    packed = ref.logprobs(batch, temperature=TEMPERATURE, micro_batch=4, pack=Packing.ALWAYS)
    torch.testing.assert_close(packed, plain, rtol=1e-5, atol=1e-5)
    expected = completion_logprobs(build_head(model), batch, temperature=TEMPERATURE, micro_batch=4,
                                   device=torch.device("cpu"))
    torch.testing.assert_close(packed, expected, rtol=1e-5, atol=1e-5)


# ----- refusals ----------------------------------------------------------------------------------

@pytest.mark.parametrize("impl", ["flash_attention_2", "flash_attention_3", "paged|sdpa"])
def test_attention_without_masks_is_refused_naming_the_fix(impl):
    model = make_model("llama")
    model.config._attn_implementation = impl
    ok, reason = packing_supported(model)
    assert not ok and impl in reason and "train.pack_prompts=false" in reason and "attn_implementation=sdpa" in reason
    assert resolve_pack_prompts(None, model) is False  # default: quietly unpacked
    assert resolve_pack_prompts(False, model) is False
    with pytest.raises(PackingError, match="train.pack_prompts=false"):
        resolve_pack_prompts(True, model)
    with pytest.raises(PackingError, match=impl.replace("|", r"\|")):
        completion_hidden(build_head(model), make_batch(97), pack=Packing.ALWAYS)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_supported_models_resolve_on(attn):
    assert resolve_pack_prompts(None, make_model("qwen2", attn=attn)) is True
    assert resolve_pack_prompts(True, make_model("llama", attn=attn)) is True


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packing_mode_follows_the_setting(attn):
    model = make_model("qwen2", attn=attn)
    assert Packing.resolve(None, model) is Packing.AUTO  # unset: each micro-batch where it pays
    assert Packing.resolve(True, model) is Packing.ALWAYS
    assert Packing.resolve(False, model) is Packing.OFF
    unsupported = make_model("llama")
    unsupported.config._attn_implementation = "flash_attention_2"
    assert Packing.resolve(None, unsupported) is Packing.OFF


def test_should_pack_takes_a_mode_not_a_flag():
    mb = make_batch(97)
    assert should_pack(Packing.ALWAYS, mb, None) and not should_pack(Packing.OFF, mb, None)
    with pytest.raises(TypeError, match="Packing"):
        should_pack(True, mb, None)


def test_sliding_window_is_refused_unless_sequences_stay_inside_it():
    from transformers import AutoConfig, AutoModelForCausalLM
    conf = {k: v for k, v in CONFIGS["qwen2"].items() if k != "model_type"}
    config = AutoConfig.for_model("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=0, **conf)
    model = AutoModelForCausalLM.from_config(config)
    ok, reason = packing_supported(model)
    assert not ok and "sliding" in reason and "train.pack_prompts=false" in reason
    assert packing_supported(model, max_length=8)[0]
    assert not packing_supported(model, max_length=9)[0]
    with pytest.raises(PackingError, match="sliding window"):  # 7 + 6 tokens reach the window at run time
        completion_hidden(build_head(model), make_batch(97), pack=Packing.ALWAYS)


@pytest.mark.parametrize("layer_type", ["linear_attention", "mamba"])
def test_layers_that_do_not_attend_through_the_mask_are_refused(layer_type):
    model = make_model("llama")
    model.config.layer_types = ["full_attention", layer_type]
    ok, reason = packing_supported(model)
    assert not ok and layer_type in reason


class _Ignoring(nn.Module):
    """A decoder that drops one of its inputs (as an architecture that rebuilds it would)."""

    def __init__(self, decoder, drop):
        super().__init__()
        self.inner, self.drop, self.config = decoder, drop, decoder.config

    def get_input_embeddings(self):
        return self.inner.get_input_embeddings()

    def forward(self, **kwargs):
        if self.drop == "attention_mask" and kwargs["attention_mask"].dim() == 4:
            kwargs["attention_mask"] = None  # plain causal attention: packed completions see each other
        if self.drop == "position_ids":
            kwargs["position_ids"] = None  # 0..L-1: later completions get shifted positions
        return self.inner(**kwargs)


@pytest.mark.parametrize("drop", ["attention_mask", "position_ids"])
def test_probe_catches_decoders_that_ignore_the_packed_inputs(drop):
    decoder = make_model("llama").model
    assert probe_packing(decoder) == ""
    reason = probe_packing(_Ignoring(decoder, drop))
    assert "does not honour" in reason
    assert resolve_pack_prompts(None, _Ignoring(decoder, drop)) is False
    with pytest.raises(PackingError, match="does not honour"):
        resolve_pack_prompts(True, _Ignoring(decoder, drop))


def test_probe_passes_bf16():
    assert probe_packing(make_model("smollm2", dtype=torch.bfloat16).model) == ""


def test_holes_in_completion_mask_are_refused():
    mb = make_batch(50)
    mb.completion_mask[0, 2] = False
    with pytest.raises(PackingError, match="prefix"):
        pack(mb)


# ----- flex_attention ----------------------------------------------------------------------------

def test_flex_block_mask_is_the_bool_mask():
    from torch.nn.attention.flex_attention import create_mask
    packed = pack(make_batch(50).rows(2, 7))
    R, L = packed.shape
    dense = create_mask(packed.block_mask().mask_mod, R, 1, L, L, device="cpu")  # (R, 1, L, L)
    assert torch.equal(dense, packed.visible())


@pytest.mark.slow  # transformers compiles flex_attention (inductor + a C++ compiler): ~30 s on 2 CPU cores
def test_packed_matches_unpacked_flex_attention_forward():
    """Forward only: torch has no FlexAttention backward on the CPU (packed or not); the CUDA test
    below checks gradients."""
    model = make_model("llama", attn="flex_attention").eval()
    head, batch = build_head(model), make_batch(model.config.vocab_size)
    kw = dict(temperature=TEMPERATURE, micro_batch=5, device=torch.device("cpu"))
    torch.testing.assert_close(completion_logprobs(head, batch, **kw, pack=Packing.ALWAYS),
                               completion_logprobs(head, batch, **kw), rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("attn", ["sdpa", "flex_attention"])
def test_packed_matches_unpacked_on_cuda(attn):
    model = make_model("qwen2", dtype=torch.bfloat16, attn=attn).cuda().train()
    ref = copy.deepcopy(model).float()
    mb = make_batch(model.config.vocab_size).rows(*WINDOWS[1]).to(torch.device("cuda"))
    logp32, grads32 = logp_and_grads(ref, mb, pack=Packing.OFF)
    logp, grads = logp_and_grads(model, mb, pack=Packing.OFF)
    logp_p, grads_p = logp_and_grads(model, mb, pack=Packing.ALWAYS)
    assert_as_close_as_low_precision(logp_p, logp32, logp, factor=LOGP_BF16_FACTOR, floor=1e-5, name="logp")
    for n in grads32:
        assert_as_close_as_low_precision(grads_p[n], grads32[n], grads[n], factor=GRAD_BF16_FACTOR, floor=1e-5,
                                         name=n)
    assert packed_completion_hidden(model.model, mb).shape == (*mb.completion_ids.shape, model.config.hidden_size)
