"""Greedy evaluation on held-out prompts: mean reward per function and pass rate (reward >= 1).

Used by `lowmem-grpo eval`, by `train` before/after training (eval_on_start / eval_on_end) and every
eval_steps during it (logged as eval_* rows of metrics.jsonl)."""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import random
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from ..config import GenerationConfig
from ..policy.rollout import decode_completions, generate
from ..rewards import RewardLogs, compute_rewards
from ..rewards.model import reward_models
from .context import RolloutContext
from .metrics import append_metrics_row, eval_metrics

logger = logging.getLogger(__name__)


def evaluate(ctx: RolloutContext, prompt_set, gen_cfg: GenerationConfig, *, batch_size: int = 64,
             max_samples: Optional[int] = None, output_file: Optional[Path] = None, trainer_state=None) -> dict:
    """One greedy completion per held-out prompt, by `ctx.policy`, scored by `ctx.reward_funcs`.

    Returns {"samples", "reward" (mean weighted total), "rewards/<name>/mean", "pass_rate/<name>"
    (fraction of samples where that function gave >= 1, i.e. accuracy for 0/1 rewards; not for a reward
    model, whose score has no pass mark), "mean_length", "seconds"}. If output_file is given, every
    completion is written there with its rewards.
    """
    with training_rng_untouched(ctx.device):
        return _evaluate(ctx, prompt_set, gen_cfg, batch_size=batch_size, max_samples=max_samples,
                         output_file=output_file, trainer_state=trainer_state)


@contextlib.contextmanager
def training_rng_untouched(device: torch.device):
    """Every random stream training draws from (Python, NumPy, torch CPU and the device's CUDA generator)
    is put back as it was: greedy decoding draws nothing, but a fallback path or a reward function
    might, and an evaluation in the middle of `train` must not change what training samples next."""
    py, np_state = random.getstate(), np.random.get_state()
    cuda = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        try:
            yield
        finally:
            random.setstate(py)
            np.random.set_state(np_state)


def _evaluate(ctx: RolloutContext, prompt_set, gen_cfg, *, batch_size, max_samples, output_file, trainer_state) -> dict:
    model, tokenizer, reward_funcs, eos_ids = ctx.policy, ctx.tokenizer, ctx.reward_funcs, ctx.eos_ids
    n = len(prompt_set) if max_samples is None else min(max_samples, len(prompt_set))
    subset = prompt_set.select(list(range(n)))
    t0 = time.perf_counter()
    batch = generate(model, subset.prompt_ids, gen_cfg, eos_ids=eos_ids, pad_id=ctx.pad_id, device=ctx.device,
                     greedy=True, micro_batch=batch_size, autocast_bf16=ctx.autocast)
    decoded = decode_completions(batch, subset.prompts, eos_ids, tokenizer)
    keep, completion_ids, texts, completions = decoded.keep, decoded.ids, decoded.texts, decoded.completions
    # trainer_state as in training (TRL passes it in evaluation too): reward functions may read it
    logs = RewardLogs()
    per_func, total = compute_rewards(reward_funcs, subset.prompts, completions, completion_ids, subset.columns,
                                      trainer_state=trainer_state, logs=logs)
    result = {"samples": n, "reward": total.mean().item()}
    models = {id(m) for m in reward_models(reward_funcs)}
    for j, f in enumerate(reward_funcs):
        col = per_func[:, j]
        valid = ~col.isnan()
        result[f"rewards/{f.name}/mean"] = col[valid].mean().item() if valid.any() else None
        if id(inspect.unwrap(f.fn)) not in models:  # a model's score is unbounded: ">= 1" is no pass mark
            result[f"pass_rate/{f.name}"] = (col[valid] >= 1.0).float().mean().item() if valid.any() else None
    result.update(logs.metric_means())  # what the reward functions logged with log_metric
    result["mean_length"] = keep.sum(1).float().mean().item()
    result["seconds"] = time.perf_counter() - t0
    if output_file is not None:
        output_file.parent.mkdir(parents=True, exist_ok=True)
        with open(output_file, "w") as fh:
            for i in range(n):
                row = {"prompt": subset.prompts[i], "completion": texts[i], "reward": total[i].item(),
                       "rewards": {f.name: (None if per_func[i, j].isnan() else per_func[i, j].item())
                                   for j, f in enumerate(reward_funcs)}}
                fh.write(json.dumps(row, default=str) + "\n")
    return result


def format_comparison(before: Optional[dict], after: dict) -> str:
    """A before/after table of every evaluation metric, side by side."""
    keys = [k for k in after if k not in ("seconds",)]
    lines = [f"{'held-out evaluation (greedy)':<36} {'before':>10} {'after':>10}"]
    for k in keys:
        b = None if before is None else before.get(k)
        lines.append(f"{k:<36} {_fmt(b):>10} {_fmt(after[k]):>10}")
    return "\n".join(lines)


def _fmt(v) -> str:
    if v is None:
        return "-"
    return f"{v:d}" if isinstance(v, int) else f"{v:.3f}"


def evaluation_before(run_eval: Callable[[], dict], output_dir: str | Path, resumed: bool) -> dict:
    """eval_on_start: evaluate now and write eval_start.json, or, when resuming a run that already did,
    read back what it measured before its first step."""
    path = Path(output_dir, "eval_start.json")
    if resumed and path.is_file():
        return json.loads(path.read_text())
    result = run_eval()
    path.write_text(json.dumps(result, indent=2))
    return result


def evaluation_after(run_eval: Callable[[], dict], output_dir: str | Path, before: Optional[dict], step: int) -> dict:
    """eval_on_end: evaluate, write eval_end.json (the latest end) and print the before/after table. The
    result is also this step's eval_* row in metrics.jsonl, unless eval_steps already logged one there, so
    a resumed run that ends again keeps every earlier end's evaluation (for `plot`, among others)."""
    after = run_eval()
    Path(output_dir, "eval_end.json").write_text(json.dumps(after, indent=2))
    if step not in evaluated_steps(Path(output_dir, "metrics.jsonl")):
        append_metrics_row(output_dir, step, eval_metrics(after))
    logger.info("%s", format_comparison(before, after))
    return after


def is_eval_row(row: dict) -> bool:
    return "eval_reward" in row


def evaluated_steps(metrics_file: str | Path) -> set[int]:
    """Steps that already have an evaluation row in metrics.jsonl (a torn last line is ignored)."""
    path = Path(metrics_file)
    steps = set()
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and is_eval_row(row):
                steps.add(row.get("step"))
    return steps


def evaluation_during(run_eval: Callable[[], dict], model: torch.nn.Module, log, step: int) -> dict:
    """eval_steps: evaluate now, log the result as this step's eval_* row, and leave the model in the
    mode it was in (training). Its time is not part of any step's step_time."""
    was_training = model.training
    try:
        result = run_eval()
    finally:
        model.train(was_training)
    row = eval_metrics(result)
    log.metrics(step, row)
    rates = " ".join(f"{k[len('eval_'):]}={_fmt(v)}" for k, v in row.items() if k.startswith("eval_pass_rate/"))
    logger.info(f"step {step} held-out (greedy): reward={_fmt(row['eval_reward'])} {rates}".rstrip())
    return row
