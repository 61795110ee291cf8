"""Memory accounting on hand-checkable cases."""

import pytest

from lowmem_grpo.config import load_config
from lowmem_grpo.memory_plan import Arch, optimizer_state_bytes, plan
from lowmem_grpo.presets import preset

MINIMAL = ["model.name_or_path=x", "reward_funcs=[numeric_answer]"]


def test_parameter_counts_of_the_presets():
    assert Arch.from_config(preset("Qwen2.5-0.5B")).params == 494_032_768
    assert Arch.from_config(preset("Qwen/Qwen2.5-1.5B-Instruct")).params == 1_543_714_304


def test_optimizer_state_bytes_per_tensor_size():
    # 8-bit: 2 bytes/element + two fp32 absmax per 256-block; below 4096 elements bitsandbytes keeps fp32 states
    assert optimizer_state_bytes([4096], "adamw_8bit", 4) == 2 * 4096 + 2 * 4 * 16
    assert optimizer_state_bytes([4097], "adamw_8bit", 4) == 2 * 4097 + 2 * 4 * 17
    assert optimizer_state_bytes([100], "adamw_8bit", 4) == 8 * 100
    assert optimizer_state_bytes([100, 4096], "adamw", 4) == 8 * 4196
    assert optimizer_state_bytes([100], "adamw", 2) == 4 * 100


def test_weights_and_gradients_by_precision_and_optimizer_mode():
    arch = Arch(vocab=1000, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=16, tied=True,
                tensor_sizes=[64_000, 8192, 4096, 64])
    p = sum(arch.tensor_sizes)
    fp32 = plan(load_config(None, MINIMAL), arch)["categories"]
    assert fp32["weights"] == 4 * p and fp32["gradients"] == 4 * p
    bf16 = plan(load_config(None, MINIMAL + ["precision=bf16_sr", "optimizer_in_backward=true"]), arch)["categories"]
    assert bf16["weights"] == 2 * p
    assert bf16["gradients"] == 2 * (64_000 + 8192)  # tied embedding (alive through backward) + largest other
    assert bf16["optimizer states"] == fp32["optimizer states"]  # 8-bit states do not depend on the weight dtype


@pytest.mark.parametrize("recipe, arch, budget", [("qwen2.5-0.5b_gsm8k_8gb.yaml", "Qwen2.5-0.5B", 6.5),
                                                   ("qwen2.5-1.5b_gsm8k_8gb.yaml", "Qwen2.5-1.5B", 7.4)])
def test_8gb_recipes_are_predicted_within_budget(recipe, arch, budget):
    from pathlib import Path
    cfg = load_config(Path(__file__).parents[1] / "recipes" / recipe)
    result = plan(cfg, Arch.from_config(preset(arch)))
    assert result["peak_bytes"] / 2**30 <= budget, result


def _plan_json(capsys, *argv):
    import json
    from lowmem_grpo.cli import main
    capsys.readouterr()
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_cli_json_for_presets_by_short_name_and_hub_id(capsys):
    short = _plan_json(capsys, "--model", "Qwen2.5-1.5B")
    hub = _plan_json(capsys, "--model", "Qwen/Qwen2.5-1.5B-Instruct")
    assert short["peak_bytes"] == hub["peak_bytes"] and short["params"] == 1_543_714_304
    assert {"peak_bytes", "fits", "phases", "categories", "margin_bytes", "suggestions"} <= short.keys()
    assert set(short["categories"]) == {"weights", "optimizer states", "gradients", "activations", "loss head",
                                        "KV cache", "reference buffers"}
    # fp32 master weights, full gradients: 1.5B does not fit 8 GiB, and the suggestions find a combination that does
    assert not short["fits"]
    assert any(s.get("combined") and s["fits"] for s in short["suggestions"])


def test_plan_cli_for_the_8gb_recipes_and_overrides(capsys):
    from pathlib import Path
    recipes = Path(__file__).parents[1] / "recipes"
    big = _plan_json(capsys, str(recipes / "qwen2.5-1.5b_gsm8k_8gb.yaml"))
    assert big["fits"] and big["peak_bytes"] / 2**30 <= 7.4
    longer = _plan_json(capsys, str(recipes / "qwen2.5-1.5b_gsm8k_8gb.yaml"), "max_completion_length=4096")
    assert longer["categories"]["activations"] > big["categories"]["activations"]
    small = _plan_json(capsys, "--model", "SmolLM2-135M", "--gpu-memory", "24GiB")
    assert small["fits"] and small["gpu_memory_bytes"] == 24 * 2**30


def test_plan_cli_errors(capsys):
    from lowmem_grpo.cli import main
    assert main(["plan", "--model", "Qwen2.5-1.5B", "--gpu-memory", "lots"]) == 2
    assert "give a size such as 8GiB" in capsys.readouterr().err
    assert main(["plan", "--model", "NoSuchModel-7B"]) == 2
    assert "neither a local config.json" in capsys.readouterr().err
