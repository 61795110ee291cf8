"""What a TRL user types into GRPOConfig: every field of TRL 1.16's GRPOConfig (with transformers'
TrainingArguments under it), walked from the installed TRL. Each is accepted (mapped onto lowmem-grpo's
settings with TRL's meaning) or refused with one line naming it and what to use instead: never a
"did you mean" for an unrelated key, never a TypeError."""

import dataclasses
import importlib.util

import pytest

from lowmem_grpo import GRPOConfig
from lowmem_grpo.config import ConfigError, key_index
from lowmem_grpo.config.trl_names import TRL_NAMES, TRL_VALUES

pytestmark = pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="needs trl (pip install '.[bench]')")


def _trl_fields() -> dict:
    """TRL's GRPOConfig fields -> their defaults, as a user who copies them types them."""
    from trl import GRPOConfig as TrlConfig
    out = {}
    for f in dataclasses.fields(TrlConfig):
        if not f.init:
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        out[f.name] = default
    return out


def _other(value):
    """A value other than TRL's default, of the same kind."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1 if value != -1 else 7
    if isinstance(value, str):
        return "something_else"
    return None


def _check_answer(name, value):
    """GRPOConfig(name=value) is accepted, or refused with a ConfigError that names `name` and no other key."""
    try:
        GRPOConfig(**{name: value})
    except ConfigError as e:
        msg = str(e)
        assert name in msg, msg
        assert "did you mean" not in msg, msg
        assert "\n" not in msg, msg
        return msg
    return None


def test_every_trl_field_is_known_here():
    """Each TRL field is one of our keys or has an entry in the table: none falls through to 'unknown key'."""
    unknown = [n for n in _trl_fields() if n not in key_index() and n not in TRL_NAMES]
    assert not unknown, unknown
    stale = [n for n in TRL_NAMES if n in key_index()]
    assert not stale, f"TRL names that are our keys now: {stale}"


@pytest.mark.parametrize("name", sorted(_trl_fields()) if importlib.util.find_spec("trl") else [])
def test_each_trl_field_at_its_default_and_another_value(name):
    default = _trl_fields()[name]
    refused = _check_answer(name, default)
    if name in TRL_NAMES and TRL_NAMES[name].kind == "default_only":
        assert refused is None, f"TRL's default of {name} ({default!r}) is refused: {refused}"
    other = _other(default)
    if other is not None:
        refused = _check_answer(name, other)
        if refused and name in TRL_NAMES:
            assert "instead" in refused or "must be" in refused, refused


def test_all_of_trls_defaults_together_are_accepted():
    """A TRL user's GRPOConfig with every field at TRL's default: accepted, with TRL's meaning."""
    args = GRPOConfig(**_trl_fields())
    assert args.max_steps == 100 and args.num_train_epochs == 3.0  # TRL: max_steps=-1 trains 3 epochs
    assert args.optimizer == "adamw" and args.output_dir == "trainer_output"  # adamw_torch_fused; None
    assert args.eval_steps is None and args.save_steps == 500 and args.save_total_limit > 10**9  # None: keep all
    assert args.num_completions_to_log == 0  # log_completions=False


def test_what_a_trl_user_types_first():
    args = GRPOConfig(eval_steps=1)  # eval_dataset= comes with the trainer
    assert args.eval_steps == 1
    args = GRPOConfig(num_train_epochs=2, save_strategy="steps", eval_strategy="steps", logging_steps=5,
                      per_device_eval_batch_size=4, log_completions=True, optim="adamw_torch",
                      model_init_kwargs={"dtype": "auto", "attn_implementation": "eager"})
    assert (args.num_train_epochs, args.max_steps, args.eval_steps) == (2.0, 100, 5)  # eval_steps <- logging_steps
    assert args.per_device_eval_batch_size == args.eval_batch_size == 4
    assert args.optimizer == "adamw" and args.attn_implementation == "eager"
    assert GRPOConfig(num_train_epochs=2, max_steps=7).num_train_epochs is None  # max_steps > 0 overrides
    assert GRPOConfig(optim="adamw_bnb_8bit").optimizer == "adamw_8bit"
    assert GRPOConfig(save_strategy="no").save_steps == 0
    assert GRPOConfig(eval_strategy="no", eval_steps=3).eval_steps is None
    assert GRPOConfig(resume_from_checkpoint=True).resume_from == "latest"
    assert GRPOConfig(warmup_steps=0.1, lr_scheduler_type="linear").warmup_ratio == 0.1


@pytest.mark.parametrize("name, value, says", [
    ("save_strategy", "epoch", "save_steps"), ("eval_strategy", "epoch", "eval_steps"), ("optim", "sgd", "adamw_8bit"),
    ("push_to_hub", True, "save_model"), ("model_init_kwargs", {"device_map": "auto"}, "attn_implementation"),
    ("model_init_kwargs", {"dtype": "bfloat16"}, "bf16_sr"), ("fp16", True, "bf16"),
])
def test_refused_with_what_to_use(name, value, says):
    with pytest.raises(ConfigError) as err:
        GRPOConfig(**{name: value})
    msg = str(err.value)
    assert name in msg and says in msg and "instead" in msg and "did you mean" not in msg, msg


def test_a_misspelt_trl_name_is_pointed_at_the_trl_name():
    with pytest.raises(ConfigError, match="did you mean 'save_strategy'"):
        GRPOConfig(save_stratgy="no")


def test_table_entries_are_trls():
    fields = _trl_fields()
    assert not [n for n in TRL_NAMES if n not in fields], "entries for names TRL 1.16 does not have"
    assert all(n in fields for n in TRL_VALUES)
