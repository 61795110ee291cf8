"""Reward models (rewards/model.py): TRL's scoring rule, the three placements, loading, errors, the planner
and profiler's view, and a run that learns from a streamed reward model on the CPU.

The spec for a score is transformers' own forward of one text alone (no padding): `logits[0, 0]`.
TRL's GRPOTrainer scoring the same completions: tests/rewards/test_reward_model_vs_trl.py.
"""

import json
import math
from pathlib import Path

import pytest
import torch

from lowmem_grpo.config import ConfigError, load_config
from lowmem_grpo.policy.char_tokenizer import char_tokenizer
from lowmem_grpo.rewards import RewardError, compute_rewards, load_reward_functions
from lowmem_grpo.rewards.model import (ModelSettings, RewardModel, last_token_index, load_reward_model,
                                       looks_like_model, reward_models)

from .tiny_reward_models import e_fraction, e_reward_model, random_reward_model

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["12+7=", "3*4=", "hello there ", "x", "owl mud:"]
COMPLETIONS = ["19", "12 is it", "e", "eeeeeeeeeee long one", "eee e"]


@pytest.fixture(scope="module")
def random_rm(tmp_path_factory):
    return random_reward_model(tmp_path_factory.mktemp("rm"))


@pytest.fixture(scope="module")
def e_rm(tmp_path_factory):
    return e_reward_model(tmp_path_factory.mktemp("erm"), steps=150)


def spec_scores(folder, prompts, completions, dtype=torch.float32):
    from transformers import AutoModelForSequenceClassification
    model = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=1, dtype=dtype).eval()
    tok = char_tokenizer()
    with torch.no_grad():
        return [model(**tok(p + c, add_special_tokens=False, return_tensors="pt")).logits[0, 0].float().item()
                for p, c in zip(prompts, completions)]


@pytest.mark.parametrize("placement", ["cpu", "gpu", "stream"])
@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("bfloat16", 3e-2)])
def test_every_placement_scores_as_the_model_alone(random_rm, placement, dtype, tol):
    """Right padding, longest-first micro-batches of 2 (a padded batch, a full one, one alone): each score is
    the model's forward of that text alone, in every placement."""
    model, tok = random_rm
    rm = load_reward_model(str(model), str(tok), settings=ModelSettings(placement=placement, batch_size=2,
                                                                         dtype=dtype))
    calls = []
    rm.model.base_model.register_forward_pre_hook(lambda m, a, kw: calls.append(kw.get("inputs_embeds", a and a[0])),
                                                  with_kwargs=True)
    got = rm(PROMPTS, COMPLETIONS)
    want = spec_scores(model, PROMPTS, COMPLETIONS, getattr(torch, dtype))
    assert got == pytest.approx(want, abs=tol, rel=tol)
    if placement == "stream":  # layer-major: each of ceil(5 / 2) batches to the layers, and from them to the score
        assert len(calls) == 2 * 3 and all(len(c) <= 2 for c in calls)  # at most batch_size rows at once
        assert rm.streamer.copies == 2  # each of the 2 layers streamed once for the 3 batches
    else:
        assert len(calls) == 3  # ceil(5 / 2) forwards: never more than batch_size rows at once
        assert rm.model.base_model.embed_tokens.weight.device.type == "cpu"


def test_the_read_position_is_the_last_token_that_is_not_padding():
    ids = torch.tensor([[5, 6, 7, 0, 0], [5, 6, 7, 8, 9], [0, 0, 0, 0, 0], [5, 0, 7, 0, 0]])
    assert last_token_index(ids, 0).tolist() == [2, 4, 0, 2]


def test_conversational_prompts_use_the_chat_template(random_rm):
    model, tok_folder = random_rm
    tok = char_tokenizer()
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    rm = load_reward_model(str(model), tok)
    prompts = [[{"role": "user", "content": "2+2?"}]] * 2
    completions = [[{"role": "assistant", "content": "4"}], [{"role": "assistant", "content": "five"}]]
    assert rm.texts(prompts, completions) == ["<user>2+2?\n<assistant>4\n", "<user>2+2?\n<assistant>five\n"]
    assert rm(prompts, completions) == pytest.approx(spec_scores(model, ["", ""], rm.texts(prompts, completions)),
                                                     abs=1e-5)


