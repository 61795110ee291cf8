"""One rank's predicted memory under torchrun (memory/parallel_plan.py), on hand-checkable numbers."""

import json

import pytest

from lowmem_grpo.config import ConfigError, load_config
from lowmem_grpo.memory.parallel_plan import per_rank
from lowmem_grpo.memory.plan import Arch, plan
from lowmem_grpo.memory.presets import preset


def _setup(*overrides):
    cfg = load_config(None, ["optimizer=adamw", "beta=0.04", "reference_compute=cpu", *overrides], check=False)
    arch = Arch.from_config(preset("Qwen2.5-0.5B"))
    return cfg, arch, plan(cfg, arch)


def test_one_rank_is_the_plan_itself():
    cfg, arch, one = _setup()
    assert per_rank(one, cfg, arch, 1, "fsdp") is one


def test_ddp_holds_every_gradient_in_every_phase():
    cfg, arch, one = _setup()
    two = per_rank(one, cfg, arch, 2, "ddp")
    grads = 4 * arch.params  # fp32 weights: DDP's buckets are the gradients, from wrapping to the end
    for phase, cats in two.phase_categories.items():
        assert cats["gradients"] == max(one.phase_categories[phase].get("gradients", 0), grads), phase
        assert cats["weights"] == one.phase_categories[phase]["weights"]
    assert two.phases["rollout"] == one.phases["rollout"] + grads
    assert two.host_bytes == one.host_bytes  # reference_compute=cpu: the node's ranks share one copy
    streamed = per_rank(plan(cfg, arch), load_config(None, ["beta=0.04", "reference_compute=stream"], check=False),
                        arch, 2, "ddp")
    assert streamed.host_bytes == 2 * one.host_bytes  # streamed: each rank pins its own copy


def test_fsdp_shards_states_and_weights_and_gathers_the_model_for_rollouts():
    cfg, arch, one = _setup("precision=bf16_sr", "optimizer=adamw_8bit")
    two = per_rank(one, cfg, arch, 2, "fsdp")
    weights = 2 * arch.params  # bf16
    cats = two.phase_categories
    assert cats["rollout"]["weights"] == weights // 2 + weights  # the shard + the gathered model
    assert cats["optimizer"]["weights"] == weights // 2
    assert cats["optimizer"]["optimizer states"] == one.phase_categories["optimizer"]["optimizer states"] // 2
    assert cats["optimizer"]["gradients"] == one.phase_categories["optimizer"]["gradients"] // 2
    root = 2 * (arch.vocab * arch.hidden + arch.hidden)  # tied: one (V, H) tensor, plus the final norm
    layer = 2 * arch.layer_params()
    assert cats["forward"]["weights"] == weights // 2 + root + 2 * layer
    four = per_rank(one, cfg, arch, 4, "fsdp")
    assert four.phases["optimizer"] < two.phases["optimizer"]


def test_fsdp_scores_rewards_with_the_gathered_model(tmp_path):
    """The trainer scores rewards inside full_weights (Trainer.new_generation_batch): every unit is gathered
    then, as in the rollout, so the rewards phase holds the shard and the whole model."""
    from tests.rewards.tiny_reward_models import random_reward_model
    folder, _ = random_reward_model(tmp_path)
    cfg, arch, _ = _setup("precision=bf16_sr", "optimizer=adamw_8bit", f"rewards.reward_funcs=['{folder}']",
                          "rewards.model_placement=stream")
    one = plan(cfg, arch)
    two = per_rank(one, cfg, arch, 2, "fsdp")
    weights = 2 * arch.params  # bf16
    rewards = two.phase_categories["rewards"]
    assert rewards["weights"] == weights // 2 + weights  # the shard + the gathered model
    assert rewards["reward buffers"] == one.phase_categories["rewards"]["reward buffers"] > 0
    assert two.phases["rewards"] > two.phases["optimizer"]


def test_plan_cli_per_rank_and_refusals(capsys):
    from lowmem_grpo.cli.plan import run
    assert run(None, "Qwen2.5-0.5B", "8GiB", ["optimizer=adamw_8bit", "per_device_train_batch_size=8"], False,
               "64GiB", nproc=2, strategy="fsdp") == 0
    assert "one of 2 ranks (strategy=fsdp)" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="optimizer_in_backward=false"):
        run(None, "Qwen2.5-0.5B", "8GiB", ["optimizer_in_backward=true"], False, "64GiB", nproc=2)
    with pytest.raises(ConfigError, match="multiple of --nnodes"):
        run(None, "Qwen2.5-0.5B", "8GiB", [], False, "64GiB", nproc=3, nnodes=2)
    with pytest.raises(ConfigError, match="whole groups"):  # 4 completions per rank, groups of 8
        run(None, "Qwen2.5-0.5B", "8GiB", ["per_device_train_batch_size=4", "num_generations=8"], False,
            "64GiB", nproc=2)


def test_plan_cli_host_ram_is_one_nodes(capsys):
    """4 ranks streaming their own reference copies: one node holds 4 of them, each of 2 nodes 2."""
    from lowmem_grpo.cli import main
    base = ["plan", "--model", "Qwen2.5-0.5B", "--host-memory", "64GiB", "--json", "--nproc", "4",
            "beta=0.04", "reference_compute=stream", "optimizer_in_backward=false", "offload_optimizer=false",
            "per_device_train_batch_size=8"]
    reports = []
    for extra in ([], ["--nnodes", "2"]):
        assert main([*base, *extra]) == 0
        reports.append(json.loads(capsys.readouterr().out))
    one_node, two_nodes = reports
    assert two_nodes["nnodes"] == 2 and two_nodes["peak_bytes"] == one_node["peak_bytes"]
    assert two_nodes["host_categories"]["reference model"] * 2 == one_node["host_categories"]["reference model"] > 0


def test_the_two_card_recipe_fits_a_desktop_budget_per_rank():
    from pathlib import Path
    cfg = load_config(Path(__file__).parents[2] / "recipes" / "qwen2.5-1.5b_gsm8k_2x8gb.yaml")
    arch = Arch.from_config(preset("Qwen2.5-1.5B"))
    result = per_rank(plan(cfg, arch), cfg, arch, 2, cfg.train.strategy)
    assert result.peak_bytes / 2**30 <= 6.67, result  # 7.5 GiB with the margin (0.5 GiB + 5%)
