"""A pytest plugin that counts the Triton kernel specializations a set of tests launches: on a GPU each
compiles once per process (and, cold, once on the machine), so their number sizes a test step's compile
time (benchmarks/gpu_session.py, kernel-tests). It runs on a CPU, under Triton's interpreter:

    TRITON_INTERPRET=1 PYTHONPATH=benchmarks python -m pytest -p triton_specializations tests/kernels \\
        -k "cpu-triton or test_triton_copy_matches_torch_copy"

A specialization is what Triton's JIT keys a compiled kernel on: the kernel, its constexpr values, each
tensor argument's dtype and whether its address is a multiple of 16, each int argument's width and
whether it is 1 (a constant) or a multiple of 16, and the launch options (num_warps). A launcher (the C
stub Triton builds per signature) is keyed on the argument types alone. At the session's end it prints
the counts, and with TRITON_SPECIALIZATIONS_JSON=PATH writes each test's keys there.
"""

from __future__ import annotations

import inspect
import json
import os
import re

_current: dict = {"test": None}
_keys: dict[str, list[str]] = {}


def _arg_key(value: object, constexpr: bool) -> str:
    import torch
    if constexpr:
        return repr(value)
    if isinstance(value, torch.Tensor):
        return f"*{value.dtype}:{'a16' if value.data_ptr() % 16 == 0 else 'a'}"
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        if value == 1:
            return "=1"
        width = "i32" if -2**31 <= value < 2**31 else "i64"
        return f"{width}:{'d16' if value % 16 == 0 else 'd'}"
    if isinstance(value, float):
        return "fp32"
    return repr(value)  # None (a constant) or anything else Triton would treat as one


def specialization(fn, arg_names: list[str], args: tuple, kwargs: dict) -> str:
    """The key of one launch of the kernel `fn` (module docstring)."""
    from triton.runtime.jit import _normalize_ty
    constexprs = {name for name, ty in inspect.get_annotations(fn).items() if _normalize_ty(ty) == "constexpr"}
    bound = {**dict(zip(arg_names, args)), **{k: v for k, v in kwargs.items() if k in arg_names}}
    options = sorted((k, v) for k, v in kwargs.items() if k not in arg_names)
    parts = [f"{name}={_arg_key(bound.get(name), name in constexprs)}" for name in arg_names]
    return f"{fn.__name__}({','.join(parts)}){options}"


def launcher(key: str) -> str:
    """A specialization's launcher: its argument types, constants (constexprs, ints equal to 1, None) as one."""
    name, rest = key.split("(", 1)
    types = []
    for part in re.split(r",(?=\w+=)", rest.rsplit(")", 1)[0]):
        value = part.split("=", 1)[1]
        types.append(value.split(":")[0] if value.startswith(("*", "i32", "i64")) or value in ("fp32", "i1")
                     else "const")
    return f"{name}({','.join(types)})"


def pytest_configure(config) -> None:
    from triton.runtime import interpreter
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("triton_specializations counts launches under Triton's interpreter: set "
                           "TRITON_INTERPRET=1")
    run = interpreter.InterpretedFunction.run

    def counted(self, *args, grid, warmup, **kwargs):
        key = specialization(self.fn, self.arg_names, args, kwargs)
        _keys.setdefault(_current["test"] or "(outside a test)", []).append(key)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)
    interpreter.InterpretedFunction.run = counted


def pytest_runtest_logstart(nodeid, location) -> None:
    _current["test"] = nodeid


def pytest_terminal_summary(terminalreporter) -> None:
    keys = {k for launches in _keys.values() for k in launches}
    per_kernel: dict[str, int] = {}
    for key in keys:
        per_kernel[key.split("(")[0]] = per_kernel.get(key.split("(")[0], 0) + 1
    terminalreporter.write_line(
        f"triton_specializations: {sum(map(len, _keys.values()))} launches in {len(_keys)} tests, "
        f"{len(keys)} specializations ({', '.join(f'{k} {n}' for k, n in sorted(per_kernel.items()))}), "
        f"{len({launcher(k) for k in keys})} launchers")
    if os.environ.get("TRITON_SPECIALIZATIONS_JSON"):
        with open(os.environ["TRITON_SPECIALIZATIONS_JSON"], "w") as f:
            json.dump(_keys, f, indent=1)
