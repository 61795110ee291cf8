"""The card's free memory against the planner (memory/fit.py): `plan` reads it on a GPU machine, `train`
refuses before loading weights a run that does not fit, and `train` turns on the allocator's growing
segments. CPU tests fake a CUDA card by patching torch.cuda's functions; `cuda`-marked ones use a real one."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lowmem_grpo.training.trainer as trainer_module
from lowmem_grpo.cli import main
from lowmem_grpo.config import load_config
from lowmem_grpo.memory.fit import EXPANDABLE_SEGMENTS, use_expandable_segments
from lowmem_grpo.memory.plan import Arch, margin_bytes, plan
from tests.training.conftest import TINY_LLAMA, toy_rows, write_jsonl

GiB = 2**30
RECIPES = Path(__file__).parents[2] / "recipes"


def fake_card(monkeypatch, free: int, total: int = int(7.8 * GiB)):
    """torch.cuda as on a machine with one card that has `free` bytes free (nothing here starts CUDA)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake RTX 8GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))


def _plan_json(capsys, *argv) -> dict:
    capsys.readouterr()
    status = main(["plan", *argv, "--json", "--host-memory", "64GiB"])  # this machine's RAM may be smaller
    out = json.loads(capsys.readouterr().out)
    assert status == (0 if out["fits"] and out["host_fits"] else 1)  # the exit status says whether it fits
    return out


