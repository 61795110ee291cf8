"""Calling the reward functions on a generation batch: the weighted total, the per-function table,
and errors that name the function and the sample when one raises or returns something unusable."""

from __future__ import annotations

import math
import numbers

import torch

from .base import RewardError, RewardFunction, describe_sample, preview
from .timeout import RewardTimeout

_MAX_LOCATE_CALLS = 256  # single-sample re-calls spent finding which sample made a function raise


_RESERVED = ("prompts", "completions", "completion_ids")


def compute_rewards(funcs: list[RewardFunction], prompts: list, completions: list,
                    completion_ids: list[list[int]], columns: dict[str, list]) -> tuple[torch.Tensor, torch.Tensor]:
    """Call every function on the batch; return (per_func (N, F) with NaN for None, total (N,)).

    total = nansum over functions of weight * reward, so a None adds 0 (TRL semantics).
    """
    n = len(completions)
    _check_inputs(n, prompts, completion_ids, columns)
    per_func = torch.empty(n, len(funcs), dtype=torch.float32)
    for j, f in enumerate(funcs):
        per_func[:, j] = _call_one(f, prompts, completions, completion_ids, columns)
    weights = torch.tensor([f.weight for f in funcs], dtype=torch.float32)
    total = (per_func * weights).nansum(dim=1)
    return per_func, total


def _check_inputs(n, prompts, completion_ids, columns) -> None:
    for what, seq in (("prompts", prompts), ("completion_ids", completion_ids), *columns.items()):
        if len(seq) != n:
            raise ValueError(f"compute_rewards: '{what}' has {len(seq)} entries for {n} completions")
    clash = [k for k in columns if k in _RESERVED]
    if clash:
        raise RewardError(f"dataset column(s) {clash} clash with the reward-function arguments {_RESERVED}: "
                          f"rename them in the dataset")


def _call_one(f: RewardFunction, prompts, completions, completion_ids, columns) -> torch.Tensor:
    n = len(completions)
    try:
        out = f.fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
    except RewardTimeout:  # still running in its thread: re-calling it per sample would only hang again
        raise
    except Exception as e:
        where = "" if isinstance(e, RewardError) else _locate_failure(f, prompts, completions, completion_ids,
                                                                      columns)
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


def _locate_failure(f: RewardFunction, prompts, completions, completion_ids, columns) -> str:
    """Re-call the function one sample at a time to show the user which sample it fails on."""
    for i in range(min(len(completions), _MAX_LOCATE_CALLS)):
        try:
            f.fn(prompts=prompts[i:i + 1], completions=completions[i:i + 1],
                 completion_ids=completion_ids[i:i + 1], **{k: v[i:i + 1] for k, v in columns.items()})
        except Exception:
            return f"\n  (first sample it fails on when called one at a time){describe_sample(prompts, completions, i)}"
    return ""


def reward_metrics(funcs: list[RewardFunction], per_func: torch.Tensor, total: torch.Tensor) -> dict[str, float]:
    """``reward`` (mean weighted total) and, per function, ``rewards/<label>/mean`` and ``/std``.

    Means and stds skip None (NaN) samples; std is the sample std (Bessel, as TRL's nanstd), 0.0
    for a single value. A function that returned None for every sample gets float('nan') for
    both: the caller should drop NaN metrics before logging.
    """
    out = {"reward": float(total.float().mean()) if total.numel() else math.nan}
    for j, f in enumerate(funcs):
        vals = per_func[:, j].double()
        vals = vals[~torch.isnan(vals)]
        mean = float(vals.mean()) if len(vals) else math.nan
        std = float(vals.std()) if len(vals) > 1 else (0.0 if len(vals) else math.nan)
        out[f"rewards/{f.name}/mean"], out[f"rewards/{f.name}/std"] = mean, std
    return out