def test_specs_that_name_models(random_rm, tmp_path, monkeypatch):
    model, tok = random_rm
    assert looks_like_model(str(model)) and looks_like_model("org/some-reward-model")
    assert not looks_like_model("numeric_answer") and not looks_like_model("rewards.py:score")
    monkeypatch.chdir(model.parent)  # a folder relative to the current folder, or to the recipe's
    assert looks_like_model("model") and looks_like_model("model", base_dir=tmp_path)
    monkeypatch.chdir(tmp_path)
    assert not looks_like_model("model") and looks_like_model("model", base_dir=model.parent)
    from transformers import AutoModelForSequenceClassification
    loaded = AutoModelForSequenceClassification.from_pretrained(model, num_labels=1)
    funcs = load_reward_functions([{"name": "model", "label": "judge"}, loaded, {"name": "char_count", "char": "e"}],
                                  [2.0, 1.0, 0.5],
                                  base_dir=model.parent, models=ModelSettings(processing_classes=[str(tok), str(tok), None]))
    assert [f.name for f in funcs] == ["judge", "model", "char_count"]
    assert len(reward_models(funcs)) == 2
    per_func, total = compute_rewards(funcs, PROMPTS, COMPLETIONS, [[1]] * 5, {})
    want = spec_scores(model, PROMPTS, COMPLETIONS)
    assert per_func[:, 0].tolist() == pytest.approx(want, abs=1e-5)
    assert per_func[:, 1].tolist() == pytest.approx(want, abs=1e-5)
    expected = [3 * w + 0.5 * c.count("e") for w, c in zip(want, COMPLETIONS)]
    assert total.tolist() == pytest.approx(expected, abs=1e-4)


def test_bad_reward_model_input_is_named(random_rm, monkeypatch):
    import huggingface_hub
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # no retries against the hub
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, tok = random_rm
    with pytest.raises(RewardError, match="cannot load the reward model 'nobody/no-such-model'"):
        load_reward_functions(["nobody/no-such-model"])
    with pytest.raises(RewardError, match="takes no options"):
        load_reward_functions([{"name": str(model), "temperature": 2}])
    with pytest.raises(RewardError, match="only reward models take one"):
        load_reward_functions(["char_count"], models=ModelSettings(processing_classes=[str(tok)]))
    with pytest.raises(RewardError, match="2 entries for 1 reward functions"):
        load_reward_functions(["char_count"], models=ModelSettings(processing_classes=[None, None]))
    rm = load_reward_model(str(model), str(tok))
    with pytest.raises(RewardError, match="token ids"):
        rm([[1, 2, 3]], ["x"])
    with pytest.raises(RewardError, match="reads at most 128 tokens.*max_completion_length"):
        rm(["x"], ["e" * 200])
    with pytest.raises(RewardError, match="placement must be one of"):
        RewardModel(rm.model, rm.tokenizer, placement="disk")
    with pytest.raises(RewardError, match="has no `score` linear head.*model_placement=gpu or cpu"):
        headless = load_reward_model(str(model), str(tok)).model
        headless.score = torch.nn.Identity()
        RewardModel(headless, rm.tokenizer, placement="stream")


def test_the_config_takes_the_reward_model_settings(random_rm):
    model, tok = random_rm
    recipe = str(ROOT / "recipes" / "char_e.yaml")
    cfg = load_config(recipe, [f"rewards.reward_funcs=['{model}']", f"rewards.reward_processing_classes=['{tok}']",
                               "rewards.model_placement=stream", "rewards.model_batch_size=4"])
    assert cfg.rewards.model_placement == "stream" and cfg.rewards.model_batch_size == 4
    with pytest.raises(ConfigError, match="model_placement"):
        load_config(recipe, ["rewards.model_placement=disk"])
    with pytest.raises(ConfigError, match="reward_processing_classes has 2 entries"):
        load_config(recipe, [f"rewards.reward_processing_classes=['{tok}', null]"])


def test_the_planner_counts_each_placement(random_rm):
    from lowmem_grpo.memory.plan import Arch, plan
    from lowmem_grpo.memory.reward_plan import reward_archs
    model, tok = random_rm
    recipe = str(ROOT / "recipes" / "char_e.yaml")
    arch = Arch.from_config(dict(load_config(recipe).model.config))
    plans = {}
    for where in ("gpu", "stream", "cpu"):
        cfg = load_config(recipe, [f"rewards.reward_funcs=['{model}', char_count]", f"rewards.model_placement={where}"])
        rm = reward_archs(cfg)
        assert len(rm) == 1 and rm[0].params == sum(p.numel() for p in load_reward_model(
            str(model), str(tok)).model.parameters())
        plans[where] = plan(cfg, arch)
    weights = 4 * rm[0].params
    without = plan(load_config(recipe), arch)
    assert "rewards" not in without.phases
    gpu, stream, cpu = plans["gpu"], plans["stream"], plans["cpu"]
    assert all(cats["reward model"] == weights for cats in gpu.phase_categories.values())
    assert "reward models" not in gpu.host_categories
    assert all("reward model" not in cats for cats in stream.phase_categories.values())
    assert stream.host_categories["reward models"] >= weights and "reward models" in stream.host_pinned
    assert stream.phase_categories["rewards"]["reward buffers"] > cpu.phase_categories["rewards"][
        "reward buffers"] == 0
    assert cpu.host_categories["reward models"] == weights and "reward models" not in cpu.host_pinned
    # the streamed copy is two layers (and the work): less than the whole model on the device
    assert (stream.phase_categories["rewards"]["reward buffers"]
            < gpu.phase_categories["rewards"]["reward buffers"] + weights)
    auto = plan(load_config(recipe, [f"rewards.reward_funcs=['{model}']"]), arch, device="cpu")
    assert auto.host_categories["reward models"] == weights  # auto on the CPU: cpu


