"""The YAML reader for recipes and command-line values: YAML 1.2 scalars, one-line error messages.

- `parse_yaml(text)` reads YAML 1.2 (core schema) scalars with PyYAML: only true/false are booleans,
  010 is ten, 1_000 and 1:30 stay text, `1e-5` is a float. Its ints and floats remember the text they
  were written as, so a text setting given 010 or 3.10 gets exactly what was written.
- `plain_values(value)` turns those numbers back into plain int and float, through lists and dicts.
- `yaml_problem(error)` is PyYAML's several-line error as one line with line and column.

Design notes: docs/config.md
"""

from __future__ import annotations

import re
from typing import Any

import yaml


class _Loader(yaml.SafeLoader):
    """YAML 1.2 (core schema) scalars instead of PyYAML's YAML 1.1: only true/false are booleans (not
    yes/no/on/off), 010 is ten (not octal 8), and 1_000, 1:30 (base 60) and dates stay strings; `1e-5`
    (no dot) is a float. Numbers remember their text, so a string field given 010 or 3.10 gets exactly
    what was written."""


class _Int(int):
    text: str


class _Float(float):
    text: str


def _number(cls, text: str, value):
    out = cls(value)
    out.text = text
    return out


def _construct_int(loader, node):
    text = loader.construct_scalar(node)
    digits = text.lstrip("+-")
    sign = -1 if text.startswith("-") else 1
    if digits.startswith("0o"):
        return _number(_Int, text, sign * int(digits[2:], 8))
    if digits.startswith("0x"):
        return _number(_Int, text, sign * int(digits[2:], 16))
    return _number(_Int, text, int(text, 10))


def _construct_float(loader, node):
    text = loader.construct_scalar(node)
    special = {".inf": "inf", "+.inf": "inf", "-.inf": "-inf", ".nan": "nan"}
    return _number(_Float, text, float(special.get(text.lower(), text)))


_Loader.yaml_implicit_resolvers = {}  # replaces (does not extend) SafeLoader's YAML 1.1 resolvers
for _tag, _pattern, _first in (
        ("null", r"^(?:~|null|Null|NULL|)$", ["~", "n", "N", ""]),
        ("bool", r"^(?:true|True|TRUE|false|False|FALSE)$", list("tTfF")),
        ("int", r"^(?:[-+]?[0-9]+|[-+]?0o[0-7]+|[-+]?0x[0-9a-fA-F]+)$", list("-+0123456789")),
        ("float", r"""^(?:[-+]?(?:\.[0-9]+|[0-9]+\.[0-9]*)(?:[eE][-+]?[0-9]+)?|[-+]?[0-9]+[eE][-+]?[0-9]+
                     |[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$""", list("-+0123456789.")),
        ("merge", r"^(?:<<)$", ["<"])):
    _Loader.add_implicit_resolver(f"tag:yaml.org,2002:{_tag}", re.compile(_pattern, re.X), _first)
_Loader.add_constructor("tag:yaml.org,2002:int", _construct_int)
_Loader.add_constructor("tag:yaml.org,2002:float", _construct_float)


def plain_values(value: Any) -> Any:
    """Plain ints and floats again (the loader's text-remembering numbers stay inside the loader)."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, _Int):
        return int(value)
    if isinstance(value, _Float):
        return float(value)
    if isinstance(value, list):
        return [plain_values(v) for v in value]
    if isinstance(value, dict):
        return {plain_values(k): plain_values(v) for k, v in value.items()}
    return value


def parse_yaml(text: str):
    """A recipe's text, or one command-line value, as Python values (the text-remembering numbers)."""
    return yaml.load(text, Loader=_Loader)


def yaml_problem(e: yaml.YAMLError) -> str:
    """PyYAML's several-line error as one line: 'line L, column C: problem (while ... at line L, column C)'."""
    def at(mark) -> str:
        return f"line {mark.line + 1}, column {mark.column + 1}"
    if not isinstance(e, yaml.MarkedYAMLError) or not e.problem:
        return str(e).replace("\n", " ")
    where = f"{at(e.problem_mark)}: " if e.problem_mark else ""
    context = ""
    if e.context:
        context = f" ({e.context}" + (f" at {at(e.context_mark)}" if e.context_mark else "") + ")"
    return where + e.problem + context
