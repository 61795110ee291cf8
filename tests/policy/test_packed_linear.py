"""Linear weights packed once per rollout for CPU decoding (policy/packed_linear.py, sample(packed=True)).

bf16 (weights, or fp32 weights under bf16 autocast): oneDNN's packed GEMM computes what F.linear computes,
so sampled rows follow the same seeded stream token for token. fp32: the packed GEMM rounds differently
(~1e-6): greedy tokens equal on these tiny random models, logits within 1e-4.
"""

import dataclasses
import logging

import pytest
import torch

from lowmem_grpo.config import GenerationConfig
from lowmem_grpo.policy import packed_linear
from lowmem_grpo.policy.packed_linear import (linear_shapes, pack_problem, packed_bytes, packed_gemm_speedup,
                                              packed_linears, use_packed)
from lowmem_grpo.policy.rollout import generate
from lowmem_grpo.policy.sampling import sample

from .test_sampling import CPU, PAD, frequent_token, random_prompts, tiny_model

needs_bf16 = pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                                reason="this CPU has no oneDNN bf16 GEMM")


def _setup(arch: str, dtype: torch.dtype, micro_batch: int = 4):
    model = tiny_model(arch).to(dtype)
    distinct = random_prompts([3, 7, 5, 9], 64)
    cfg = GenerationConfig(max_completion_length=12, generation_micro_batch_size=micro_batch, max_prompt_length=16)
    return model, distinct, cfg


@needs_bf16
@pytest.mark.parametrize("arch, dtype, autocast_bf16, decode, packed", [
    ("llama", torch.bfloat16, False, "dynamic", True), ("qwen2", torch.float32, True, "dynamic", True),
    ("llama", torch.float32, True, "static", True), ("qwen2", torch.float32, True, "dynamic", "head")])
def test_packed_bf16_samples_the_same_stream(arch, dtype, autocast_bf16, decode, packed):
    """Sampled (temperature 1, seeded), with refills: packed bf16 weights (all, or the head's) give the same
    tokens."""
    model, distinct, cfg = _setup(arch, dtype)
    kw = dict(eos_ids=[5], pad_id=PAD, device=CPU, autocast_bf16=autocast_bf16, decode=decode)
    out = {}
    for setting in (False, packed):
        torch.manual_seed(3)
        out[setting] = sample(model, distinct, 3, cfg, packed=setting, **kw)
    assert torch.equal(out[False], out[packed]), f"\n{out[False]}\n{out[packed]}"
    assert (out[False] != PAD).sum(1).unique().numel() > 1  # rows of different lengths: refills happened


@pytest.mark.parametrize("arch, packed", [("llama", True), ("qwen2", True), ("llama", "head")])
def test_packed_fp32_greedy_matches_generate(arch, packed):
    """fp32: greedy tokens equal transformers' generate(); the packed forward's logits within 1e-4."""
    model, distinct, cfg = _setup(arch, torch.float32)
    eos = frequent_token(model, distinct, cfg)
    prompts = [p for p in distinct for _ in range(3)]
    slow = generate(model, prompts, dataclasses.replace(cfg, fast_rollout=False), eos_ids=[eos], pad_id=PAD,
                    device=CPU, greedy=True).completion_ids
    fast = sample(model, distinct, 3, cfg, eos_ids=[eos], pad_id=PAD, device=CPU, greedy=True, packed=packed)
    assert torch.equal(fast, slow), f"\n{fast}\n{slow}"
    ids = torch.tensor([distinct[3]])
    with torch.no_grad():
        plain = model(ids).logits
        with packed_linears(model, 4, head_only=packed == "head"):
            logits = model(ids).logits
    torch.testing.assert_close(logits, plain, rtol=0, atol=1e-4)


