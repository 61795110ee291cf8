"""`lowmem-grpo plan --largest`: which presets fit a card with a run's settings, and the largest that does;
and the presets it compares (the real models' sizes, resolvable by hub id offline)."""

import json
from pathlib import Path

import pytest
import torch

from lowmem_grpo.cli.plan import run, run_largest
from lowmem_grpo.config import ConfigError, load_config
from lowmem_grpo.memory import largest as largest_module
from lowmem_grpo.memory.largest import candidates, format_candidates, largest, verdict
from lowmem_grpo.memory.plan import Arch, margin_bytes, plan
from lowmem_grpo.memory.presets import preset

GiB = 2**30
RECIPE_3B = Path(__file__).parents[2] / "recipes" / "qwen2.5-3b_gsm8k_8gb.yaml"
# around the 3B recipe's limit: Llama-3.2-3B has more parameters than Qwen2.5-3B but a 3x larger
# KV cache per token and a larger tied embedding; Qwen3-4B's bf16 weights alone fill 7.5 GiB
AROUND_3B = ["Qwen3-4B", "Llama-3.2-3B", "Qwen2.5-3B", "Qwen2.5-1.5B"]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_the_3b_recipe_at_7_5_gib_the_largest_is_qwen2_5_3b():
    cfg = load_config(RECIPE_3B)
    found = candidates(cfg, int(7.5 * GiB), 1024 * GiB, AROUND_3B)
    assert [c.name for c in found] == ["Qwen2.5-1.5B", "Qwen2.5-3B", "Llama-3.2-3B", "Qwen3-4B"]  # by parameters
    assert {c.name: c.fits for c in found} == {"Qwen2.5-1.5B": True, "Qwen2.5-3B": True, "Llama-3.2-3B": False,
                                                "Qwen3-4B": False}
    best = largest(found)
    assert best.name == "Qwen2.5-3B"
    # each figure is the planner's for that preset, as `lowmem-grpo plan RECIPE --model NAME` prints it
    result = plan(cfg, Arch.from_config(preset("Qwen2.5-3B")))
    assert (best.peak_bytes, best.peak_phase) == (result.peak_bytes, result.peak_phase)
    assert best.total_bytes == result.peak_bytes + margin_bytes(result.peak_bytes)
    assert best.host_bytes == result.host_bytes
    assert round(best.total_bytes / GiB, 3) == 7.384  # the recipe header's figure
    assert "largest that fits: Qwen2.5-3B" in verdict(found)
    assert "no (GPU)" in format_candidates(found)


def test_a_larger_budget_moves_the_answer_up():
    cfg = load_config(RECIPE_3B)
    assert largest(candidates(cfg, 11 * GiB, 1024 * GiB, AROUND_3B)).name == "Qwen3-4B"


def test_host_ram_counts_too():
    cfg = load_config(RECIPE_3B)  # the offloaded optimizer: 18 GiB of host RAM for 3B, 9 for 1.5B
    found = candidates(cfg, int(7.5 * GiB), 16 * GiB, AROUND_3B)
    by_name = {c.name: c for c in found}
    assert by_name["Qwen2.5-3B"].fits_gpu and not by_name["Qwen2.5-3B"].fits_host
    assert largest(found).name == "Qwen2.5-1.5B"
    assert "no (host RAM)" in format_candidates(found)


def test_none_fits_a_tiny_card_and_the_message_says_what_to_do(capsys):
    cfg = load_config(RECIPE_3B)
    found = candidates(cfg, GiB, 1024 * GiB, AROUND_3B)
    assert largest(found) is None
    message = verdict(found)
    assert message.startswith("none of the presets fits") and "Qwen2.5-1.5B" in message  # the least demanding
    assert "--model Qwen2.5-1.5B" in message and "--gpu-memory" in message
    assert run_largest(cfg, "1GiB", "1024GiB", False, names=AROUND_3B) == 1
    assert "none of the presets fits" in capsys.readouterr().out


def test_json_lists_every_preset_with_its_figures(capsys):
    cfg = load_config(RECIPE_3B)
    assert run_largest(cfg, "7.5GiB", "1024GiB", True, names=AROUND_3B) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["largest"] == "Qwen2.5-3B" and out["gpu_memory_bytes"] == int(7.5 * GiB)
    assert [p["name"] for p in out["presets"]] == ["Qwen2.5-1.5B", "Qwen2.5-3B", "Llama-3.2-3B", "Qwen3-4B"]
    for p in out["presets"]:
        assert p["total_bytes"] == p["peak_bytes"] + p["margin_bytes"]
        assert p["spare_bytes"] == p["budget_bytes"] - p["total_bytes"]
        assert p["fits"] == (p["fits_gpu"] and p["fits_host"])


