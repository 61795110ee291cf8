"""The bytes a step moves between host and device, counted as the code copies them (transfers.py) and
recorded in metrics.jsonl, against what the planner predicts (memory/step_time.py, `transfers`), on the
shipped recipes' batch structure and memory modes with a tiny model on the CPU.

Tolerance: the weights, the gradients, the reference's layers and head, and the policy's layers streamed
under model.offload_weights (and into the compact copy) are exact (they do not depend on
what was sampled). A layer-major step's lookup gradients are the rows of the distinct tokens a micro-batch
read: at most the planner's one per position. Offloaded activations depend on each micro-batch's padded width, which the planner takes
at full length: the count is at most the planner's and at least half of it here."""

import json

import pytest

from lowmem_grpo.config import load_config
from lowmem_grpo.memory.plan import Arch
from lowmem_grpo.memory.step_time import transfers
from lowmem_grpo.training.metrics import read_metrics
from lowmem_grpo.training.trainer import Trainer
from lowmem_grpo.transfers import TRANSFERS

from .conftest import TINY_LLAMA, toy_rows, write_jsonl

EXACT = ("weights", "gradients", "reference layers", "reference head", "policy layers", "rollout copy")
HIDDEN = json.dumps({**TINY_LLAMA, "hidden_size": 1024, "intermediate_size": 256, "num_attention_heads": 8,
                     "num_hidden_layers": 3})  # 3: two groups of model.layers_per_checkpoint=2, the last shorter
CASES = {  # recipe, overrides: each shipped mix of memory modes
    "1.5b": ("qwen2.5-1.5b_gsm8k_8gb.yaml", []),
    "1.5b-per-micro-batch": ("qwen2.5-1.5b_gsm8k_8gb.yaml", ["layer_major_backward=false",
                                                             "head_gradient_once_per_step=false"]),
    "3b": ("qwen2.5-3b_gsm8k_8gb.yaml", ["skip_zero_advantage=false"]),
    "4096": ("qwen2.5-1.5b_gsm8k-4096_8gb.yaml", ["pack_prompts=false"]),  # unpacked: 1.25 MiB layer inputs
    "8192": ("qwen2.5-1.5b_gsm8k-8192_8gb.yaml", []),
    # two steps: the compact copy is made at start, quantized again from the host copy from the second step on
    "offload-weights": ("qwen2.5-1.5b_gsm8k_8gb.yaml", ["offload_weights=true", "rollout_quantization=int8",
                                                        "max_steps=2"]),
    "offload-weights-untied": ("qwen2.5-1.5b_gsm8k_8gb.yaml", [  # the embedding's table in host RAM too
        "offload_weights=true", "rollout_quantization=int8", "max_steps=2",
        f"model.config={json.dumps({**TINY_LLAMA, 'tie_word_embeddings': False})}"]),
}


def _config(tmp_path, recipe, overrides, long: bool):
    """`long`: prompts of 288 tokens and 32-token completions at hidden size 1024, so that a micro-batch's
    layer input (2 x 320 x 1024 x 2 bytes) passes activation offload's 1 MiB minimum."""
    rows = toy_rows(64)
    if long:
        rows = [{**r, "prompt_ids": (r["prompt_ids"] * 288)[:288]} for r in rows]
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    prompt, completion = (288, 32) if long else (8, 6)
    return load_config(f"recipes/{recipe}", [
        f"model.config={HIDDEN if long else json.dumps(TINY_LLAMA)}", "model.name_or_path=''", "model.tokenizer=none",
        f"data.train_file={train}", "data.eval_file=null", "eval_on_start=false", "eval_on_end=false",
        f"max_prompt_length={prompt}", f"max_completion_length={completion}",
        "reward_funcs=[tests.training.conftest:label_reward]",
        "reward_weights=null", "device=cpu", f"output_dir={tmp_path / 'run'}", "progress_bar=false",
        "reference_compute=stream", "max_steps=1", "save_steps=0", *overrides])