def test_packed_linears_restores_the_model():
    """After the block the layers run their own forward on their own parameters, unchanged."""
    model, distinct, _ = _setup("llama", torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.tensor([distinct[1]])
    with torch.no_grad():
        plain = model(ids).logits
        with packed_linears(model, 4):
            assert all("forward" in m.__dict__ for m in model.modules() if isinstance(m, torch.nn.Linear))
        after = model(ids).logits
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert torch.equal(after, plain)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_head_only_packs_the_output_head_alone():
    """head_only: the output head runs on a packed copy (its bytes: vocab x hidden in the compute dtype), the
    other Linear layers on their own weights; afterwards the head's own forward again."""
    model, distinct, _ = _setup("llama", torch.float32)
    head = model.get_output_embeddings()
    ids = torch.tensor([distinct[1]])
    with torch.no_grad():
        plain = model(ids).logits
        with packed_linears(model, 4, head_only=True) as nbytes:
            assert [m for m in model.modules() if "forward" in m.__dict__] == [head]
            assert nbytes == 4 * head.weight.numel() == packed_bytes(model, head_only=True)
            packed = model(ids).logits
            assert head.weight is not model.get_input_embeddings().weight  # untied: zeroing leaves the input alone
            kept = head.weight.clone()
            head.weight.zero_()  # the packed copy, not the parameter, is what the head multiplies by
            assert torch.equal(model(ids).logits, packed)
            head.weight.copy_(kept)
        bf16_bytes = packed_linear.gemm_dtype(torch.bfloat16).itemsize  # 4 where this CPU widens bf16
        assert packed_bytes(model, autocast_bf16=True, head_only=True) == bf16_bytes * head.weight.numel()
    assert not any("forward" in m.__dict__ for m in model.modules())
    torch.testing.assert_close(packed, plain, rtol=0, atol=1e-4)


def test_packed_bytes_counts_a_tied_head_once():
    """One packed copy per distinct Linear weight: a tied output head shares the embedding's; under autocast
    the fp32 weights' copies are bf16 (fp32 where the CPU widens bf16), biases included (qwen2's q/k/v)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    head = model.get_output_embeddings().weight.numel()
    assert packed_bytes(model) == 4 * (linear - head) + 4 * head  # the head once, though two modules hold it
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    qwen = tiny_model("qwen2")
    biases = sum(m.bias.numel() for m in qwen.modules() if isinstance(m, torch.nn.Linear) and m.bias is not None)
    weights = sum(m.weight.numel() for m in qwen.modules() if isinstance(m, torch.nn.Linear))
    bf16_bytes = packed_linear.gemm_dtype(torch.bfloat16).itemsize  # 4 where this CPU widens bf16
    assert packed_bytes(qwen) == 4 * weights
    assert packed_bytes(qwen, autocast_bf16=True) == bf16_bytes * (weights + biases)


def test_packed_refusals(caplog):
    """Not on other devices, not with the compiled step, not fp16: one clear error (sample) or a logged
    fallback (the generation setting)."""
    model, distinct, cfg = _setup("llama", torch.float32)
    with pytest.raises(ValueError, match="packed=True.*compiled"):
        sample(model, distinct, 2, cfg, eos_ids=[5], pad_id=PAD, device=CPU, packed=True, decode="compiled")
    assert "CPU path" in pack_problem(model, torch.device("cuda"))
    half = tiny_model("llama").half()
    assert "packing takes fp32 or bf16" in pack_problem(half, CPU)
    with pytest.raises(ValueError, match="pack_decode_weights=false"):
        with packed_linears(half, 4):
            pass
    with caplog.at_level(logging.WARNING):
        assert not use_packed(half, True, CPU)
    assert any("pack_decode_weights" in r.getMessage() for r in caplog.records)
    assert use_packed(model, True, CPU) is True and use_packed(model, False, CPU) is False
    assert use_packed(model, "head", CPU) == "head"
    model.lm_head = torch.nn.Identity()  # a head that is no nn.Linear: nothing to pack
    assert "no nn.Linear" in pack_problem(model, CPU, head_only=True)
    with caplog.at_level(logging.WARNING):
        assert use_packed(model, "head", CPU) is False


def test_generate_packs_when_set(monkeypatch):
    """generation.pack_decode_weights: rollout.generate samples with packed as set (auto by default, which
    the suite's LOWMEM_GRPO_PACK_DECODE=0 turns off, and =1 on)."""
    import lowmem_grpo.policy.rollout as rollout
    seen = []
    real = rollout.sample
    monkeypatch.setattr(rollout, "sample", lambda *a, **kw: seen.append(kw["packed"]) or real(*a, **kw))
    model, distinct, cfg = _setup("llama", torch.float32)
    for on in (False, True, "head", "auto"):
        generate(model, distinct, dataclasses.replace(cfg, pack_decode_weights=on), eos_ids=[5], pad_id=PAD,
                 device=CPU)
    monkeypatch.setenv("LOWMEM_GRPO_PACK_DECODE", "1")
    generate(model, distinct, cfg, eos_ids=[5], pad_id=PAD, device=CPU)
    assert seen == [False, True, "head", False, True]
    assert GenerationConfig().pack_decode_weights == "auto"


def test_auto_packs_where_the_measured_speedup_reaches_the_threshold(monkeypatch, caplog):
    """auto, measured: True from PACK_MIN_SPEEDUP up (logged once, with the speed-up), False below it and
    wherever packing is impossible (another device, fp16 weights; nothing logged as a warning there)."""
    monkeypatch.delenv("LOWMEM_GRPO_PACK_DECODE")
    model, _, _ = _setup("llama", torch.float32)
    asked = []
    for speedup, expected in ((packed_linear.PACK_MIN_SPEEDUP, True), (1.0, False), (3.0, True)):
        monkeypatch.setattr(packed_linear, "packed_gemm_speedup", lambda *a, s=speedup: asked.append(a) or s)
        with caplog.at_level(logging.INFO, logger=packed_linear.__name__):
            assert use_packed(model, "auto", CPU, rows=96) is expected
    assert [a[1:3] for a in asked] == [(64, torch.float32)] * 3  # rows capped at 64, the weights' dtype
    assert asked[0][0] == linear_shapes(model)
    assert any("auto: packed weights on" in r.getMessage() and "3.00x" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert use_packed(model, "auto", torch.device("cuda")) is False
        assert use_packed(tiny_model("llama").half(), "auto", CPU) is False
    assert not caplog.records and len(asked) == 3


def test_packed_gemm_speedup_measures_every_shape():
    """The measurement times each shape both ways: a positive ratio, and linear_shapes counts a tied
    weight once and every layer's shape by its count."""
    model, _, _ = _setup("qwen2", torch.float32)
    shapes = linear_shapes(model)
    layers = model.config.num_hidden_layers
    counted = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    assert sum(n for _, _, n in shapes) == len(counted)
    assert all(n % layers == 0 or (o, i) == tuple(model.lm_head.weight.shape) for o, i, n in shapes)
    speedup = packed_gemm_speedup(shapes, 4, torch.float32, torch.get_num_threads())
    assert 0.05 < speedup < 20


def _gemm_in(monkeypatch, gemm: str) -> None:
    """Pack bf16 values as bf16 ("native", a CPU with oneDNN's bf16 GEMM) or as fp32 ("widened", one without),
    whatever this CPU has."""
    from lowmem_grpo.memory import host_plan
    chosen = (lambda dtype: dtype) if gemm == "native" else (lambda dtype: torch.float32)
    for module in (packed_linear, host_plan):
        monkeypatch.setattr(module, "gemm_dtype", chosen)


@pytest.mark.parametrize("arch, autocast_bf16", [("llama", False), ("qwen2", False), ("qwen2", True)])
def test_bf16_values_through_fp32_packed_gemms(monkeypatch, arch, autocast_bf16):
    """Where this CPU has no oneDNN bf16 GEMM: fp32 copies of the bf16 values (4 bytes each, biases too), every
    layer's output bf16 and within one bf16 rounding of F.linear's (most of them equal), the model's logits
    too; sampling runs through them, under autocast as well."""
    _gemm_in(monkeypatch, "widened")
    model, distinct, cfg = _setup(arch, torch.float32 if autocast_bf16 else torch.bfloat16)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    params = sum(p.numel() for m in linears for p in (m.weight, m.bias) if p is not None)
    ids = torch.tensor([distinct[3]])
    x = torch.randn(5, model.config.hidden_size)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast_bf16):
        plain = model(ids).logits
        layers = [m(x if autocast_bf16 else x.bfloat16()) for m in linears if m.in_features == x.shape[1]]
        with packed_linears(model, 4, autocast_bf16) as nbytes:
            assert nbytes == 4 * params == packed_bytes(model, autocast_bf16)
            packed = model(ids).logits
            packed_layers = [m(x if autocast_bf16 else x.bfloat16()) for m in linears if m.in_features == x.shape[1]]
    assert packed.dtype == plain.dtype == torch.bfloat16 and len(layers) > 3
    for got, want in zip(packed_layers, layers):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, want, rtol=2 ** -7, atol=1e-6)  # one bf16 rounding apart at most
    assert sum(int((g == w).sum()) for g, w in zip(packed_layers, layers)) >= 0.9 * sum(w.numel() for w in layers)
    torch.testing.assert_close(packed.float(), plain.float(), rtol=0.05, atol=0.05)
    torch.manual_seed(3)
    out = sample(model, distinct, 3, cfg, eos_ids=[5], pad_id=PAD, device=CPU, autocast_bf16=autocast_bf16,
                 packed=True)
    assert out.shape[0] == 3 * len(distinct) and ((out >= 0) & (out < model.config.vocab_size)).all()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("setting", [True, "head"])
@pytest.mark.parametrize("gemm", ["native", "widened"])
def test_the_planner_counts_the_packed_copy(monkeypatch, arch, bf16, setting, gemm):
    """memory/plan.py's host category "packed decode weights" is packed_bytes of the model, to 0.5% (the
    planner leaves out the bias copies autocast makes), bf16 copies widened to fp32 where the CPU has no bf16
    GEMM; absent with the setting off."""
    from lowmem_grpo.config import Config
    from lowmem_grpo.memory.plan import Arch, plan
    _gemm_in(monkeypatch, gemm)
    model = tiny_model(arch)
    cfg = Config()
    cfg.model.bf16 = bf16
    cfg.generation.pack_decode_weights = setting
    result = plan(cfg, Arch.from_config(model.config), autocast=bf16, device="cpu")
    expected = packed_bytes(model, autocast_bf16=bf16, head_only=setting == "head")
    assert result.host_categories["packed decode weights"] == pytest.approx(expected, rel=5e-3)
    halved = bf16 and gemm == "native"  # bf16 copies: half the fp32 ones' bytes, unless widened to fp32
    fp32_bytes = packed_bytes(model, head_only=setting == "head")
    assert expected == pytest.approx(fp32_bytes / 2 if halved else fp32_bytes, rel=5e-3)
    cfg.generation.pack_decode_weights = False
    assert "packed decode weights" not in plan(cfg, Arch.from_config(model.config), autocast=bf16,
                                               device="cpu").host_categories


def test_the_planner_counts_auto_as_packing_unless_told(monkeypatch):
    """auto (measured only when a rollout starts) is planned as true, the larger case; LOWMEM_GRPO_PACK_DECODE
    decides it for the planner as for the rollout."""
    from lowmem_grpo.config import Config
    from lowmem_grpo.memory.plan import Arch, plan
    model = tiny_model("llama")
    cfg = Config()
    assert cfg.generation.pack_decode_weights == "auto"
    arch = Arch.from_config(model.config)
    monkeypatch.delenv("LOWMEM_GRPO_PACK_DECODE")
    assert plan(cfg, arch, autocast=False, device="cpu").host_categories["packed decode weights"] == pytest.approx(
        packed_bytes(model), rel=5e-3)
    monkeypatch.setenv("LOWMEM_GRPO_PACK_DECODE", "1")
    assert "packed decode weights" in plan(cfg, arch, autocast=False, device="cpu").host_categories
    monkeypatch.setenv("LOWMEM_GRPO_PACK_DECODE", "0")
    assert "packed decode weights" not in plan(cfg, arch, autocast=False, device="cpu").host_categories
