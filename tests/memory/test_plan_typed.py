"""plan() returns a typed MemoryPlan whose numbers are those the untyped planner gave, to the byte.

plan_golden.json holds, for every shipped recipe (and three variants: vLLM, no checkpointing with gradient
accumulation, the CPU), what plan() returned as a dict before it was typed, two recipes' suggestions, and
`lowmem-grpo plan --json` for two recipes, captured from that code. The settings added since (a layer-major
backward, and the activation offload a recipe took up with it; a streamed reference pass over one log-prob
micro-batch at a time) are set back to what the recipes did then (CAPTURED_WITH): the planner's arithmetic
for those settings is unchanged. Suggestions added since are left out (ADDED_SINCE); recipes added since are
captured as they were added.
"""

import json
import warnings
from pathlib import Path

import pytest

from lowmem_grpo.config import load_config
from lowmem_grpo.kernels import _backend
from lowmem_grpo.memory.plan import Arch, MemoryPlan, plan
from lowmem_grpo.memory.presets import preset
from lowmem_grpo.memory.reward_plan import resolve_folders
from lowmem_grpo.memory.suggest import Suggestion, suggestions

RECIPES = Path(__file__).parents[2] / "recipes"
GOLDEN = json.loads((Path(__file__).parent / "plan_golden.json").read_text())
# case -> (recipe, overrides, preset in place of the recipe's model, device)
VARIANTS = {"qwen2.5-1.5b_gsm8k_8gb.yaml+vllm": ("qwen2.5-1.5b_gsm8k_8gb.yaml", ["engine=vllm"], None, "cuda"),
            "qwen2.5-0.5b_gsm8k_8gb.yaml+no-ckpt": ("qwen2.5-0.5b_gsm8k_8gb.yaml", [
                "gradient_checkpointing=false", "offload_optimizer=false", "gradient_accumulation_steps=2"],
                None, "cuda"),
            "smollm2-135m_arithmetic_cpu.yaml@cpu": ("smollm2-135m_arithmetic_cpu.yaml", [], "SmolLM2-135M", "cpu")}
CASES = sorted(k for k in GOLDEN if not k.startswith("_"))
# the settings of every recipe when its plan was captured, where a recipe has changed them since
CAPTURED_WITH = ["layer_major_backward=false", "head_gradient_once_per_step=false", "layers_per_checkpoint=1",
                 "reference_stream_rows=1"]
CAPTURED_WITH_RECIPE = {"qwen2.5-3b_gsm8k_8gb.yaml": ["offload_activations=false"],
                        "qwen2.5-1.5b_gsm8k-4096_8gb.yaml": ["per_device_train_batch_size=4",
                                                             "gradient_accumulation_steps=8", "steps_per_generation=8"],
                        "qwen2.5-1.5b_gsm8k-8192_8gb.yaml": ["per_device_train_batch_size=2",
                                                             "gradient_accumulation_steps=16",
                                                             "steps_per_generation=16"],
                        # recipes added since, captured as shipped (the layer-major step is what they stream in)
                        "qwen2.5-7b_gsm8k_8gb.yaml": ["layer_major_backward=true"],
                        "llama-3.1-8b_gsm8k_8gb.yaml": ["layer_major_backward=true"]}
# suggestions added since the capture (their own tests: tests/training/test_offload_weights.py)
ADDED_SINCE = ("_offload_weights", "_four_bit_rollouts")


@pytest.fixture(autouse=True)
def suggestions_as_captured(monkeypatch):
    from lowmem_grpo.memory import suggest
    monkeypatch.setattr(suggest, "SUGGESTIONS", tuple(s for s in suggest.SUGGESTIONS if s.__name__ not in ADDED_SINCE))


def test_every_shipped_recipe_has_a_golden_plan():
    """A recipe added later gets its plan captured too (the CPU recipe's GGUF model: by its preset)."""
    planned = {VARIANTS.get(case, (case,))[0] for case in CASES}
    assert planned == {p.name for p in RECIPES.glob("*.yaml")}


