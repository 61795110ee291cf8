"""Calling the reward functions on a generation batch: the weighted total, the per-function table,
and errors that name the function and the sample when one raises or returns something unusable."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from .base import RewardError, RewardFunction, describe_sample, preview
from .timeout import RewardTimeout

_MAX_LOCATE_CALLS = 256  # single-sample re-calls spent finding which sample made a function raise


# Keyword arguments the trainer passes itself (TRL's names); a dataset column must not take one.
_RESERVED = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")


@dataclass
class RewardLogs:
    """What reward functions logged through TRL's `log_metric(name, value)` (scalars, averaged per
    generation batch) and `log_extra(column, values)` (one value per completion, shown next to it in
    completions.jsonl) keyword arguments."""

    metrics: dict[str, list[float]] = field(default_factory=dict)
    extra: dict[str, list] = field(default_factory=dict)

    def log_metric(self, name: str, value: float) -> None:
        self.metrics.setdefault(str(name), []).append(float(value))

    def log_extra(self, column: str, values: list) -> None:
        self.extra.setdefault(str(column), []).extend(values)

    def metric_means(self) -> dict[str, float]:
        return {k: sum(v) / len(v) for k, v in self.metrics.items() if v}


def compute_rewards(funcs: list[RewardFunction], prompts: list, completions: list,
                    completion_ids: list[list[int]], columns: dict[str, list], *, trainer_state: Any = None,
                    logs: Optional[RewardLogs] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Call every function on the batch; return (per_func (N, F) with NaN for None, total (N,)).

    total = nansum over functions of weight * reward, so a None adds 0; a completion for which every
    function returned None is "unscorable" (see scorable_totals, which marks it NaN for the statistics).
    `trainer_state` (transformers' TrainerState during training) and `logs` (log_metric / log_extra)
    are passed as TRL passes them, when given.
    """
    n = len(completions)
    _check_inputs(n, prompts, completion_ids, columns)
    shared = {} if trainer_state is None else {"trainer_state": trainer_state}
    if logs is not None:
        shared.update(log_extra=logs.log_extra, log_metric=logs.log_metric)
    per_func = torch.empty(n, len(funcs), dtype=torch.float32)
    for j, f in enumerate(funcs):
        per_func[:, j] = _call_one(f, prompts, completions, completion_ids, columns, shared)
    for column, values in ({} if logs is None else logs.extra).items():
        if len(values) != n:
            raise RewardError(f"log_extra({column!r}, ...) received {len(values)} values for {n} completions; "
                              f"a reward function must log one value per completion")
    weights = torch.tensor([f.weight for f in funcs], dtype=torch.float32)
    total = (per_func * weights).nansum(dim=1)
    return per_func, total