def test_model_dtype_auto_loads_the_checkpoints_dtype_as_planned(tmp_path):
    """model_dtype auto is the checkpoint's dtype on every supported transformers version (4.x loads fp32
    unless told): a bf16 checkpoint loads in bf16, as the planner counts it; a dtype given wins."""
    from transformers import AutoModelForSequenceClassification
    from lowmem_grpo.memory.reward_plan import reward_archs
    model, tok = random_reward_model(tmp_path / "fp32")
    AutoModelForSequenceClassification.from_pretrained(model, num_labels=1).to(torch.bfloat16).save_pretrained(
        tmp_path / "bf16")
    for dtype, want in (("auto", torch.bfloat16), ("float32", torch.float32), ("float16", torch.float16)):
        rm = load_reward_model(str(tmp_path / "bf16"), str(tok), settings=ModelSettings(dtype=dtype))
        assert {p.dtype for p in rm.model.parameters()} == {want}, dtype
        cfg = load_config(None, ["name_or_path=m", f"rewards.reward_funcs=['{tmp_path / 'bf16'}']",
                                 f"rewards.model_dtype={dtype}"], check=False)
        assert reward_archs(cfg)[0].weight_bytes == want.itemsize, dtype
    fp32 = load_reward_model(str(model), str(tok), settings=ModelSettings(dtype="auto"))
    assert {p.dtype for p in fp32.model.parameters()} == {torch.float32}


def test_auto_placement_goes_on_the_gpu_where_the_plan_fits(random_rm, monkeypatch):
    from lowmem_grpo.memory import fit
    from lowmem_grpo.memory.plan import Arch, margin_bytes, plan
    model, _ = random_rm
    recipe = str(ROOT / "recipes" / "char_e.yaml")
    cfg = load_config(recipe, [f"rewards.reward_funcs=['{model}']"])
    arch = Arch.from_config(dict(cfg.model.config))
    need = plan(cfg, arch, reward_placement="gpu").peak_bytes
    for free, want in ((need + margin_bytes(need), "gpu"), (need + margin_bytes(need) - 1, "stream")):
        c = load_config(recipe, [f"rewards.reward_funcs=['{model}']"])
        monkeypatch.setattr(fit, "device_free_bytes", lambda device, free=free: (free, 2 * free))
        fit.place_reward_models(c, arch, torch.device("cuda"))
        assert c.rewards.model_placement == want


def test_a_run_learns_from_a_streamed_reward_model(e_rm, tmp_path):
    """char_e's tiny policy, rewarded only by a reward model trained to like the letter e, streamed layer by
    layer (the CPU stands in for the device): its mean reward rises over 20 steps. The profile of a step
    names the reward model's weights and its phase."""
    from lowmem_grpo.memory.profile import device_equivalent, profile_trainer
    from lowmem_grpo.training.trainer import Trainer
    model, tok = e_rm
    rm = load_reward_model(str(model), str(tok))
    texts = ["owl mud:abc xyz", "owl mud:eeeeeeee", "dog:e e e e", "cat box:qwerty uiop"]
    assert rm([""] * 4, texts) == pytest.approx([e_fraction(t) for t in texts], abs=0.3)
    cfg = load_config(str(ROOT / "recipes" / "char_e.yaml"), [
        f"rewards.reward_funcs=['{model}']", f"rewards.reward_processing_classes=['{tok}']",
        "rewards.model_placement=stream", "train.max_steps=20", f"output.output_dir={tmp_path / 'run'}",
        "eval.eval_on_start=false", "eval.eval_on_end=false", "train.device=cpu"])
    trainer = Trainer(cfg, recipe_dir=ROOT / "recipes")
    trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward"] for r in rows if "reward" in r]
    assert len(rewards) == 20 and all(math.isfinite(r) for r in rewards)
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.3, rewards
    streamed = reward_models(trainer.reward_funcs)[0]
    assert streamed.placement == "stream" and streamed.streamer.copies >= 2 * 20
    prof, _, _ = profile_trainer(trainer, 1)
    assert "rewards" in prof.result.devices["host"].summary()["phases"]
    _, summary = device_equivalent(prof, trainer)
    assert "reward model" not in summary["categories"] or summary["categories"]["reward model"] == 0


