"""The settings: every default in one typed dataclass tree, read from a recipe and the command line.

A recipe (YAML 1.2) overrides the defaults section by section; the command line overrides the recipe
with `section.key=value` or a bare `key=value` (every key name is unique across sections). Unknown
keys, wrong types and values outside a field's rule are a ConfigError that names the fix.

    schema.py       the dataclass tree (Config and its sections), `setting`, `key_index`, `describe`
    loading.py      load_config: recipe + overrides -> Config; `resolve_key`, `set_value` (coercion)
    validation.py   each field's rule and the cross-field checks
    batching.py     BatchPlan: generation batch -> micro-batches -> optimizer steps
    yaml_loader.py  YAML 1.2 scalars; errors.py: ConfigError and the "did you mean" hint

Design notes: docs/config.md
"""

from .batching import BatchPlan, batch_plan
from .errors import ConfigError, did_you_mean
from .loading import apply_mapping, apply_overrides, load_config, resolve_key, set_value
from .schema import LR_SCHEDULES, Config, DataConfig, EvalConfig, GenerationConfig, ModelConfig, OptimConfig, \
    OutputConfig, RewardsConfig, TrainConfig, describe, key_index, section_classes, setting
from .validation import (DEVICE, REPORT_TARGETS, Given, check_field_rules, importance_sampling_correction,
                         report_targets, rollout_engine, rollout_sampler, validate)


__all__ = [
    "BatchPlan", "batch_plan", "ConfigError", "did_you_mean", "apply_mapping", "apply_overrides", "load_config",
    "resolve_key", "set_value", "LR_SCHEDULES", "Config", "DataConfig", "EvalConfig", "GenerationConfig",
    "ModelConfig", "OptimConfig", "OutputConfig", "RewardsConfig", "TrainConfig", "describe", "key_index",
    "section_classes", "setting", "DEVICE", "REPORT_TARGETS", "Given", "check_field_rules", "report_targets",
    "validate", "importance_sampling_correction", "rollout_engine", "rollout_sampler",
]
