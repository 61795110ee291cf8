"""GRPOConfig as a dataclass an editor reads (real fields, generated from config/schema.py and kept
current), assignment checked as a recipe's value, and GRPOTrainer's surface: TRL's names outside, the
training loop behind `loop`, and a config that holds no placeholder labels for what came as objects."""

import dataclasses
import inspect
import typing

import pytest

from lowmem_grpo import GRPOConfig, GRPOTrainer
from lowmem_grpo.config import Config, ConfigError, Given, key_index, section_classes, validate
from tests.test_api import tiny_char_model, tiny_llama, toy_args
from tests.training.conftest import label_reward, toy_rows


def test_every_key_is_a_dataclass_field_with_the_schemas_type_and_default():
    from lowmem_grpo.api.config_fields import GRPOConfigFields
    assert dataclasses.is_dataclass(GRPOConfig) and issubclass(GRPOConfig, GRPOConfigFields)
    fields = {f.name: f for f in dataclasses.fields(GRPOConfig)}
    assert list(fields) == list(key_index())
    defaults = Config()
    for section, cls in section_classes().items():
        for f in dataclasses.fields(cls):
            mine = fields[f.name]
            assert mine.type == f.type, f.name
            default = mine.default_factory() if mine.default is dataclasses.MISSING else mine.default
            assert default == getattr(getattr(defaults, section), f.name), f.name
    # written in source (what an editor reads and jumps to), not made at run time
    source = inspect.getsource(GRPOConfigFields)
    assert "    max_steps: int = 100\n" in source and "    learning_rate: float = 1e-06\n" in source
    assert "def __init__(\n            self,\n            *,\n            name_or_path: str = ''," in source
    # values are plain instance attributes
    args = GRPOConfig(max_steps=3)
    assert vars(args)["max_steps"] == 3 and vars(args)["learning_rate"] == 1e-6
    assert typing.get_type_hints(GRPOConfigFields)["reward_funcs"] is list


def test_the_generated_fields_file_is_current():
    """config_fields.py is what fields_source.render() writes from config/schema.py now: after a change
    to the schema or to TRL's renamed names, run `make api-fields` and commit the file."""
    from lowmem_grpo.api import fields_source
    assert fields_source.TARGET.read_text() == fields_source.render(), "run `make api-fields`"


def test_assignment_is_coerced_and_checked_as_a_recipes_value():
    args = GRPOConfig()
    args.learning_rate = "1e-5"  # YAML 1.1 habit: a float written as text
    assert args.learning_rate == 1e-5 and isinstance(args.learning_rate, float)
    args.num_train_epochs = 2
    args.max_steps = -1  # TRL's value: train num_train_epochs epochs
    assert (args.max_steps, args.num_train_epochs) == (100, 2.0)
    with pytest.raises(ConfigError, match="must be an integer, got the text '10': give it as a number"):
        args.max_steps = "10"
    with pytest.raises(ConfigError, match="did you mean 'max_steps'"):
        args.max_stesp = 10
    args.shuffle_dataset = False  # TRL's renamed name: a property over ours
    assert args.shuffle is False and args.shuffle_dataset is False
    args.optim = "adamw_torch"  # TRL's translated name
    assert args.optimizer == "adamw"
    args.save_strategy = "no"
    assert args.save_steps == 0
    with pytest.raises(AttributeError, match="keeps no 'save_strategy'"):
        args.save_strategy
    args.train.max_steps = 5  # a section's view writes through, checked the same way
    assert args.max_steps == 5 and args.train.max_steps == 5
    with pytest.raises(ConfigError, match="train.max_steps must be int, got 'five'"):
        args.train.max_steps = "five"
    with pytest.raises(AttributeError, match="did you mean 'max_steps'"):
        args.train.max_stesp


