"""A picture of a run: output_dir/run.png, one panel per question a user asks of a GRPO run.

    reward              the batch mean reward and each reward function's mean
    held-out score      eval_* rows (eval.eval_steps), eval_start.json at step 0, eval_end.json at the end
    completion length   mean (min-max shaded) sampled length, and the greedy held-out length
    KL and entropy      on two y-axes: they differ by orders of magnitude
    clip ratio          region (low or high), low and high
    step time           the whole optimizer step and its generation part

Drawn from metrics.jsonl alone (plus the eval_*.json files beside it), so it works on a finished run,
a running one, or one killed mid-write (a torn line is skipped). Metric names of both vintages are
read (`clip_ratio` or TRL's `clip_ratio/region_mean`, ...). A panel with nothing logged says so.
Uses matplotlib's Agg canvas directly, never pyplot, so a notebook's backend is left alone; imports
neither torch nor the model code, so `lowmem-grpo plot` starts fast.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Optional

logger = logging.getLogger(__name__)

PLOT_NAME = "run.png"
PANELS = ("reward", "held-out score", "completion length", "KL and entropy", "clip ratio", "step time")

# Each series: a label and the metric names it may be logged under (newest first).
_CLIP = [("region", ("clip_ratio/region_mean", "clip_ratio")), ("low", ("clip_ratio/low_mean", "clip_ratio_low")),
         ("high", ("clip_ratio/high_mean", "clip_ratio_high", "cispo_clip_ratio"))]
_TIME = [("step", ("step_time",)), ("generation", ("generation_time",))]


def is_eval_row(row: dict) -> bool:
    """An evaluation row (eval.eval_steps) rather than a training step's metrics."""
    return any(k.startswith("eval_") for k in row)


def read_rows(path: str | Path) -> tuple[list[dict], int]:
    """The JSON objects of a .jsonl file, and how many lines could not be read (a torn last line)."""
    rows, bad = [], 0
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), (int, float)):
            rows.append(row)
        else:
            bad += 1
    return rows, bad


def _number(v) -> Optional[float]:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def _series(rows: list[dict], names: tuple[str, ...]) -> tuple[list[float], list[float]]:
    """(steps, values) of the first name each row has a number for; rows without one are skipped."""
    xs, ys = [], []
    for row in rows:
        for name in names:
            v = _number(row.get(name))
            if v is not None:
                xs.append(row["step"])
                ys.append(v)
                break
    return xs, ys


def _function_names(rows: list[dict], prefix: str, suffix: str) -> list[str]:
    seen: dict[str, None] = {}
    for row in rows:
        for k in row:
            if k.startswith(prefix) and k.endswith(suffix) and len(k) > len(prefix) + len(suffix):
                seen[k[len(prefix):len(k) - len(suffix)]] = None
    return list(seen)


def _empty(ax, title: str, why: str) -> None:
    ax.set_title(title)
    ax.text(0.5, 0.5, why, ha="center", va="center", transform=ax.transAxes, color="gray")
    ax.set_xticks([])
    ax.set_yticks([])


def _draw(ax, title: str, lines: list[tuple[str, list, list]], why_empty: str, ylabel: str = "") -> bool:
    lines = [line for line in lines if line[1]]
    if not lines:
        _empty(ax, title, why_empty)
        return False
    for label, xs, ys in lines:
        ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=label)
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    steps = {x for line in lines for x in line[1]}
    if len(steps) == 1:  # one point: an integer step axis needs some width around it
        ax.set_xlim(min(steps) - 1, min(steps) + 1)
    if len(lines) > 1:
        ax.legend(fontsize=8)
    return True


def _eval_file(run_dir: Path, name: str) -> Optional[dict]:
    path = run_dir / name
    try:
        data = json.loads(path.read_text()) if path.is_file() else None
    except (json.JSONDecodeError, OSError):
        return None
    return data if isinstance(data, dict) else None


def _held_out(ax, run_dir: Path, evals: list[dict], last_step: float) -> None:
    """eval_* rows as lines (eval_on_end logs one too); eval_start.json at step 0, and eval_end.json at the
    last step where no row is there (runs that logged the end only to that file)."""
    start, end = _eval_file(run_dir, "eval_start.json"), _eval_file(run_dir, "eval_end.json")
    points = [(0, {f"eval_{k}": v for k, v in start.items()})] if start else []
    points += [(row["step"], row) for row in evals]
    if end and not any(row["step"] == last_step for row in evals):
        points.append((last_step, {f"eval_{k}": v for k, v in end.items()}))
    points.sort(key=lambda p: p[0])
    rows = [{"step": s, **r} for s, r in points]
    lines = [("reward", *_series(rows, ("eval_reward",)))]
    lines += [(f"pass rate {n}", *_series(rows, (f"eval_pass_rate/{n}",)))
              for n in _function_names(rows, "eval_pass_rate/", "")]
    _draw(ax, "held-out score (greedy)", lines, "no held-out evaluation in this run\n(eval.eval_steps, "
          "eval_on_start, eval_on_end)")


