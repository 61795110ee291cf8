"""How a Config gets its values: defaults <- recipe (YAML) <- command-line overrides, then validation.

- `load_config(recipe, overrides)` is the whole path; `apply_mapping` applies a recipe's nested
  {section: {key: value}} mapping (bare top-level keys allowed), `apply_overrides` the command line's
  `section.key=value` / `key=value` items (values read as YAML).
- `resolve_key(name)` turns 'section.key' or a bare 'key' into (section, key); an unknown name is a
  ConfigError naming the nearest valid key.
- `set_value(cfg, section, key, value)` checks `value` against the field's annotation (int -> float,
  None for Optional, 'none' as a word only in text fields) and sets it; a wrong type is a ConfigError
  that names the key and, for YAML 1.1 habits (yes/no, 1_000, a quoted number), the fix.

Design notes: docs/config.md
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any, Optional, Union

import yaml

from .errors import ConfigError, did_you_mean
from .schema import Config, key_index, section_classes
from .trl_names import TRL_NAMES, TRL_VALUES, order, trl_settings
from .validation import check_field_rules, validate
from .yaml_loader import parse_yaml, plain_values, yaml_problem


def resolve_key(name: str, where: str = "") -> tuple[str, str]:
    """'section.key' or a bare 'key' -> (section, key), or ConfigError naming the nearest key."""
    index = key_index()
    if "." in name:
        section, key = name.split(".", 1)
        if section not in section_classes():
            raise _unknown(name, where)
        if index.get(key) != section:
            raise _unknown(name, where)
        return section, key
    if name not in index:
        raise _unknown(name, where)
    return index[name], name


def _unknown(name: str, where: str) -> ConfigError:
    """The error for a key that does not exist, suggesting the closest real one."""
    index = key_index()
    key = name.rsplit(".", 1)[-1]
    # the key part matters most; TRL's names are candidates too (save_stratgy is save_strategy, not strategy)
    match = difflib.get_close_matches(key, list(index) + list(TRL_NAMES), n=1, cutoff=0.5)
    if match and match[0] not in index:
        hint = f"; did you mean {match[0]!r} (TRL's name)?"
    elif match:
        hint = f"; did you mean {f'{index[match[0]]}.{match[0]}' if '.' in name else match[0]!r}?"
    else:
        hint = did_you_mean(name, [f"{s}.{k}" for k, s in index.items()] + list(section_classes()))
    return ConfigError(f"unknown config key {name!r}{where}{hint}")


def set_named(cfg: Config, name: str, value: Any, where: str = "") -> None:
    """Set a setting by name: 'section.key', a bare key, or a TRL / transformers name (trl_names.py), which
    sets what it stands for here or raises a ConfigError saying what to use instead."""
    key = name.rsplit(".", 1)[-1]
    if key in TRL_NAMES and key not in key_index():
        for k, v in trl_settings(key, value, cfg).items():
            try:
                set_value(cfg, key_index()[k], k, v)
            except ConfigError as e:
                raise ConfigError(f"{key} (TRL's name; here {k}): {e}") from None
        return
    section, key = resolve_key(name, where)
    settings = trl_settings(key, value, cfg) if key in TRL_VALUES else {key: value}
    for k, v in settings.items():
        set_value(cfg, key_index()[k], k, v)


def set_value(cfg: Config, section: str, key: str, value: Any) -> None:
    """Set `cfg.<section>.<key>` to `value`, checked and coerced to the field's annotation (ConfigError if it
    does not fit): the one way a recipe, an override and the Python API's GRPOConfig set a value."""
    sub = getattr(cfg, section)
    hints = typing.get_type_hints(type(sub))
    # 'none' is the word in a text field (report_to=none, tokenizer=none); elsewhere it can only mean None.
    if isinstance(value, str) and value.lower() == "none" and not _takes_text(hints[key]):
        value = None
    if value is None and hints[key] is str and _defaults(section)[key] == "":
        value = ""  # null (or an empty override, key=) clears a text field that is empty when unset
    setattr(sub, key, _coerce(value, hints[key], f"{section}.{key}"))


def _defaults(section: str) -> dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(section_classes()[section])}


def _takes_text(tp: Any) -> bool:
    """Whether a field of annotation `tp` holds strings (where 'none' is a word, e.g. tokenizer=none)."""
    return tp is str or str in typing.get_args(tp)