def test_validation_takes_what_is_given_as_objects():
    cfg = Config()
    with pytest.raises(ConfigError, match="set model.name_or_path"):
        validate(cfg)
    cfg.model.name_or_path = "m"
    with pytest.raises(ConfigError, match="reward_funcs is empty"):
        validate(cfg)
    validate(cfg, Given(reward_funcs=True))
    validate(Config(), Given(model=True, reward_funcs=True))
    cfg.eval.eval_steps = 2
    with pytest.raises(ConfigError, match="eval_steps=2 evaluates on held-out prompts"):
        validate(cfg, Given(reward_funcs=True))
    validate(cfg, Given(reward_funcs=True, eval_data=True))
    cfg.rewards.reward_funcs, cfg.rewards.reward_weights = ["numeric_answer"], [1.0, 2.0]
    with pytest.raises(ConfigError, match="reward_weights has 2 entries but there are 1"):
        validate(cfg, Given(reward_funcs=True, eval_data=True))


def test_no_placeholder_label_reaches_the_config(tmp_path):
    """A model object without a name, rows for train and eval data, functions for rewards: the config the
    run holds names none of them by a label (it used to say '(given to GRPOTrainer)', 'train_dataset')."""
    import sys

    from lowmem_grpo.policy.char_tokenizer import char_tokenizer
    model = tiny_char_model()
    assert not model.name_or_path
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                          processing_class=char_tokenizer(), train_dataset=[{"prompt": "1+1="}] * 4,
                          eval_dataset=[{"prompt": "2+2="}] * 2,
                          args=GRPOConfig(num_generations=2, per_device_train_batch_size=2, device="cpu",
                                          eval_steps=1, eval_holdout=1, output_dir=str(tmp_path / "run")))

    def strings(value):
        if isinstance(value, dict):
            return [s for v in value.values() for s in strings(v)]
        if isinstance(value, list):
            return [s for v in value for s in strings(v)]
        return [value] if isinstance(value, str) else []
    loop = getattr(trainer, "loop", trainer)  # (the trainer was the loop before it held one)
    recorded = strings(loop.cfg.to_dict())
    assert not [s for s in recorded if s in ("train_dataset", "eval_dataset") or "GRPOTrainer" in s], recorded
    cfg = loop.cfg
    assert cfg.model.name_or_path == "" and cfg.data.train_file == "" and cfg.data.eval_file is None
    assert len(loop.train_set) == 4 and len(loop.eval_set) == 2  # eval_dataset, not the holdout
    assert not [m for m in sys.modules if m.startswith("lowmem_grpo.api") and hasattr(sys.modules[m], "_PLACEHOLDER")]


def test_trainer_shows_trls_surface_and_keeps_the_loop_behind_one_attribute(tmp_path):
    rows = toy_rows(8)
    args = toy_args(output_dir=str(tmp_path / "r"), max_steps=1)
    model = tiny_llama()
    trainer = GRPOTrainer(model=model, reward_funcs=label_reward, args=args, train_dataset=rows,
                          eval_dataset=toy_rows(2, seed=3))
    public = {n for n in dir(trainer) if not n.startswith("_")}
    assert public == {"model", "processing_class", "args", "train_dataset", "eval_dataset", "reward_funcs",
                      "reward_processing_classes", "callbacks", "add_callback", "train", "evaluate", "save_model",
                      "loop"}
    from lowmem_grpo.training.trainer import Trainer
    assert isinstance(trainer.loop, Trainer)
    assert trainer.model is model is trainer.loop.policy and trainer.args is args and trainer.train_dataset is rows
    assert trainer.processing_class is None  # a token-id task
    assert [f.name for f in trainer.reward_funcs] == ["label_reward"]
    with pytest.warns(DeprecationWarning, match="GRPOTrainer.cfg is deprecated: .* use trainer.loop.cfg"):
        assert trainer.cfg is trainer.loop.cfg  # the attributes of the Trainer it used to be
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        trainer.nothing
    assert trainer.evaluate()["samples"] == 2
    seen = []
    trainer.add_callback(type("Seen", (), {"on_step_end": lambda self, t, step, m: seen.append(t.model is model)}))
    assert trainer.train()["step"] == 1 == trainer.loop.step
    assert seen == [True]  # a callback gets the loop, which keeps TRL's `model` as GRPOTrainer did
    assert (trainer.save_model(tmp_path / "saved") / "config.json").is_file()
