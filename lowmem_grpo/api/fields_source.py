"""Writes lowmem_grpo/api/config_fields.py, GRPOConfig's fields, from the config's section classes.

`render()` is the file's text: one dataclass field per bare key (config/schema.py's annotation and
default, in the sections' order), TRL's renamed names as read-only properties, and the typed keyword
signature editors show for GRPOConfig(...). `make api-fields` (python -m lowmem_grpo.api.fields_source)
rewrites the file; tests/test_api_config.py fails when it is out of date.
"""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

from ..config import Config, section_classes
from ..config.trl_names import TRL_NAMES

TARGET = Path(__file__).with_name("config_fields.py")

HEADER = '''"""GRPOConfig's settings as dataclass fields. GENERATED from config/schema.py by
`make api-fields` (python -m lowmem_grpo.api.fields_source): do not edit; tests/test_api_config.py
checks that it is current.

`GRPOConfigFields` has one field per bare config key with the section's annotation and default (help
texts: config/schema.py, `help(GRPOConfig)`), TRL's renamed names as read-only properties, and, for
editors and type checkers, GRPOConfig's keyword signature. lowmem_grpo/api/config.py adds the
coercion, the checks and the conversions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Union


@dataclass(init=False, repr=False, eq=False)
class GRPOConfigFields:
'''


def _fields() -> list[tuple[str, str, dataclasses.Field, object]]:
    """(section, key, field, default value) for every key, in Config's order."""
    defaults = Config()
    return [(section, f.name, f, getattr(getattr(defaults, section), f.name))
            for section, cls in section_classes().items() for f in dataclasses.fields(cls)]


def render() -> str:
    """The text of config_fields.py."""
    lines = [HEADER.rstrip("\n")]
    section = None
    for sec, key, f, default in _fields():
        if sec != section:
            lines.append(f"    # [{sec}]: config/schema.py, {section_classes()[sec].__name__}")
            section = sec
        value = "field(default_factory=list)" if isinstance(default, list) else repr(default)
        lines.append(f"    {key}: {f.type} = {value}")
    lines += ["", "    if TYPE_CHECKING:  # GRPOConfig(...) as editors see it; at run time it takes **settings",
              "        def __init__(", "            self,", "            *,"]
    lines += [f"            {key}: {f.type} = {default!r}," for _, key, f, default in _fields()]
    lines += ["            **trl_names: Any,", "        ) -> None: ..."]
    hints = {key: f.type for _, key, f, _ in _fields()}
    for name, trl in TRL_NAMES.items():
        if trl.kind != "renamed":
            continue
        lines += ["", "    @property", f"    def {name}(self) -> {hints[trl.key]}:",
                  f'        """TRL\'s name for {trl.key} (setting it sets {trl.key})."""',
                  f"        return self.{trl.key}"]
    text = "\n".join(lines) + "\n"
    for line in text.splitlines():
        if len(line) > 120:
            raise ValueError(f"config_fields.py would have a line over 120 characters: {textwrap.shorten(line, 80)}")
    return text


def write() -> Path:
    """Rewrite config_fields.py; returns its path."""
    TARGET.write_text(render())
    return TARGET


if __name__ == "__main__":
    write()