def test_a_preset_the_settings_cannot_be_planned_for_is_named_not_fitting(monkeypatch):
    cfg = load_config(RECIPE_3B)
    real = largest_module.plan

    def refuse_one(c, arch, autocast=None, card_bytes=None):
        if arch.hidden == 1536:
            raise ConfigError("not for this one")
        return real(c, arch, autocast=autocast, card_bytes=card_bytes)

    monkeypatch.setattr(largest_module, "plan", refuse_one)
    found = candidates(cfg, int(7.5 * GiB), 1024 * GiB, ["Qwen2.5-1.5B", "Qwen2.5-0.5B"])
    assert [(c.name, c.fits, c.error) for c in found] == [("Qwen2.5-0.5B", True, None),
                                                         ("Qwen2.5-1.5B", False, "not for this one")]
    assert "cannot be planned: not for this one" in format_candidates(found)


def test_bad_requests_are_refused_with_the_fix():
    cfg = load_config(RECIPE_3B)
    with pytest.raises(ConfigError, match="no preset 'Nope-9B'"):
        candidates(cfg, GiB, GiB, ["Nope-9B"])
    with pytest.raises(ConfigError, match="drop --model"):
        run(str(RECIPE_3B), "Qwen2.5-3B", "7.5GiB", [], False, "64GiB", largest=True)
    with pytest.raises(ConfigError, match="drop --nproc 2"):
        run(str(RECIPE_3B), None, "7.5GiB", [], False, "64GiB", nproc=2, largest=True)


# ---- the presets ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, params, tied", [
    ("Qwen3-4B", 4_022_468_096, True), ("Qwen3-8B", 8_190_735_360, False), ("Qwen2.5-7B", 7_615_616_512, False),
    ("Llama-3.2-3B", 3_212_749_824, True), ("Llama-3.1-8B", 8_030_261_248, False),
    ("Gemma-3-1B", 999_885_952, True), ("Llama-3.2-1B", 1_235_814_400, True)])
def test_preset_parameter_counts_are_the_models(name, params, tied):
    arch = Arch.from_config(preset(name))
    assert (arch.params, arch.tied) == (params, tied)


def test_hub_ids_resolve_to_presets_offline():
    assert preset("google/gemma-3-1b-it") == preset("Gemma-3-1B")
    assert preset("meta-llama/Llama-3.1-8B-Instruct") == preset("Llama-3.1-8B")
    assert preset("Qwen/Qwen3-4B") == preset("Qwen3-4B")
    assert preset("meta-llama/Llama-3.2-1B-Instruct")["rope_scaling"]["rope_type"] == "llama3"


def test_gemma_3_is_planned_with_its_own_layer():
    from lowmem_grpo.memory.layer_probe import layer_costs
    arch = Arch.from_config(preset("google/gemma-3-1b-it"))
    assert (arch.heads, arch.kv_heads, arch.head_dim, arch.vocab) == (4, 1, 256, 262144)
    costs = layer_costs(arch.config, torch.bfloat16, True)
    assert costs.kv_cache == 2 * 1 * 256 * 2  # keys + values of one KV head of 256, bf16
    assert costs.saved > 1152 * 2  # at least the layer's output
    cfg = load_config(Path(__file__).parents[2] / "recipes" / "gemma-3-1b_gsm8k_8gb.yaml")
    assert plan(cfg, arch).peak_bytes < 7 * GiB


def _cli_takes_largest() -> bool:
    import argparse
    from lowmem_grpo.cli import _parser
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return any("--largest" in a.option_strings for a in sub.choices["plan"]._actions)


@pytest.mark.slow  # every preset: ~25 s on 2 CPU cores
@pytest.mark.skipif(not _cli_takes_largest(), reason="lowmem_grpo/cli/__init__.py does not register plan --largest")
def test_the_command_line(capsys):
    from lowmem_grpo.cli import main
    common = ["plan", str(RECIPE_3B), "--largest", "--host-memory", "1024GiB"]
    capsys.readouterr()
    assert main([*common, "--gpu-memory", "7.5GiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["largest"] == "Qwen2.5-3B" and len(out["presets"]) >= 15
    assert main([*common, "--gpu-memory", "0.5GiB"]) == 1
    assert "none of the presets fits" in capsys.readouterr().out
