"""The planner's predicted peak against the profiler's measured peak, on the same settings.

    python benchmarks/plan_accuracy.py                       # every configuration below, on the CPU
    python benchmarks/plan_accuracy.py --only qwen0.5b-gsm8k --json out.json
    python benchmarks/plan_accuracy.py --gpu-recipes --memory-cap-gib 8    # a GPU session: the 8 GB recipes

Each configuration builds a random-weight model of a real architecture (trainer_step.py's set-up: no
hub weights, random prompts of exactly the prompt length, completions that run to the full length),
applies a recipe's settings with the overrides listed, runs --steps real trainer steps under
`lowmem-grpo profile`'s profiler, and compares per category and at the peak with `lowmem-grpo plan`
for the same settings (the same bf16 autocast decision, the same lengths and batch sizes).
On a CPU run the measured figure is the device-equivalent peak: host tensors without the reference
model (host RAM on any device), the CPU reference's buffers, the offloaded optimizer's host buffers and
activation offload's host copies (made for real on the CPU while profiling: memory/profile.py). On CUDA
it is the allocator's peak, with the allocator set up first as `lowmem-grpo train` sets it up
(bench_utils.use_train_allocator: expandable segments; each row records it as "allocator").
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from bench_utils import use_train_allocator  # (sibling scripts of this one)
from lowmem_grpo.memory.plan import Arch, plan
from lowmem_grpo.memory.profile import CATEGORIES, GiB, device_equivalent, profile_trainer
from lowmem_grpo.memory.presets import preset
from trainer_step import build, cap_cuda_memory  # the random-weight set-up

HERE = Path(__file__).resolve().parent
RECIPES = HERE.parent / "recipes"

# name -> (architecture, recipe, prompt length, completion length, overrides[, decoder layers kept])
CONFIGS = {
    "qwen0.5b-gsm8k": ("Qwen2.5-0.5B", "qwen2.5-0.5b_gsm8k_8gb.yaml", 64, 64,
                       ["per_device_train_batch_size=4", "gradient_accumulation_steps=2", "num_generations=4",
                        "generation_micro_batch_size=8"]),
    "qwen0.5b-in-backward-bf16sr": ("Qwen2.5-0.5B", "qwen2.5-1.5b_gsm8k_8gb.yaml", 64, 64,
                                    ["num_generations=4", "generation_micro_batch_size=8"]),
    "smollm2-135m-no-checkpointing": ("SmolLM2-135M", "smollm2-135m_arithmetic_cpu.yaml", 48, 48,
                                      ["gradient_checkpointing=false", "per_device_train_batch_size=16",
                                       "generation_micro_batch_size=32", "bf16=false"]),
    "smollm2-135m-demo": ("SmolLM2-135M", "smollm2-135m_arithmetic_cpu.yaml", 48, 48, []),
    # The long-completion recipes' modes (issue 24): bf16_sr, the offloaded optimizer with accumulation,
    # checkpointing with activation offload, the streamed reference, a generation micro-batch smaller
    # than the generation batch, dapo. The 1.5B at its full width, 4 of its 28 layers, shorter sequences,
    # 8 completions per generation batch instead of 32 (a few minutes on 2 cores).
    "qwen1.5b-long-modes": ("Qwen2.5-1.5B", "qwen2.5-1.5b_gsm8k-4096_8gb.yaml", 64, 448,
                            ["num_generations=4", "per_device_train_batch_size=2", "gradient_accumulation_steps=4",
                             "steps_per_generation=4", "generation_micro_batch_size=4"], 4),
    # The same modes where the layer inputs weigh: a narrow Qwen2 with a small vocabulary, 1.25 MiB layer
    # inputs (over activation offload's 1 MiB minimum), unpacked rows (tests/memory/test_plan_vs_profile.py
    # runs these settings in CI).
    "narrow-qwen2-long-modes": (dict(model_type="qwen2", vocab_size=2048, hidden_size=512, intermediate_size=512,
                                     num_hidden_layers=10, num_attention_heads=8, num_key_value_heads=2,
                                     max_position_embeddings=512, tie_word_embeddings=True),
                                "qwen2.5-1.5b_gsm8k-4096_8gb.yaml", 288, 32,
                                ["num_generations=4", "per_device_train_batch_size=4", "gradient_accumulation_steps=2",
                                 "steps_per_generation=2", "generation_micro_batch_size=4", "pack_prompts=false"]),
}


# The 8 GB recipes at their own lengths: for a GPU session (benchmarks/gpu_session.sh), under an 8 GiB cap.
GPU_CONFIGS = {
    "8gb-qwen0.5b-gsm8k": ("Qwen2.5-0.5B", "qwen2.5-0.5b_gsm8k_8gb.yaml", 256, 1024, []),
    "8gb-qwen0.5b-expected-string": ("Qwen2.5-0.5B", "qwen2.5-0.5b_expected-string_8gb.yaml", 128, 64, []),
    "8gb-qwen1.5b-gsm8k": ("Qwen2.5-1.5B", "qwen2.5-1.5b_gsm8k_8gb.yaml", 256, 512, []),
}
# The reasoning-length recipes (issue 24), by name only (--only): a 4096-token rollout takes minutes,
# more than a GPU session's memory step has.
#     python benchmarks/plan_accuracy.py --only 8gb-qwen1.5b-gsm8k-4096 --memory-cap-gib 8 --steps 1
LONG_GPU_CONFIGS = {
    "8gb-qwen1.5b-gsm8k-4096": ("Qwen2.5-1.5B", "qwen2.5-1.5b_gsm8k-4096_8gb.yaml", 256, 4096, []),
    "8gb-qwen1.5b-gsm8k-8192": ("Qwen2.5-1.5B", "qwen2.5-1.5b_gsm8k-8192_8gb.yaml", 256, 8192, []),
}


def measure(name: str, steps: int, device: str, tiny: bool = False) -> dict:
    arch_name, recipe, prompt_len, completion_len, overrides, *layers = {**CONFIGS, **GPU_CONFIGS,
                                                                          **LONG_GPU_CONFIGS}[name]
    layers = layers[0] if layers else None
    if tiny:  # a rehearsal: every code path at toy sizes (trainer_step.TINY, short sequences)
        prompt_len, completion_len = min(prompt_len, 16), min(completion_len, 8)
    args = argparse.Namespace(arch=arch_name, recipe=str(RECIPES / recipe), device=device, prompt_len=prompt_len,
                              completion_len=completion_len, overrides=overrides, tiny=tiny, layers=layers)
    trainer = build(args)
    prof, times, _ = profile_trainer(trainer, steps)
    kind, summary = device_equivalent(prof, trainer)
    measured = summary["peak_bytes"]
    predicted = plan(trainer.cfg, Arch.from_config(trainer.policy.config), autocast=trainer.autocast,
                     device=trainer.device.type)
    if not isinstance(arch_name, str):  # a config dict
        arch_name = f"{arch_name['model_type']} (hidden {arch_name['hidden_size']}, vocab {arch_name['vocab_size']})"
    row = {"config": name, "arch": arch_name, "layers": trainer.policy.config.num_hidden_layers, "recipe": recipe,
           "prompt_len": prompt_len,
           "completion_len": completion_len, "overrides": overrides, "device": device, "steps": steps,
           "step_times_s": times, "measured_peak_bytes": measured, "measured_peak_phase": summary["peak_phase"],
           "measured_at_peak": summary["categories"], "measured_phases": {p: v["peak_bytes"] for p, v in
                                                                         summary["phases"].items()},
           "predicted_peak_bytes": predicted.peak_bytes, "predicted_peak_phase": predicted.peak_phase,
           "predicted_categories": predicted.categories, "predicted_phases": predicted.phases,
           "predicted_host_categories": predicted.host_categories,
           "error": (predicted.peak_bytes - measured) / measured}
    print(f"\n== {name}: {arch_name}, {recipe} + {overrides}, prompt {prompt_len} / completion {completion_len}, "
          f"autocast {trainer.autocast}, {device}")
    print(f"{'MiB at the peak of':<20} {'measured':>10} {'predicted':>10}   (phase: {summary['peak_phase']})")
    at = predicted.phase_categories.get(summary["peak_phase"], {})
    for c in CATEGORIES:
        meas, pred = summary["categories"].get(c, 0), at.get(c, 0)
        if meas or pred:
            print(f"{c:<20} {meas / 2**20:>10.1f} {pred / 2**20:>10.1f}")
    print(f"{'phase peak (MiB)':<20} {'measured':>10} {'predicted':>10}")
    for p in predicted.phases:
        print(f"{p:<20} {row['measured_phases'].get(p, 0) / 2**20:>10.1f} {predicted.phases[p] / 2**20:>10.1f}")
    offloaded = prof.result.devices["host"].summary()["category_max"].get("activations (offloaded)", 0)
    if offloaded or "activations (offloaded)" in predicted.host_categories:  # host RAM: most alive at once
        row["measured_offloaded_bytes"] = offloaded
        print(f"{'host: offloaded activations (MiB)':<36} {offloaded / 2**20:>10.1f} "
              f"{predicted.host_categories.get('activations (offloaded)', 0) / 2**20:>10.1f}")
    print(f"peak: measured {measured / GiB:.3f} GiB ({summary['peak_phase']}), predicted "
          f"{predicted.peak_bytes / GiB:.3f} GiB ({predicted.peak_phase}): {row['error']:+.1%}")
    return row


def main(argv=None) -> int:
    allocator = use_train_allocator()  # first: before anything can start CUDA
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", choices=list(CONFIGS) + list(GPU_CONFIGS) + list(LONG_GPU_CONFIGS),
                    default=None)
    ap.add_argument("--gpu-recipes", action="store_true", help="the 8 GB recipes at full length (CUDA)")
    ap.add_argument("--memory-cap-gib", type=float, default=None, help="CUDA: cap the process at this many GiB")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default=None, help="write the rows here (rewritten after every configuration)")
    ap.add_argument("--tiny", action="store_true", help="toy width, depth and lengths (rehearsals)")
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and args.memory_cap_gib:
        cap_cuda_memory(args.memory_cap_gib, torch.device(args.device))
    names = args.only or (list(GPU_CONFIGS) if args.gpu_recipes else list(CONFIGS))
    rows = []
    for name in names:
        rows.append({**measure(name, args.steps, args.device, args.tiny), "allocator": allocator})
        if args.json:  # after every configuration: a run stopped at its time limit keeps what it measured
            Path(args.json).write_text(json.dumps(rows, indent=2))
    print(f"\n{'config':<32} {'measured GiB':>13} {'predicted GiB':>14} {'error':>7}")
    for r in rows:
        print(f"{r['config']:<32} {r['measured_peak_bytes'] / GiB:>13.3f} {r['predicted_peak_bytes'] / GiB:>14.3f} "
              f"{r['error']:>+7.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