def test_out_of_memory_while_scoring_names_the_reward_model_settings():
    from lowmem_grpo.training.stopping import _cheapest_fix
    recipe = str(ROOT / "recipes" / "char_e.yaml")
    on_gpu = load_config(recipe, ["train.device=cuda", "rewards.model_placement=gpu"])
    assert _cheapest_fix("rewards", on_gpu).startswith("rewards.model_placement=stream")
    streamed = load_config(recipe, ["rewards.model_placement=stream", "rewards.model_batch_size=6"])
    assert _cheapest_fix("rewards", streamed) == "rewards.model_batch_size=3"


def test_the_planner_finds_a_reward_model_beside_the_recipe(random_rm, tmp_path, monkeypatch, capsys):
    import shutil

    import yaml

    from lowmem_grpo.cli import main
    model, _ = random_rm
    folder = tmp_path / "recipe"
    shutil.copytree(model, folder / "judge")
    recipe = yaml.safe_load((ROOT / "recipes" / "char_e.yaml").read_text())
    recipe["rewards"] = {"reward_funcs": ["judge"], "model_placement": "gpu"}
    (folder / "r.yaml").write_text(yaml.safe_dump(recipe))
    monkeypatch.chdir(tmp_path)  # not the recipe's folder
    assert main(["plan", str(folder / "r.yaml"), "--gpu-memory", "8GiB", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    weights = 4 * sum(p.numel() for p in load_reward_model(str(model), str(random_rm[1])).model.parameters())
    assert result["phase_categories"]["rewards"]["reward model"] == weights


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("placement", ["gpu", "stream"])
@pytest.mark.parametrize("dtype, tol", [("float32", 1e-4), ("bfloat16", 3e-2)])
def test_cuda_placements_score_as_the_model_alone_within_the_plan(random_rm, placement, dtype, tol):
    """On a GPU, `gpu` and `stream` score each text within the dtype's rounding of the model's CPU forward of
    it alone, in the device and host memory the planner gives them (recipes/char_e.yaml with this reward
    model): `gpu` keeps the weights on the device (the planner's "reward model" bytes) and its scoring adds at
    most the planned "reward buffers"; `stream` keeps the whole model in one pinned host block of exactly the
    planned "reward models" bytes, brings each layer to the device for its calls, and the device's peak
    while it scores stays within the planned "reward buffers"."""
    from lowmem_grpo.memory.plan import Arch, plan
    model, tok = random_rm
    recipe = str(ROOT / "recipes" / "char_e.yaml")
    cfg = load_config(recipe, [f"rewards.reward_funcs=['{model}']", f"rewards.model_placement={placement}",
                               f"rewards.model_dtype={dtype}", "rewards.model_batch_size=2"])
    planned = plan(cfg, Arch.from_config(dict(load_config(recipe).model.config)))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    rm = load_reward_model(str(model), str(tok), settings=ModelSettings(placement=placement, device="cuda",
                                                                         batch_size=2, dtype=dtype))
    resident = torch.cuda.memory_allocated() - before
    weights = sum(p.numel() * p.element_size() for p in rm.model.parameters())
    torch.cuda.reset_peak_memory_stats()
    got = rm(PROMPTS, COMPLETIONS)
    peak = torch.cuda.max_memory_allocated() - before
    assert got == pytest.approx(spec_scores(model, PROMPTS, COMPLETIONS, getattr(torch, dtype)), abs=tol, rel=tol)
    buffers = planned.phase_categories["rewards"]["reward buffers"]
    if placement == "gpu":
        assert rm.model.base_model.embed_tokens.weight.device.type == "cuda"
        assert planned.phase_categories["rewards"]["reward model"] == weights <= resident
        assert peak - resident <= buffers, f"scoring added {peak - resident} bytes; planned {buffers}"
    else:
        assert rm.arena.pinned and rm.arena.nbytes == planned.host_categories["reward models"]
        assert "reward models" in planned.host_pinned
        assert all(p.device.type == "cpu" and p.is_pinned() for p in rm.model.base_model.layers.parameters())
        assert resident < weights and rm.streamer.copies == 2
        assert peak <= buffers, f"the device held {peak} bytes while scoring; planned {buffers}"
