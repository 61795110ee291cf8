"""Reward functions: loading them from a recipe, calling them, checking what they return.

A reward function has TRL's GRPOTrainer signature::

    f(prompts, completions, completion_ids=..., **columns) -> list[float | None]

``prompts`` holds the dataset prompts (a string, a chat message list, or a list[int] for token-id
tasks); ``completions`` the completions (a string, ``[{"role": "assistant", "content": text}]``
when the prompt is conversational, or the list[int] of ids when the task has no tokenizer);
``completion_ids`` the completion token ids (EOS excluded); every other dataset column arrives as a
keyword argument holding one entry per completion (each row repeated G times). ``None`` means
"not applicable to this sample": it becomes NaN in the per-function table, is left out of that
function's mean and adds 0 to the weighted total (TRL semantics).

Specs accepted by :func:`load_reward_functions` (see :data:`lowmem_grpo.reward_builtins.BUILTINS`):
a built-in name, a dict ``{"name": ..., "label": ..., **kwargs}``, ``"package.module:function"``,
``"path/to/file.py:function"``, or (from Python) a callable.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

_PREVIEW_CHARS = 200
_MAX_LOCATE_CALLS = 256  # single-sample re-calls spent finding which sample made a function raise


class RewardError(RuntimeError, ValueError):
    """A user-facing problem with a reward function or its configuration.

    Also a ValueError, so config validation that catches ValueError reports it the same way.
    """


@dataclass
class RewardFunction:
    name: str  # label for metrics: rewards/<name>/mean
    fn: Callable
    weight: float


# ----------------------------------------------------------------------------------------------
# Helpers shared with the built-ins
# ----------------------------------------------------------------------------------------------

def completion_text(c) -> str:
    """The text of one completion: a string, or the last assistant message of a TRL chat list."""
    if isinstance(c, str):
        return c
    if isinstance(c, dict):
        return _content_text(c.get("content"))
    if isinstance(c, (list, tuple)):
        if c and all(isinstance(x, numbers.Integral) for x in c):
            raise RewardError("this completion is a list of token ids: the task has no tokenizer, so there is "
                              "no text. Use a token-id reward (token_answer, token_think) or read "
                              "`completion_ids` in your function.")
        if all(isinstance(m, dict) for m in c):
            if not c:
                return ""
            assistant = [m for m in c if m.get("role") == "assistant"]
            return _content_text((assistant or c)[-1].get("content"))
    raise RewardError(f"cannot read text from a completion of type {type(c).__name__}: expected a string or "
                      f"a list of chat messages, got {_preview(c)}")


def _content_text(content) -> str:
    # Multimodal-style content is a list of parts: [{"type": "text", "text": ...}, ...].
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def _preview(x, limit: int = _PREVIEW_CHARS) -> str:
    """A one-line, truncated rendering of a prompt or completion for error messages."""
    if isinstance(x, (list, tuple)) and x and all(isinstance(m, dict) for m in x):
        text = " | ".join(f"{m.get('role', '?')}: {_content_text(m.get('content'))}" for m in x)
    else:
        text = x if isinstance(x, str) else str(x)
    if len(text) > limit:  # keep both ends: the system prompt opens a prompt, the question ends it
        half = limit // 2
        text = f"{text[:half]} ... {text[-half:]} [{len(text)} chars]"
    return repr(text)


def _sample(prompts, completions, i: int) -> str:
    p = prompts[i] if i < len(prompts) else "?"
    c = completions[i] if i < len(completions) else "?"
    return f"\n  sample {i}:\n    prompt:     {_preview(p)}\n    completion: {_preview(c)}"


# ----------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------

def load_reward_functions(specs: list, weights: list | None = None,
                          base_dir: str | Path | None = None) -> list[RewardFunction]:
    """Build the reward functions of a recipe; ``base_dir`` (the recipe's folder) resolves file paths."""
    if isinstance(specs, (str, dict)) or callable(specs):
        specs = [specs]
    if not specs:
        raise RewardError("no reward functions configured: set rewards.reward_funcs, e.g. ['numeric_answer']")
    weights = _check_weights(weights, len(specs))
    funcs, used = [], set()
    for i, (spec, w) in enumerate(zip(specs, weights)):
        label, fn = _load_one(spec, base_dir, where=f"reward_funcs[{i}]")
        label = _unique(label, used)
        funcs.append(RewardFunction(name=label, fn=fn, weight=w))
    return funcs


def _check_weights(weights, n: int) -> list[float]:
    if weights is None:
        return [1.0] * n
    if len(weights) != n:
        raise RewardError(f"reward_weights has {len(weights)} values for {n} reward functions: give one weight "
                          f"per entry of reward_funcs, or leave reward_weights unset (all 1.0)")
    out = []
    for i, w in enumerate(weights):
        if isinstance(w, bool) or not isinstance(w, numbers.Real) or not math.isfinite(w):
            raise RewardError(f"reward_weights[{i}] = {w!r} is not a finite number")
        out.append(float(w))
    return out


def _unique(label: str, used: set) -> str:
    out, k = label, 2
    while out in used:
        out, k = f"{label}_{k}", k + 1
    used.add(out)
    return out


def _load_one(spec, base_dir, where: str) -> tuple[str, Callable]:
    label, kwargs = None, {}
    if isinstance(spec, dict):
        kwargs = dict(spec)
        if "name" not in kwargs:
            raise RewardError(f"{where}: a dict spec needs a 'name' key (a built-in or 'module:function'), "
                              f"got keys {sorted(kwargs)}")
        spec, label = kwargs.pop("name"), kwargs.pop("label", None)
        if label is not None and not isinstance(label, str):
            raise RewardError(f"{where}: 'label' must be a string, got {label!r}")
    if callable(spec):
        fn = functools.partial(spec, **kwargs) if kwargs else spec
        return label or getattr(spec, "__name__", "reward"), fn
    if not isinstance(spec, str):
        raise RewardError(f"{where}: expected a built-in name, 'module:function', 'file.py:function', a dict or "
                          f"a callable, got {type(spec).__name__} {spec!r}")
    if ":" in spec:
        fn = _load_user_function(spec, base_dir, where)
        return label or getattr(fn, "__name__", spec), functools.partial(fn, **kwargs) if kwargs else fn
    return label or spec, _build_builtin(spec, kwargs, where)


def _build_builtin(name: str, kwargs: dict, where: str) -> Callable:
    from lowmem_grpo.reward_builtins import BUILTINS  # late: the built-ins import this module

    if name not in BUILTINS:
        close = difflib.get_close_matches(name, list(BUILTINS), n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise RewardError(f"{where}: unknown built-in reward '{name}'.{hint} Built-ins: {', '.join(BUILTINS)}. "
                          f"For your own function use 'package.module:function' or 'path/to/file.py:function'.")
    factory = BUILTINS[name]
    params = inspect.signature(factory).parameters
    unknown = [k for k in kwargs if k not in params]
    if unknown:
        raise RewardError(f"{where}: built-in '{name}' has no option {', '.join(map(repr, unknown))}; "
                          f"valid options: {', '.join(params) or '(none)'}")
    missing = [k for k, p in params.items() if p.default is inspect.Parameter.empty and k not in kwargs]
    if missing:
        raise RewardError(f"{where}: built-in '{name}' needs {', '.join(map(repr, missing))}: write it as "
                          f"{{name: {name}, {missing[0]}: ...}}")
    try:
        return factory(**kwargs)
    except RewardError:
        raise
    except (ValueError, TypeError) as e:
        raise RewardError(f"{where}: built-in '{name}': {e}") from e


def _load_user_function(spec: str, base_dir, where: str) -> Callable:
    target, _, attr = spec.rpartition(":")  # rpartition: a Windows drive letter keeps its colon
    if not target or not attr:
        raise RewardError(f"{where}: '{spec}' should be 'package.module:function' or 'path/to/file.py:function'")
    is_file = target.endswith(".py") or "/" in target or "\\" in target
    module = _load_file(target, base_dir, where) if is_file else _import_module(target, where)
    if not hasattr(module, attr):
        funcs = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise RewardError(f"{where}: '{target}' has no attribute '{attr}'. Callables defined there: "
                          f"{', '.join(funcs) or '(none)'}")
    fn = getattr(module, attr)
    if not callable(fn):
        raise RewardError(f"{where}: '{spec}' is a {type(fn).__name__}, not a function")
    return fn


def _import_module(name: str, where: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        # e.name tells apart "the module itself is missing" from "one of its imports is missing".
        if e.name and (name == e.name or name.startswith(e.name + ".")):
            raise RewardError(f"{where}: cannot import module '{name}' ({e}). Install it or put its folder on "
                              f"PYTHONPATH; for a file write 'path/to/file.py:function'.") from e
        raise RewardError(f"{where}: module '{name}' failed to import: {type(e).__name__}: {e}") from e
    except Exception as e:
        raise RewardError(f"{where}: module '{name}' failed to import: {type(e).__name__}: {e}") from e


def _load_file(target: str, base_dir, where: str):
    path = Path(target).expanduser()
    tried = [path] if path.is_absolute() else [Path.cwd() / path] + ([Path(base_dir) / path] if base_dir else [])
    found = next((p for p in tried if p.is_file()), None)
    if found is None:
        raise RewardError(f"{where}: reward file '{target}' not found (looked at: "
                          f"{', '.join(str(p) for p in tried)}). Relative paths are tried from the current "
                          f"folder, then from the recipe's folder.")
    found = found.resolve()
    # One module per file, however many specs name it; registered so pickling and dataclasses work.
    mod_name = f"_lowmem_grpo_reward_{found.stem}_{hashlib.sha1(str(found).encode()).hexdigest()[:10]}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    module_spec = importlib.util.spec_from_file_location(mod_name, found)
    if module_spec is None or module_spec.loader is None:
        raise RewardError(f"{where}: cannot load '{found}' as a Python module (is it a .py file?)")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[mod_name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[mod_name]
        raise RewardError(f"{where}: running '{found}' failed: {type(e).__name__}: {e}") from e
    return module


# ----------------------------------------------------------------------------------------------
# Calling
# ----------------------------------------------------------------------------------------------

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
        raise RewardError(f"reward function '{f.name}' returned a {type(out).__name__} ({_preview(out, 80)}); "
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
                          f"{_sample(prompts, completions, i)}")
    return col


def _to_float(f: RewardFunction, v, i: int, prompts, completions) -> float:
    if v is None:
        return math.nan
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        v = v.item()
    if not isinstance(v, numbers.Real):
        raise RewardError(f"reward function '{f.name}' returned {_preview(v, 80)} ({type(v).__name__}) for "
                          f"completion {i}: each value must be a real number or None"
                          f"{_sample(prompts, completions, i)}")
    v = float(v)
    if not math.isfinite(v):
        raise RewardError(f"reward function '{f.name}' returned {v} for completion {i}: rewards must be finite; "
                          f"return None if the function does not apply to a sample"
                          f"{_sample(prompts, completions, i)}")
    return v


def _locate_failure(f: RewardFunction, prompts, completions, completion_ids, columns) -> str:
    """Re-call the function one sample at a time to show the user which sample it fails on."""
    for i in range(min(len(completions), _MAX_LOCATE_CALLS)):
        try:
            f.fn(prompts=prompts[i:i + 1], completions=completions[i:i + 1],
                 completion_ids=completion_ids[i:i + 1], **{k: v[i:i + 1] for k, v in columns.items()})
        except Exception:
            return f"\n  (first sample it fails on when called one at a time){_sample(prompts, completions, i)}"
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