def test_plan_on_a_gpu_machine_measures_against_what_the_card_has_free(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    recipe = str(RECIPES / "qwen2.5-0.5b_gsm8k_8gb.yaml")  # 6.82 GiB with the margin
    fake_card(monkeypatch, free=int(6.5 * GiB))  # an 8 GB card, a display and a browser on it
    out = _plan_json(capsys, recipe)
    assert out["gpu_memory_bytes"] == int(6.5 * GiB) and "mem_get_info" in out["gpu_memory_source"]
    assert out["card"] == {"device": "cuda:0 (Fake RTX 8GB)", "free_bytes": int(6.5 * GiB),
                           "total_bytes": int(7.8 * GiB)}
    assert out["total_bytes"] > 6.5 * GiB and not out["fits"]
    # --gpu-memory still plans for another card (e.g. the one you would buy); the free memory is reported
    named = _plan_json(capsys, recipe, "--gpu-memory", "8GiB")
    assert named["gpu_memory_bytes"] == 8 * GiB and named["fits"] and named["card"]["free_bytes"] == int(6.5 * GiB)
    capsys.readouterr()
    assert main(["plan", recipe, "--host-memory", "64GiB"]) == 1
    text = capsys.readouterr().out
    assert "of 6.50 GiB (free now on cuda:0 (Fake RTX 8GB) of 7.80 GiB, torch.cuda.mem_get_info): DOES NOT FIT" in text


def test_plan_without_a_gpu_keeps_the_8gib_default(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = _plan_json(capsys, str(RECIPES / "qwen2.5-0.5b_gsm8k_8gb.yaml"))
    assert out["gpu_memory_bytes"] == 8 * GiB and out["card"] is None


class WeightsWouldLoad(Exception):
    pass


@pytest.fixture
def tiny_recipe(tmp_path, monkeypatch):
    """(section={key: value, ...} -> recipe path) for a tiny Llama, and a tripwire Trainer (it loads the weights):
    reaching it means `lowmem-grpo train`'s memory check let the run start."""
    train = write_jsonl(tmp_path / "train.jsonl", toy_rows(16))

    def trainer(*args, **kwargs):
        raise WeightsWouldLoad()
    monkeypatch.setattr(trainer_module, "Trainer", trainer)

    def make(name="r.yaml", **sections):
        recipe = {"model": {"config": TINY_LLAMA, "tokenizer": "none", "bf16": False},
                  "data": {"train_file": train},
                  "generation": {"num_generations": 4, "max_prompt_length": 8, "max_completion_length": 6},
                  "train": {"per_device_train_batch_size": 8}, "rewards": {"reward_funcs": ["numeric_answer"]}}
        for section, values in sections.items():
            recipe[section].update(values)
        path = tmp_path / name
        path.write_text(json.dumps(recipe))  # JSON is YAML
        return str(path)
    return make


def _needed(recipe: str) -> int:
    result = plan(load_config(recipe), Arch.from_config(TINY_LLAMA), autocast=False)  # model.bf16: false
    return result.peak_bytes + margin_bytes(result.peak_bytes)  # ~0.5 GiB: the margin's context


def test_train_refuses_before_loading_weights_a_run_the_card_cannot_hold(tiny_recipe, monkeypatch, capsys):
    recipe = tiny_recipe()
    needed = _needed(recipe)
    fake_card(monkeypatch, free=needed - 1)
    assert main(["train", recipe]) == 2  # the Trainer (tripwire) is never built
    message = capsys.readouterr().err.strip()
    assert "\n" not in message and "cuda:0 (Fake RTX 8GB) has" in message and "cheapest fix: " in message
    assert f"needs {needed / GiB:.2f} GiB" in message and "train.memory_check=false" in message
    fake_card(monkeypatch, free=needed)  # exactly enough: on to the weights
    with pytest.raises(WeightsWouldLoad):
        main(["train", recipe])
    fake_card(monkeypatch, free=0)
    with pytest.raises(WeightsWouldLoad):  # the user's override: start anyway
        main(["train", recipe, "memory_check=false"])
    with pytest.raises(WeightsWouldLoad):  # a CPU run: nothing to check
        main(["train", recipe, "device=cpu"])


def test_the_refusal_names_the_cheapest_change_that_fits(tiny_recipe, monkeypatch, capsys):
    # 64 held-out prompts decoded at once (the default eval_batch_size) make evaluation the peak; with
    # room for the rollout's 8 rows but not 64, the first fix named is the evaluation batch
    evalf = write_jsonl(Path(tiny_recipe()).parent / "eval.jsonl", toy_rows(64, seed=1))
    recipe = tiny_recipe(data={"eval_file": evalf}, generation={"max_prompt_length": 32, "max_completion_length": 32})
    wide = plan(load_config(recipe), Arch.from_config(TINY_LLAMA), autocast=False)
    assert wide.peak_phase == "evaluation"
    fake_card(monkeypatch, free=_needed(recipe) - 1)
    assert main(["train", recipe]) == 2
    assert "cheapest fix: eval_batch_size=8 (" in capsys.readouterr().err


def test_expandable_segments_unless_the_user_chose_the_allocator_settings(monkeypatch):
    fake_card(monkeypatch, free=GiB)
    env = {}
    assert use_expandable_segments(env) and env == {"PYTORCH_CUDA_ALLOC_CONF": EXPANDABLE_SEGMENTS}
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):  # the user's, under either name, stays
        env = {name: "max_split_size_mb:128"}
        assert not use_expandable_segments(env) and env == {name: "max_split_size_mb:128"}
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # too late: the allocator read its settings
    env = {}
    assert not use_expandable_segments(env) and env == {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # no CUDA: nothing to set
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert not use_expandable_segments(env) and env == {}


def test_train_command_sets_expandable_segments_before_the_trainer_starts(tmp_path, monkeypatch):
    fake_card(monkeypatch, free=GiB)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    seen = {}

    def trainer(*args, **kwargs):  # what the trainer (which starts CUDA) finds when it starts
        seen["conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
        raise WeightsWouldLoad()

    monkeypatch.setattr(trainer_module, "Trainer", trainer)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {{config: {json.dumps(TINY_LLAMA)}, tokenizer: none}}\n"
                      f"data: {{train_file: {write_jsonl(tmp_path / 'train.jsonl', toy_rows(8))}}}\n"
                      "rewards: {reward_funcs: [numeric_answer]}\n")
    with pytest.raises(WeightsWouldLoad):
        main(["train", str(recipe)])
    assert seen["conf"] == EXPANDABLE_SEGMENTS
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync")  # the user's choice stays
    with pytest.raises(WeightsWouldLoad):
        main(["train", str(recipe)])
    assert seen["conf"] == "backend:cudaMallocAsync"


# ----- on a real card (benchmarks/gpu_session.sh cuda-tests) -------------------------------------------

@pytest.mark.cuda
def test_plan_reads_the_real_cards_free_memory(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = _plan_json(capsys, "--model", "SmolLM2-135M")
    free, total = torch.cuda.mem_get_info()
    assert out["card"]["total_bytes"] == total
    assert abs(out["gpu_memory_bytes"] - free) < 256 * 2**20  # read a moment earlier; other processes may move it


@pytest.mark.cuda
def test_train_refuses_on_the_real_card_before_loading_weights(tiny_recipe, capsys):
    free, _ = torch.cuda.mem_get_info()
    # a generation micro-batch whose KV cache alone is more than the card has free: keys + values of
    # kv width 32 (2 heads x 16), fp32, 64 positions, 2 layers per row
    rows = 8 * (free // (2 * 32 * 4 * 64 * 2) // 8 + 1)
    recipe = tiny_recipe(generation={"max_prompt_length": 32, "max_completion_length": 32,
                                     "generation_micro_batch_size": rows},
                         train={"per_device_train_batch_size": rows})
    assert main(["train", recipe]) == 2  # never reached the tripwire Trainer
    assert "GiB free; cheapest fix" in capsys.readouterr().err


@pytest.mark.cuda
def test_expandable_segments_reach_the_allocator():
    # a fresh process: the allocator reads its settings once, when CUDA starts
    code = ("import os; os.environ.pop('PYTORCH_CUDA_ALLOC_CONF', None); os.environ.pop('PYTORCH_ALLOC_CONF', None)\n"
            "from lowmem_grpo.memory.fit import use_expandable_segments\n"
            "import torch\n"
            "assert use_expandable_segments()\n"
            "x = torch.empty(64 * 2**20, dtype=torch.uint8, device='cuda')\n"
            "segments = torch.cuda.memory._snapshot()['segments']\n"
            "print(all(s.get('is_expandable') for s in segments) and len(segments) > 0)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=Path(__file__).parents[2], timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "True"
