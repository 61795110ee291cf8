"""vLLM's share in the plan (memory/vllm_plan.py): generation.engine=vllm takes vllm_gpu_memory_utilization of
the card in every phase, the trainer makes no KV cache of its own, the correction's old log-prob pass is
counted, a share too small for vLLM is refused with the utilization that starts, and the suggestions
offer the share vLLM needs and the native engine. Runs without vLLM installed (shapes only)."""

import json
import math
from pathlib import Path

import pytest
import torch

from lowmem_grpo.cli import main
from lowmem_grpo.config import ConfigError, load_config, rollout_engine, validate
from lowmem_grpo.memory import fit as fit_module
from lowmem_grpo.memory import vllm_plan
from lowmem_grpo.memory.plan import Arch, plan
from lowmem_grpo.memory.suggest import suggestions
from lowmem_grpo.memory.presets import preset
from lowmem_grpo.policy.vllm_engine import BATCHED_TOKENS, engine_sizes
from tests.memory.test_fit import fake_card

GiB = 2**30
RECIPES = Path(__file__).parents[2] / "recipes"
R05 = str(RECIPES / "qwen2.5-0.5b_gsm8k_8gb.yaml")
R15 = str(RECIPES / "qwen2.5-1.5b_gsm8k_8gb.yaml")


def arch(name: str) -> Arch:
    return Arch.from_config(preset(name))


def test_vllm_takes_its_share_in_every_phase_and_the_trainer_no_kv_cache():
    native = load_config(R15, check=False)
    cfg = load_config(R15, ["engine=vllm"], check=False)
    a = arch("Qwen2.5-1.5B")
    before, after = plan(native, a), plan(cfg, a, card_bytes=12 * GiB)
    share = math.ceil(12 * GiB * cfg.generation.vllm_gpu_memory_utilization)
    assert after.vllm["share_bytes"] == share
    assert all(cats["vLLM"] == share for cats in after.phase_categories.values())
    assert "KV cache" not in after.phase_categories["rollout"]
    assert before.phase_categories["rollout"]["KV cache"] > 0
    # the phases the trainer shares with the native plan are the same, vLLM's share on top
    for phase in ("forward", "backward", "evaluation"):
        assert after.phases[phase] == before.phases[phase] + share
    assert before.vllm is None and "vLLM" not in before.categories


def test_the_corrections_old_logprob_pass_is_counted():
    """One optimizer step per generation batch: the native plan has no old log-prob pass; vLLM's correction
    needs one (the trainer's log-probs of vLLM's samples), unless the correction is off."""
    a = arch("Qwen2.5-0.5B")
    overrides = ["per_device_train_batch_size=32", "gradient_accumulation_steps=1"]
    assert "old log-probs" not in plan(load_config(R05, overrides, check=False), a).phases
    assert "old log-probs" in plan(load_config(R05, overrides + ["engine=vllm"], check=False), a).phases
    off = load_config(R05, overrides + ["engine=vllm", "vllm_importance_sampling_correction=false"], check=False)
    assert "old log-probs" not in plan(off, a).phases


@pytest.mark.parametrize("autocast, precision, bytes_", [(True, "fp32", 2), (False, "fp32", 4), (True, "bf16_sr", 2)])
def test_what_vllm_needs_inside_its_share(autocast, precision, bytes_):
    cfg = load_config(R05, ["engine=vllm", f"precision={precision}", "max_completion_length=500"], check=False)
    a = arch("Qwen2.5-0.5B")
    need = vllm_plan.need(cfg, a, autocast)
    sizes = engine_sizes(cfg)
    assert sizes.max_model_len == cfg.generation.max_prompt_length + 500
    assert need.sequences == sizes.max_num_seqs > 1
    blocks = math.ceil(sizes.max_model_len / vllm_plan.BLOCK)
    assert need.weights == bytes_ * a.params
    assert need.kv_per_sequence == blocks * vllm_plan.BLOCK * a.layers * 2 * a.kv_heads * a.head_dim * bytes_
    assert need.whole_batch - need.least == need.kv_per_sequence * (need.sequences - 1)
    assert need.activations > vllm_plan.LOGIT_BUFFERS * 4 * need.sequences * a.vocab  # and the profiling forward
    assert sizes.max_num_batched_tokens == max(BATCHED_TOKENS, sizes.max_num_seqs, sizes.max_model_len)


def test_the_engine_holds_one_generation_batch_and_the_length_limit():
    cfg = load_config(R05, ["engine=vllm", "vllm_max_model_length=900"], check=False)
    from lowmem_grpo.config import batch_plan
    assert engine_sizes(cfg).max_model_len == 900
    assert engine_sizes(cfg).max_num_seqs == batch_plan(cfg).completions_per_rank


def test_a_share_too_small_names_the_utilization_that_starts():
    a = arch("Qwen2.5-1.5B")
    cfg = load_config(R15, ["engine=vllm", "vllm_gpu_memory_utilization=0.1"], check=False)
    entry = plan(cfg, a, card_bytes=8 * GiB).vllm
    least = entry["least_utilization"]
    assert entry["problem"] and f"vllm_gpu_memory_utilization={least} at least" in entry["problem"]
    assert "or engine=native" in entry["problem"]
    # the named utilization starts, a hundredth less does not
    assert plan(load_config(R15, ["engine=vllm", f"vllm_gpu_memory_utilization={least}"], check=False), a,
                card_bytes=8 * GiB).vllm["problem"] is None
    lower = round(least - 0.01, 2)
    assert plan(load_config(R15, ["engine=vllm", f"vllm_gpu_memory_utilization={lower}"], check=False), a,
                card_bytes=8 * GiB).vllm["problem"] is not None
    assert entry["least_bytes"] <= least * 8 * GiB and entry["whole_batch_bytes"] <= entry["whole_batch_utilization"] \
        * 8 * GiB