def plot_run(run_dir: str | Path, out: Optional[str | Path] = None) -> Path:
    """Draw run_dir's metrics into a PNG (default run_dir/run.png) and return its path."""
    fig = draw_run(run_dir)
    path = Path(out) if out is not None else Path(run_dir) / PLOT_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    return path


def draw_run(run_dir: str | Path):
    """The run's figure (a matplotlib Figure on an Agg canvas; axes in PANELS order)."""
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"no metrics.jsonl in {str(run_dir)!r}: give the output_dir of a lowmem-grpo run "
                                "(it is written from the first logged step on)")
    rows, bad = read_rows(metrics)
    if bad:
        logger.warning(f"{metrics}: skipped {bad} unreadable line(s) (a run killed mid-write leaves a torn last line)")
    train = [r for r in rows if not is_eval_row(r)]
    evals = [r for r in rows if is_eval_row(r)]
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(13, 10), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(3, 2).ravel()
    for ax in axes:
        ax.set_xlabel("optimizer step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    functions = _function_names(train, "rewards/", "/mean")
    _draw(axes[0], "reward (sampled completions)",
          [("reward", *_series(train, ("reward",)))]
          + [(n, *_series(train, (f"rewards/{n}/mean",))) for n in functions],
          "no reward logged yet")
    last_step = max((r["step"] for r in rows), default=0)
    _held_out(axes[1], run_dir, evals, last_step)
    xs, mean = _series(train, ("completions/mean_length",))
    held_out = _series(evals, ("eval_completions/mean_length",))
    if _draw(axes[2], "completion length (tokens)", [("sampled mean", xs, mean), ("held-out greedy", *held_out)],
             "no completion lengths logged"):
        lo, hi = _series(train, ("completions/min_length",)), _series(train, ("completions/max_length",))
        if lo[1] and len(lo[1]) == len(hi[1]) and lo[0] == hi[0]:
            axes[2].fill_between(lo[0], lo[1], hi[1], alpha=0.15, label="sampled min-max")
            axes[2].legend(fontsize=8)
    _kl_entropy(axes[3], train)
    _draw(axes[4], "clip ratio", [(label, *_series(train, names)) for label, names in _CLIP], "no clip ratio logged")
    _draw(axes[5], "step time", [(label, *_series(train, names)) for label, names in _TIME], "no step time logged",
          ylabel="seconds")
    fig.suptitle(f"{run_dir.resolve().name}: {len(train)} logged steps"
                 + (f", {len(evals)} evaluation(s)" if evals else ""))
    return fig


def _kl_entropy(ax, train: list[dict]) -> None:
    kl, entropy = _series(train, ("kl",)), _series(train, ("entropy",))
    if not kl[0] and not entropy[0]:
        _empty(ax, "KL and entropy", "no KL or entropy logged")
        return
    ax.set_title("KL (left) and entropy (right)")
    ax.grid(alpha=0.3)
    if kl[0]:
        ax.plot(*kl, color="tab:blue", label="kl")
        ax.set_ylabel("kl", color="tab:blue")
    if entropy[0]:
        right = ax.twinx()
        right.plot(*entropy, color="tab:orange", label="entropy")
        right.set_ylabel("entropy", color="tab:orange")


def save_run_plot(run_dir: str | Path) -> Optional[Path]:
    """plot_run for the end of `train`: a failure to draw is a warning, never the run's failure. A run that
    stopped before its first logged step has nothing to draw, and gets no picture and no warning."""
    if not (Path(run_dir) / "metrics.jsonl").is_file():
        return None
    try:
        path = plot_run(run_dir)
    except Exception as e:  # noqa: BLE001 - the picture is a convenience; the run's results are on disk
        logger.warning(f"could not draw {Path(run_dir) / PLOT_NAME}: {type(e).__name__}: {e} "
                       f"(try `lowmem-grpo plot {run_dir}`)")
        return None
    logger.info(f"wrote {path}")
    return path