@pytest.mark.parametrize("case", sorted(CASES))
def test_counted_bytes_are_the_planners(tmp_path, monkeypatch, case):
    pytest.importorskip("bitsandbytes")  # the recipes' 8-bit states
    monkeypatch.chdir(__import__("pathlib").Path(__file__).parents[2])
    recipe, overrides = CASES[case]
    cfg = _config(tmp_path, recipe, overrides, long=case == "4096")
    trainer = Trainer(cfg)
    TRANSFERS.take()
    trainer.train()
    counted = read_metrics(cfg.output.output_dir)[-1]
    planned: dict[str, int] = {}
    for move in transfers(cfg, Arch.from_config(trainer.policy.config)):
        key = f"transfer/{move.direction}/{move.kind}"
        planned[key] = planned.get(key, 0) + move.total
    assert ("transfer/h2d/activations" in planned) == (case == "4096")
    for key, nbytes in planned.items():
        if key.rsplit("/", 1)[1] in EXACT:
            assert counted[key] == nbytes, key
        elif key.endswith(("lookup gradients", "embedding rows")):  # the tokens read: the plan's bound
            assert 0 < counted[key] <= nbytes, key
        else:  # activations: padded widths, at most the planner's full lengths
            assert nbytes / 2 <= counted[key] <= nbytes, key
    assert counted["device_syncs"] >= 1  # the step's one read of its loss and metrics
    kinds = {k for k in counted if k.startswith("transfer/") and k.count("/") == 2}
    assert kinds - set(planned) <= {"transfer/h2d/batches", "transfer/d2h/log-probs"}  # not planned: KiB
    assert counted["transfer/h2d"] == sum(counted[k] for k in kinds if k.startswith("transfer/h2d/"))


def test_the_shipped_1_5b_recipe_moves_under_a_third_of_what_it_did():
    """The planner at the recipe's real shapes: 56.2 GB per step before (the reference once per micro-batch,
    every micro-batch's gradients), 9.3 GB as shipped (the lookup's gradient as the rows it read, the head's
    summed on the device)."""
    from lowmem_grpo.memory.presets import preset
    arch = Arch.from_config(preset("Qwen2.5-1.5B"))
    shipped = load_config("recipes/qwen2.5-1.5b_gsm8k_8gb.yaml", check=False)
    before = load_config("recipes/qwen2.5-1.5b_gsm8k_8gb.yaml", ["layer_major_backward=false",
                                                                  "head_gradient_once_per_step=false"], check=False)
    now = sum(m.total for m in transfers(shipped, arch))
    then = sum(m.total for m in transfers(before, arch, reference_per_micro_batch=True))
    assert then / 1e9 == pytest.approx(56.2, abs=0.1) and now / 1e9 == pytest.approx(9.3, abs=0.1)
    assert now < then / 3


def test_the_shipped_4096_token_recipe_moves_under_a_third_of_what_it_did():
    """82.7 GB before (four-row micro-batches, each sending its gradients, every layer's input offloaded and
    back), 24.2 GB as shipped: layer-major, every second layer's input kept, the head's gradient once."""
    from lowmem_grpo.memory.presets import preset
    arch = Arch.from_config(preset("Qwen2.5-1.5B"))
    recipe = "recipes/qwen2.5-1.5b_gsm8k-4096_8gb.yaml"
    before = load_config(recipe, ["layer_major_backward=false", "head_gradient_once_per_step=false",
                                  "layers_per_checkpoint=1", "per_device_train_batch_size=4",
                                  "gradient_accumulation_steps=8", "steps_per_generation=8"], check=False)
    now = sum(m.total for m in transfers(load_config(recipe, check=False), arch))
    then = sum(m.total for m in transfers(before, arch, reference_per_micro_batch=True))
    assert then / 1e9 == pytest.approx(82.7, abs=0.1) and now / 1e9 == pytest.approx(24.2, abs=0.1)
    assert now < then / 3
