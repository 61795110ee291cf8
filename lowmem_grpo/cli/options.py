"""TRL-style config options on the command line: `--key value`, `--key=value`, `--section.key value`.

They become the `key=value` overrides the rest of the CLI takes, so both spellings go through the same
parsing (values are YAML) and the same errors. A command's own options (`--steps`, `--json`, ...) are
left alone. A boolean key given without a value is true (`--bf16`); `--bf16 false` sets it false.
Dashes in names read as underscores (`--learning-rate`), and TRL's `--model_name_or_path` is
`name_or_path`.
"""

from __future__ import annotations

import typing
from typing import Optional

from ..config import ConfigError, resolve_key, section_classes

ALIASES = {"model_name_or_path": "name_or_path"}  # TRL's ModelConfig name for the same setting


def _is_bool(section: str, key: str) -> bool:
    tp = typing.get_type_hints(section_classes()[section])[key]
    return tp is bool or tp == Optional[bool]


def key_options_to_overrides(args: list[str], own_options: set[str], extra_keys: frozenset = frozenset()) -> list[str]:
    """Rewrite `--key value` / `--key=value` in `args` (a command's arguments) as `key=value`.

    `own_options`: the command's own option strings, passed through with their values. `extra_keys`:
    names that are not config keys but that the command takes as `name=value` (eval's `model=PATH`)."""
    out, i = [], 0
    while i < len(args):
        arg = args[i]
        i += 1
        if arg == "--":  # everything after it is positional
            out += args[i - 1:]
            break
        if not arg.startswith("--") or arg.split("=", 1)[0] in own_options:
            out.append(arg)
            continue
        name, has_value, value = arg[2:].partition("=")
        name = name.replace("-", "_")
        name = ALIASES.get(name, name)
        if name in extra_keys:
            is_bool = False
        else:
            section, key = resolve_key(name, f" (from {arg.split('=', 1)[0]})")  # unknown: names the nearest key
            is_bool = _is_bool(section, key)
        if not has_value:
            following = args[i] if i < len(args) else None
            if is_bool:
                value = "true"
                if following is not None and following.lower() in ("true", "false"):
                    value, i = following, i + 1
            elif following is None or following.startswith("--"):
                raise ConfigError(f"--{name} needs a value: --{name} VALUE, --{name}=VALUE or {name}=VALUE")
            else:
                value, i = following, i + 1
        out.append(f"{name}={value}")
    return out