def test_suggestions_offer_the_share_vllm_needs_and_the_native_engine():
    """The 0.5B recipe with vLLM at 0.5 of a 12 GB card does not fit 10 GiB free: vLLM's share cut to what a
    whole batch needs comes first, and the native engine is among the changes."""
    a = arch("Qwen2.5-0.5B")
    cfg = load_config(R05, ["engine=vllm", "vllm_gpu_memory_utilization=0.5"], check=False)
    ideas = suggestions(cfg, a, budget=10 * GiB, card_bytes=12 * GiB)
    whole = plan(cfg, a, card_bytes=12 * GiB).vllm["whole_batch_utilization"]
    assert ideas[0].change == f"vllm_gpu_memory_utilization={whole}"
    native = [s for s in ideas if s.change == "engine=native"]
    assert native and native[0].peak_bytes == plan(load_config(R05, check=False), a).peak_bytes


def test_train_refuses_a_vllm_share_too_small_before_loading(monkeypatch):
    fake_card(monkeypatch, free=20 * GiB, total=24 * GiB)
    cfg = load_config(R15, ["engine=vllm", "vllm_gpu_memory_utilization=0.05"], check=False)
    with pytest.raises(ConfigError, match=r"vLLM would not start on cuda:0 \(Fake RTX 8GB\): "
                                          r"vllm_gpu_memory_utilization=0.05 gives vLLM 1.20 GiB of the 24.00 GiB"):
        fit_module.check_device_memory(cfg, arch("Qwen2.5-1.5B"), torch.device("cuda", 0), autocast=True)
    fine = load_config(R15, ["engine=vllm", "vllm_gpu_memory_utilization=0.3"], check=False)
    got = fit_module.check_device_memory(fine, arch("Qwen2.5-1.5B"), torch.device("cuda", 0), autocast=True)
    assert got.fits and got.vllm_problem is None
    assert got.peak_bytes == plan(fine, arch("Qwen2.5-1.5B"), autocast=True, card_bytes=24 * GiB).peak_bytes


def test_plan_prints_vllms_share(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    capsys.readouterr()
    assert main(["plan", R15, "engine=vllm", "--gpu-memory", "24GiB", "--host-memory", "64GiB"]) == 0
    text = capsys.readouterr().out
    assert "vLLM (engine=vllm): share 7.20 GiB = vllm_gpu_memory_utilization 0.3 x the 24.00 GiB card" in text
    assert main(["plan", R15, "engine=vllm", "--gpu-memory", "8GiB", "--host-memory", "64GiB", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["vllm"]["problem"] and not out["fits"]  # 0.3 of 8 GiB is less than 1.5B needs to start


def test_vllm_on_the_cpu_is_host_ram():
    a = arch("Qwen2.5-0.5B")
    cfg = load_config(R05, ["engine=vllm", "vllm_cpu_kv_cache_gib=2"], check=False)
    result = plan(cfg, a, device="cpu")
    assert result.host_categories["vLLM"] == 4 * a.params + 2 * GiB
    assert "vLLM" not in result.categories


def test_trls_names_choose_the_engine(monkeypatch):
    cfg = load_config(R05, ["use_vllm=true"], check=False)
    assert rollout_engine(cfg.generation) == "vllm" and vllm_plan.uses_vllm(cfg)
    assert rollout_engine(load_config(R05, ["use_vllm=false"], check=False).generation) == "native"
    with pytest.raises(ConfigError, match="use_vllm=false contradicts generation.engine=vllm"):
        validate(load_config(R05, ["use_vllm=false", "engine=vllm"], check=False))
    with pytest.raises(ConfigError, match="vllm_mode=server .* is not built.*set vllm_mode=colocate"):
        validate(load_config(R05, ["use_vllm=true", "vllm_mode=server"], check=False))


@pytest.mark.parametrize("recipe, name, utilization", [(R05, "Qwen2.5-0.5B", 0.15), (R15, "Qwen2.5-1.5B", 0.34)])
def test_the_figures_in_docs_are_the_planners(recipe, name, utilization):
    """docs/rollouts.md's table of the shipped recipes with vLLM, row by row."""
    from lowmem_grpo.memory.plan import margin_bytes
    a = arch(name)
    with_margin = lambda r: (r.peak_bytes + margin_bytes(r.peak_bytes)) / GiB  # noqa: E731
    native = plan(load_config(recipe, check=False), a)
    cfg = load_config(recipe, ["engine=vllm", f"vllm_gpu_memory_utilization={utilization}"], check=False)
    vllm = plan(cfg, a, card_bytes=12 * GiB)
    entry = vllm.vllm
    assert entry["whole_batch_utilization"] == utilization and entry["problem"] is None
    row = (f"| `{Path(recipe).name}` | {with_margin(native):.2f} GiB | {entry['least_bytes'] / GiB:.2f} / "
           f"{entry['whole_batch_bytes'] / GiB:.2f} GiB | {with_margin(vllm):.2f} GiB (U {utilization} of 12 GiB) |")
    assert row in (Path(__file__).parents[2] / "docs" / "rollouts.md").read_text()


@pytest.mark.skipif(__import__("importlib").util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_use_vllm_without_vllm_names_the_extra():
    from lowmem_grpo import GRPOConfig
    with pytest.raises(ConfigError, match=r"pip install 'lowmem-grpo\[vllm\]'"):
        GRPOConfig(use_vllm=True, vllm_mode="colocate")
    assert GRPOConfig(use_vllm=False).use_vllm is False
