"""GRPOConfig: every lowmem-grpo setting by its bare name, as a dataclass an editor can read.

Its fields (api/config_fields.py, generated from config/schema.py) hold the values; every way in
(construction, from_recipe, from_config, attribute assignment) goes through the recipe's code:
`apply_mapping` / `set_named` coerce and check each value (TRL's names translate there), then
`validate` checks the whole, with the parts GRPOTrainer may still give as objects (`MAY_BE_GIVEN`)
not asked of the config. `to_config()` is the Config tree the trainer takes.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import os
import typing
from pathlib import Path
from typing import Any, Optional

from ..config import Config, Given, apply_mapping, describe, did_you_mean, key_index, load_config, section_classes, \
    validate
from ..config.loading import set_named
from ..config.trl_names import TRL_NAMES
from ..shipped_recipes import find_shipped
from .config_fields import GRPOConfigFields

# What GRPOTrainer(...) may supply after the config is made: the model, the reward functions, eval_dataset.
MAY_BE_GIVEN = Given(model=True, reward_funcs=True, eval_data=True)


class GRPOConfig(GRPOConfigFields):
    # The docstring is generated below from the config's own help (describe()).

    if not typing.TYPE_CHECKING:  # editors see GRPOConfigFields' typed keyword signature instead
        def __init__(self, **settings: Any) -> None:
            cfg = Config()
            apply_mapping(cfg, settings, " in GRPOConfig()")
            self._take(cfg, None)

    @classmethod
    def from_recipe(cls, recipe: str | os.PathLike, **overrides) -> "GRPOConfig":
        """A recipe YAML (a path, or the name of a shipped recipe: `lowmem-grpo recipes` lists them), then
        `overrides` by bare key name. Relative data and reward-file paths resolve beside the recipe."""
        path = Path(recipe)
        if not path.is_file() and find_shipped(str(recipe)) is not None:
            path = find_shipped(str(recipe))
        cfg = load_config(path, check=False)
        apply_mapping(cfg, overrides, " in GRPOConfig.from_recipe()")
        return cls._wrap(cfg, path.resolve().parent)

    @classmethod
    def from_config(cls, cfg: Config) -> "GRPOConfig":
        """The settings of a Config tree (copied)."""
        return cls._wrap(copy.deepcopy(cfg), None)

    @classmethod
    def _wrap(cls, cfg: Config, recipe_dir: Optional[Path]) -> "GRPOConfig":
        self = cls.__new__(cls)
        self._take(cfg, recipe_dir)
        return self

    def _take(self, cfg: Config, recipe_dir: Optional[Path]) -> None:
        """Check `cfg` as far as a config alone can be (MAY_BE_GIVEN), then hold its values as the fields."""
        validate(cfg, MAY_BE_GIVEN)
        self._store(cfg)
        object.__setattr__(self, "_recipe_dir", recipe_dir)

    def _store(self, cfg: Config) -> None:
        for key, section in key_index().items():
            object.__setattr__(self, key, getattr(getattr(cfg, section), key))

    @property
    def recipe_dir(self) -> Optional[Path]:
        """The folder of the recipe this config came from (relative paths resolve there), or None."""
        return self._recipe_dir

    def to_config(self) -> Config:
        """A copy of the settings as the Config tree the trainer takes."""
        cfg = Config()
        for key, section in key_index().items():
            setattr(getattr(cfg, section), key, copy.deepcopy(getattr(self, key)))
        return cfg

    def to_dict(self) -> dict:
        """Every setting by bare key name."""
        return {key: getattr(self, key) for key in key_index()}

    def __setattr__(self, name: str, value) -> None:
        """A key, 'section.key' or a TRL name (config/trl_names.py), coerced and checked as a recipe's value."""
        if name == "_recipe_dir":  # copy and pickle restore it
            object.__setattr__(self, name, value)
            return
        cfg = self.to_config()
        set_named(cfg, name, value, " in GRPOConfig")
        self._store(cfg)

    def __getattr__(self, name: str):
        # Only for what is not a field or property: a section (args.train.max_steps), or an error.
        if name.startswith("_"):  # copy/pickle probe these before the fields exist
            raise AttributeError(name)
        if name in section_classes():
            return _Section(self, name)
        if name in TRL_NAMES:
            raise AttributeError(f"GRPOConfig keeps no {name!r}: TRL's {name} is {TRL_NAMES[name].note}")
        raise AttributeError(f"GRPOConfig has no setting {name!r}{did_you_mean(name, list(key_index()))}")

    def __eq__(self, other) -> bool:
        return isinstance(other, GRPOConfig) and self.to_dict() == other.to_dict()

    __hash__ = None  # mutable, compared by value

    def __repr__(self) -> str:
        defaults = GRPOConfig._defaults()
        changed = {k: v for k, v in self.to_dict().items() if v != defaults[k]}
        return f"GRPOConfig({', '.join(f'{k}={v!r}' for k, v in changed.items())})"

    @staticmethod
    def _defaults() -> dict:
        cfg = Config()
        return {key: getattr(getattr(cfg, section), key) for key, section in key_index().items()}


class _Section:
    """`args.<section>`: that section's keys of a GRPOConfig, read and set through it."""

    def __init__(self, owner: GRPOConfig, section: str):
        object.__setattr__(self, "_owner", owner)
        object.__setattr__(self, "_keys", [f.name for f in dataclasses.fields(section_classes()[section])])
        object.__setattr__(self, "_name", section)

    def __getattr__(self, key: str):
        if key not in self._keys:
            raise AttributeError(f"section {self._name!r} has no setting {key!r}{did_you_mean(key, self._keys)}")
        return getattr(self._owner, key)

    def __setattr__(self, key: str, value) -> None:
        setattr(self._owner, f"{self._name}.{key}", value)

    def __repr__(self) -> str:
        return f"{self._name}({', '.join(f'{k}={getattr(self._owner, k)!r}' for k in self._keys)})"


def _signature() -> inspect.Signature:
    """GRPOConfig's keyword arguments, for help(), tab completion and inspect."""
    defaults = Config()
    params = []
    for section, cls in section_classes().items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY,
                                            default=getattr(getattr(defaults, section), f.name),
                                            annotation=hints[f.name]))
    return inspect.Signature(params)


GRPOConfig.__doc__ = (
    "Every lowmem-grpo setting by its bare name (the keys of a recipe, unique across its sections), e.g.\n"
    "GRPOConfig(output_dir='runs/x', learning_rate=1e-6, max_steps=100, num_generations=8).\n\n"
    "A dataclass: each key is a field (api/config_fields.py) with its type and default. Values are coerced\n"
    "and checked exactly as a recipe's are, when the config is made and when a field is assigned\n"
    "(args.max_steps = 10); an unknown name is an error naming the nearest key. to_config() gives the Config\n"
    "tree; GRPOConfig.from_recipe(path_or_name, **overrides) starts from a recipe.\n\n"
    "Settings, by section (name = default, then what it does):\n\n" + describe())
GRPOConfig.__signature__ = _signature()