def _coerce(value: Any, tp: Any, name: str) -> Any:
    """Check `value` against the annotation `tp` (allowing int -> float and None for Optional)."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, name)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{name}: bad value {value!r}")
    if tp is Any:
        return plain_values(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("yes", "no", "on", "off", "y", "n"):
            raise ConfigError(f"{name} must be true or false, got {value!r}: recipes are read as YAML 1.2, "
                              f"where only true/false are booleans")
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-5 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return int(value)
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str) and re.fullmatch(r"[-+]?[0-9][0-9_:]*", value.strip()):
            if "_" in value or ":" in value:
                raise ConfigError(f"{name} must be an integer, got the text {value!r}: write the number without "
                                  f"'_' or ':' (recipes are read as YAML 1.2, where 1_000 and 1:30 are text)")
            raise ConfigError(f"{name} must be an integer, got the text {value!r}: give it as a number, not a "
                              "quoted string")
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return getattr(value, "text", str(value))  # exactly as written: 010 stays "010"
        if isinstance(value, bool):
            raise ConfigError(f"{name} must be text, got the boolean {value}: quote it ({name.split('.')[-1]}: "
                              f"\"{str(value).lower()}\") if you mean the word")
        if isinstance(value, dict):  # `system_prompt=Be brief: one word` reads as {'Be brief': 'one word'}
            raise ConfigError(f"{name} must be text, got the mapping {plain_values(value)!r} (YAML reads 'key: value' "
                              f"as one): quote the text, e.g. '{name.split('.')[-1]}=\"...\"' on the command line")
    elif (origin or tp) is list:
        if isinstance(value, list):
            return plain_values(value)
        if isinstance(value, (str, dict)):  # one reward function given without a list
            return [plain_values(value)]
    elif (origin or tp) is dict:
        if isinstance(value, dict):
            return plain_values(value)
    else:
        return plain_values(value)
    tname = getattr(tp, "__name__", str(tp))
    raise ConfigError(f"{name} must be {tname}, got {value!r} ({type(value).__name__})")


def apply_mapping(cfg: Config, data: dict, where: str = "") -> Config:
    """Apply a nested {section: {key: value}} mapping (the YAML recipe form); bare top-level keys allowed."""
    if not isinstance(data, dict):
        raise ConfigError(f"a recipe must be a mapping of sections{where}, got {type(data).__name__}")
    items = []  # (name, value), in the order trl_names.order() gives their keys
    for top, value in data.items():
        if top in section_classes() and not (top in TRL_NAMES and not isinstance(value, dict)):  # TRL's optim=
            if not isinstance(value, dict):
                raise ConfigError(f"section {top!r}{where} must be a mapping, got {value!r}")
            items += [(f"{top}.{key}", v) for key, v in value.items()]
        else:
            items.append((str(top), value))
    ranked = order([name.rsplit(".", 1)[-1] for name, _ in items])
    for name, value in sorted(items, key=lambda item: ranked.index(item[0].rsplit(".", 1)[-1])):
        set_named(cfg, name, value, where)
    return cfg


def apply_overrides(cfg: Config, overrides: list[str]) -> Config:
    """Apply command-line `section.key=value` / `key=value` overrides; values are parsed as YAML."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value (e.g. train.max_steps=10 or learning_rate=1e-5)")
        name, raw = item.split("=", 1)
        if name.strip() not in TRL_NAMES:
            resolve_key(name.strip(), " on the command line")  # an unknown name before its value's YAML
        try:
            value = parse_yaml(raw) if raw.strip() else None
        except yaml.YAMLError as e:
            quote = f"; if it is text, quote it: '{name}=\"{raw}\"'" if '"' not in raw and "'" not in raw else ""
            raise ConfigError(f"the value of {name} on the command line is not valid YAML: {raw!r}, "
                              f"{yaml_problem(e)}{quote}") from None
        set_named(cfg, name.strip(), value, " on the command line")
    return cfg


def load_config(recipe: Optional[str | Path] = None, overrides: Optional[list[str]] = None,
                check: bool = True) -> Config:
    """Defaults <- recipe YAML <- command-line overrides, then validated (`check=False`: keys, types and
    each field's own rule only, for the memory planner, which needs no model source or reward functions)."""
    cfg = Config()
    if recipe is not None:
        path = Path(recipe)
        if not path.is_file():
            raise ConfigError(f"recipe {str(path)!r} not found")
        try:
            data = parse_yaml(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"recipe {str(path)!r} is not valid YAML: {yaml_problem(e)}; fix it there") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"recipe {str(path)!r} cannot be read: {e}") from None
        apply_mapping(cfg, data, f" in {path}")
    apply_overrides(cfg, list(overrides or []))
    if check:
        validate(cfg)
    else:
        check_field_rules(cfg)
    return cfg
