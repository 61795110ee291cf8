"""Loading the reward functions a recipe names: built-ins, `module:function`, `path/file.py:function`,
a dict with options and a label, a reward model (a folder or hub id; from Python also a loaded model:
rewards/model.py), or (from Python) a callable. Errors name the entry and the fix."""

from __future__ import annotations

import difflib
import functools
import hashlib
import importlib
import importlib.util
import inspect
import json
import math
import numbers
import sys
from pathlib import Path
from typing import Callable

from .base import RewardError, RewardFunction
from .builtins import BUILTINS
from .model import ModelSettings, load_reward_model, looks_like_model, missing_folder_error


def load_reward_functions(specs: list, weights: list | None = None, base_dir: str | Path | None = None,
                          models: ModelSettings | None = None) -> list[RewardFunction]:
    """Build the reward functions of a recipe; ``base_dir`` (the recipe's folder) resolves file paths;
    ``models`` says where and how reward models run, and their tokenizers (default: on the CPU, their own)."""
    if isinstance(specs, (str, dict)) or callable(specs):
        specs = [specs]
    if not specs:
        raise RewardError("no reward functions configured: set rewards.reward_funcs, e.g. ['numeric_answer']")
    weights = _check_weights(weights, len(specs))
    models = models or ModelSettings()
    classes = models.processing_classes or [None] * len(specs)
    if len(classes) != len(specs):
        raise RewardError(f"reward_processing_classes has {len(classes)} entries for {len(specs)} reward functions: "
                          f"give one per entry of reward_funcs (null for functions)")
    funcs, used = [], set()
    for i, (spec, w) in enumerate(zip(specs, weights)):
        where = f"reward_funcs[{i}]"
        label, fn = _load_one(spec, base_dir, where, models, classes[i])
        label = _unique(label, used)
        funcs.append(RewardFunction(name=label, fn=fn, weight=w))
    return funcs


def spec_record(spec):
    """A JSON-able record of a reward spec (for config.json and checkpoints): names and dicts as given, a
    Python callable as 'module:qualname', which reloads when the callable is importable from there."""
    if isinstance(spec, dict):
        return {k: spec_record(v) if k == "name" else _json_or_repr(v) for k, v in spec.items()}
    if not isinstance(spec, str) and looks_like_model(spec):  # a loaded reward model: where it was loaded from
        return getattr(spec.config, "_name_or_path", None) or type(spec).__name__
    if callable(spec) and not isinstance(spec, str):
        fn = spec.func if isinstance(spec, functools.partial) else spec
        qualname = getattr(fn, "__qualname__", None) or type(fn).__qualname__
        return f"{getattr(fn, '__module__', None) or type(fn).__module__}:{qualname}"
    return spec


def _json_or_repr(value):
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return repr(value)


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


def _load_one(spec, base_dir, where: str, models: ModelSettings, tokenizer) -> tuple[str, Callable]:
    label, kwargs = None, {}
    if isinstance(spec, dict):
        kwargs = dict(spec)
        if "name" not in kwargs:
            raise RewardError(f"{where}: a dict spec needs a 'name' key (a built-in, 'module:function' or a "
                              f"reward model), got keys {sorted(kwargs)}")
        spec, label = kwargs.pop("name"), kwargs.pop("label", None)
        if label is not None and not isinstance(label, str):
            raise RewardError(f"{where}: 'label' must be a string, got {label!r}")
    if not (isinstance(spec, str) and spec in BUILTINS) and looks_like_model(spec, base_dir):
        if kwargs:
            raise RewardError(f"{where}: a reward model takes no options ({', '.join(map(repr, kwargs))}); its "
                              f"settings are rewards.model_placement, model_batch_size and model_dtype")
        model = load_reward_model(spec, tokenizer, base_dir=base_dir, settings=models, where=where)
        return label or model.__name__, model
    if tokenizer is not None:
        raise RewardError(f"{where}: reward_processing_classes gives a tokenizer for a reward function; only reward "
                          f"models take one (write null for this entry)")
    if callable(spec):
        fn = functools.partial(spec, **kwargs) if kwargs else spec
        return label or getattr(spec, "__name__", "reward"), fn
    if not isinstance(spec, str):
        raise RewardError(f"{where}: expected a built-in name, 'module:function', 'file.py:function', a dict or "
                          f"a callable, got {type(spec).__name__} {spec!r}")
    if ":" in spec:
        fn = _load_user_function(spec, base_dir, where)
        return label or getattr(fn, "__name__", spec), functools.partial(fn, **kwargs) if kwargs else fn
    return label or spec, _build_builtin(spec, kwargs, where, base_dir)


def _build_builtin(name: str, kwargs: dict, where: str, base_dir=None) -> Callable:

    if name not in BUILTINS:
        if (missing := missing_folder_error(name, base_dir, where)) is not None:
            raise missing
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