def scorable_totals(per_func: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """`total` with NaN where every reward function returned None (TRL >= 1.6): such a completion is left
    out of its group's mean and std, of the logged `reward`, and gets advantage 0."""
    return total.masked_fill(torch.isnan(per_func).all(dim=1), math.nan)


def nan_std(x: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Sample std (Bessel) over the non-NaN entries, as TRL's nanstd: NaN where fewer than 2 remain."""
    valid = ~torch.isnan(x)
    count = valid.sum() if dim is None else valid.sum(dim)
    mean = x.nanmean() if dim is None else x.nanmean(dim, keepdim=True)
    sq = torch.where(valid, (x - mean) ** 2, torch.zeros_like(x))
    sq = sq.sum() if dim is None else sq.sum(dim)
    var = sq / (count - 1).clamp(min=1)
    return torch.where(count > 1, var.sqrt(), torch.full_like(var, math.nan))


def _check_inputs(n, prompts, completion_ids, columns) -> None:
    for what, seq in (("prompts", prompts), ("completion_ids", completion_ids), *columns.items()):
        if len(seq) != n:
            raise ValueError(f"compute_rewards: '{what}' has {len(seq)} entries for {n} completions")
    clash = [k for k in columns if k in _RESERVED]
    if clash:
        raise RewardError(f"dataset column(s) {clash} clash with the reward-function arguments {_RESERVED}: "
                          f"rename them in the dataset")


def _call_one(f: RewardFunction, prompts, completions, completion_ids, columns, shared: dict) -> torch.Tensor:
    n = len(completions)
    try:
        out = f.fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns, **shared)
    except RewardTimeout:  # still running in its thread: re-calling it per sample would only hang again
        raise
    except Exception as e:
        where = "" if isinstance(e, RewardError) else _locate_failure(f, prompts, completions, completion_ids,
                                                                      columns, shared)
        raise RewardError(f"reward function '{f.name}' raised {type(e).__name__}: {e}{where}") from e
    if isinstance(out, torch.Tensor) or type(out).__module__ == "numpy":
        if getattr(out, "ndim", 1) != 1:
            raise RewardError(f"reward function '{f.name}' returned an array of shape {tuple(out.shape)}; "
                              f"it must return one value per completion (a 1-D list of {n})")
        out = out.tolist()
    if not isinstance(out, (list, tuple)):
        raise RewardError(f"reward function '{f.name}' returned a {type(out).__name__} ({preview(out, 80)}); "
                          f"it must return a list with one float (or None) per completion")
    if len(out) != n:
        raise RewardError(f"reward function '{f.name}' returned {len(out)} values for {n} completions; it must "
                          f"return one value per completion (None where it does not apply)")
    values = [_to_float(f, v, i, prompts, completions) for i, v in enumerate(out)]
    col = torch.tensor(values, dtype=torch.float64).to(torch.float32)
    # NaN here only comes from None; inf also catches finite values beyond float32's range.
    bad = torch.isinf(col).nonzero()
    if len(bad):
        i = int(bad[0])
        raise RewardError(f"reward function '{f.name}' returned {out[i]!r} for completion {i}, which is not "
                          f"finite in float32; return a finite number, or None for 'not applicable'"
                          f"{describe_sample(prompts, completions, i)}")
    return col


def _to_float(f: RewardFunction, v, i: int, prompts, completions) -> float:
    if v is None:
        return math.nan
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        v = v.item()
    if not isinstance(v, numbers.Real):
        raise RewardError(f"reward function '{f.name}' returned {preview(v, 80)} ({type(v).__name__}) for "
                          f"completion {i}: each value must be a real number or None"
                          f"{describe_sample(prompts, completions, i)}")
    v = float(v)
    if not math.isfinite(v):
        raise RewardError(f"reward function '{f.name}' returned {v} for completion {i}: rewards must be finite; "
                          f"return None if the function does not apply to a sample"
                          f"{describe_sample(prompts, completions, i)}")
    return v


def _locate_failure(f: RewardFunction, prompts, completions, completion_ids, columns, shared: dict) -> str:
    """Re-call the function one sample at a time to show the user which sample it fails on."""
    # Re-calls log nothing: their log_metric / log_extra would duplicate the batch call's entries.
    quiet = {**shared, **{k: (lambda *a, **kw: None) for k in ("log_extra", "log_metric") if k in shared}}
    for i in range(min(len(completions), _MAX_LOCATE_CALLS)):
        try:
            f.fn(prompts=prompts[i:i + 1], completions=completions[i:i + 1],
                 completion_ids=completion_ids[i:i + 1], **{k: v[i:i + 1] for k, v in columns.items()}, **quiet)
        except Exception:
            return f"\n  (first sample it fails on when called one at a time){describe_sample(prompts, completions, i)}"
    return ""


def reward_metrics(funcs: list[RewardFunction], per_func: torch.Tensor, total: torch.Tensor) -> dict[str, float]:
    """TRL's reward metrics: ``reward`` and ``reward_std`` (mean and sample std of the weighted total over
    the batch, leaving out completions no function scored) and, per function, ``rewards/<label>/mean``
    and ``/std`` (over the samples it scored).

    Stds are sample stds (Bessel, as TRL's nanstd), 0.0 for a single value. A function that returned
    None for every sample gets float('nan') for both (written as null in metrics.jsonl).
    """
    scored = scorable_totals(per_func, total).double()
    scored = scored[~torch.isnan(scored)]
    out = {"reward": float(scored.mean()) if len(scored) else math.nan,
           "reward_std": float(scored.std()) if len(scored) > 1 else (0.0 if len(scored) else math.nan)}
    for j, f in enumerate(funcs):
        vals = per_func[:, j].double()
        vals = vals[~torch.isnan(vals)]
        mean = float(vals.mean()) if len(vals) else math.nan
        std = float(vals.std()) if len(vals) > 1 else (0.0 if len(vals) else math.nan)
        out[f"rewards/{f.name}/mean"], out[f"rewards/{f.name}/std"] = mean, std
    return out