def _case(case: str):
    recipe, overrides, model, device = VARIANTS.get(case, (case, [], None, "cuda"))
    overrides = CAPTURED_WITH + CAPTURED_WITH_RECIPE.get(recipe, []) + overrides
    cfg = load_config(str(RECIPES / recipe), overrides, check=False)
    resolve_folders(cfg, RECIPES)
    if model is None:
        from lowmem_grpo.cli.plan import architecture
        return cfg, architecture(cfg, None)[0], device
    return cfg, Arch.from_config(preset(model)), device


@pytest.mark.parametrize("case", CASES)
def test_plan_is_bit_for_bit_the_untyped_planners(case, monkeypatch):
    cfg, arch, device = _case(case)
    # the CPU plan was captured when the CPU's logits workspace had the GPU's bound, and before its head kept
    # its logits for the backward
    monkeypatch.setattr(_backend, "CPU_WORKSPACE_BYTES", _backend.DEFAULT_WORKSPACE_BYTES)
    monkeypatch.setattr(_backend, "CPU_KEEP_LOGITS_BYTES", 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # no consumer on the way reads it as a dict
        result = plan(cfg, arch, card_bytes=8 * 2**30, device=device)
    assert isinstance(result, MemoryPlan)
    assert result.to_dict() == GOLDEN[case]["plan"]
    assert list(result.to_dict()["phase_categories"]) == list(GOLDEN[case]["plan"]["phase_categories"])  # order
    if "suggestions" in GOLDEN[case]:
        found = suggestions(cfg, arch, 5 * 2**30)
        assert all(isinstance(s, Suggestion) for s in found)
        assert [s.to_dict() for s in found] == GOLDEN[case]["suggestions"]


@pytest.mark.parametrize("command", sorted(GOLDEN["_cli"]))
def test_plan_json_keeps_its_keys_and_values(command, capsys, monkeypatch):
    from lowmem_grpo.cli import main
    from lowmem_grpo.cli import plan as plan_cli
    monkeypatch.setattr(plan_cli, "_cuda_available", lambda: False)  # the golden was taken without a GPU
    monkeypatch.chdir(RECIPES.parent)
    recipe, *extra = command.split()
    capsys.readouterr()
    captured = CAPTURED_WITH + CAPTURED_WITH_RECIPE.get(recipe, [])
    main(["plan", f"recipes/{recipe}", "--json", "--host-memory", "64GiB", *extra, *captured])
    printed = json.loads(capsys.readouterr().out)
    # The step-time estimate's keys came after the golden was taken: null without --card.
    for key in ("step_time_card", "step_time_s", "transfer_bytes", "step_time_notes"):
        assert printed.pop(key) is None
    golden = json.loads(GOLDEN["_cli"][command])
    assert list(printed) == list(golden)  # the keys in their order
    assert printed == golden


def test_the_fields_agree_with_each_other():
    cfg, arch, device = _case("qwen2.5-3b_gsm8k_8gb.yaml")
    result = plan(cfg, arch)
    assert result.phases == {p: sum(c.values()) for p, c in result.phase_categories.items()}
    assert result.peak_bytes == max(result.phases.values()) == result.phases[result.peak_phase]
    assert result.categories is result.phase_categories[result.peak_phase]
    assert result.host_bytes == sum(result.host_categories.values()) > 0
    assert result.host_pinned_bytes == sum(result.host_categories[c] for c in result.host_pinned)


def test_reading_the_result_as_a_dict_warns_and_still_works():
    cfg, arch, _ = _case("qwen2.5-0.5b_gsm8k_8gb.yaml")
    result = plan(cfg, arch)
    with pytest.warns(DeprecationWarning, match=r"read \.peak_bytes"):
        assert result["peak_bytes"] == result.peak_bytes
    with pytest.warns(DeprecationWarning, match=r"read \.vllm"):
        assert result.get("vllm") is None
    with pytest.warns(DeprecationWarning), pytest.raises(KeyError):
        result["no such key"]
    found = suggestions(cfg, arch, 2 * 2**30)
    assert found
    with pytest.warns(DeprecationWarning, match=r"read \.change"):
        assert found[0]["change"] == found[0].change
