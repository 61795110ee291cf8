"""Every config field, walked: each gets values its own rule refuses, through the real command line.

The fields come from the dataclass tree (config.Config), and the bad values from each field's
annotation (a value of a type it refuses) and its declared rule (just outside an Interval's ends, NaN,
infinity; a word that is not a choice). Each must stop `lowmem-grpo train` with one line naming the
setting, exit code 2 and no traceback, while the config is being made: the Trainer (which loads the
model) is replaced by a tripwire. The few rules written as code in validate() get one value each below.
"""

import dataclasses
import json
import math
import typing

import pytest

import lowmem_grpo.training.trainer as trainer_module
from lowmem_grpo.cli import main
from lowmem_grpo.config import Config, section_classes
from lowmem_grpo.ranges import Interval

from .conftest import TINY_LLAMA

# Values each annotation refuses: a bool takes only true/false (and refuses a list, which a true/false/auto
# field refuses too), a number only a number, text refuses a boolean and a list, a list takes a list, one
# name or one mapping, a mapping only a mapping.
REFUSED_BY_TYPE = {bool: ["maybe", 5, [1]], int: ["many", True], float: ["lots", True], str: [True, [1]],
                   list: [True, 5], dict: [[1], "text"]}

# Rules written as code in validate() rather than declared on the field: one refused value each.
CODED_RULES = {"output.report_to": "mlflow", "train.device": "gpu", "rewards.reward_weights": ["heavy"],
               "model.config": {"vocab_size": 8}}


def _types(tp) -> list[type]:
    """The types an annotation admits, None aside: Optional[Union[str, list]] -> [str, list]."""
    if typing.get_origin(tp) is typing.Union:
        return [t for arg in typing.get_args(tp) if arg is not type(None) for t in _types(arg)]
    return [typing.get_origin(tp) or tp]


def _fields():
    for section, cls in section_classes().items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            yield f"{section}.{f.name}", hints[f.name], f.metadata.get("check")


def _wrong_type(tp):
    refused = [REFUSED_BY_TYPE[t] for t in _types(tp)]
    return next(v for v in refused[0] if all(v in r for r in refused))


def _outside(rule: Interval, tp) -> list:
    """Values just outside the interval (derived from its ends), then NaN and infinity for float fields."""
    out = []
    if rule.low is not None:
        out.append(rule.low if rule.low_open else rule.low - 1)
    if rule.high is not None:
        out.append(rule.high if rule.high_open else rule.high + 1)
    if float in _types(tp):
        out.append(math.nan)
        if rule.finite:
            out.append(math.inf)
    else:
        out = [int(v) for v in out]
    return out


def _cases():
    """(key, bad value, why it is bad) for every field and every rule."""
    for key, tp, rule in _fields():
        yield key, _wrong_type(tp), "type"
        if isinstance(rule, Interval):
            for value in _outside(rule, tp):
                yield key, value, f"range {rule}"
        elif isinstance(rule, tuple):
            yield key, "no_such_" + str(rule[0]).lower(), "choice"
        if key in CODED_RULES:
            yield key, CODED_RULES[key], "coded"


CASES = list(_cases())


def _yaml(value) -> str:
    """The value as the command line writes it (YAML 1.2: .nan and .inf for the special floats)."""
    if isinstance(value, float) and not math.isfinite(value):
        return ".nan" if math.isnan(value) else ".inf"
    return json.dumps(value)


class ModelWouldLoad(AssertionError):
    pass


@pytest.fixture
def recipe(tmp_path, monkeypatch):
    """A valid recipe (checked by test_the_recipe_itself_passes), and no Trainer: reaching it fails."""
    def tripwire(*args, **kwargs):
        raise ModelWouldLoad("the config was accepted and the trainer (which loads the model) was reached")
    monkeypatch.setattr(trainer_module, "Trainer", tripwire)
    path = tmp_path / "r.yaml"
    path.write_text(f"model: {{config: {json.dumps(TINY_LLAMA)}, tokenizer: none}}\n"
                    f"data: {{train_file: {tmp_path / 'train.jsonl'}}}\n"
                    "generation: {num_generations: 4, max_prompt_length: 8, max_completion_length: 6}\n"
                    "train: {per_device_train_batch_size: 4}\n"
                    "rewards: {reward_funcs: [numeric_answer]}\n")
    return str(path)


def test_the_recipe_itself_passes(recipe):
    with pytest.raises(ModelWouldLoad):
        main(["train", recipe])


def test_the_walk_covers_every_field():
    fields = list(_fields())
    keys = {key for key, _, _ in fields}
    assert len(fields) == sum(len(dataclasses.fields(cls)) for cls in section_classes().values()) >= 75
    assert {key for key, _, why in CASES if why == "type"} == keys  # every field gets a wrong type
    ruled = {key for key, _, why in CASES if why != "type"}
    assert len(ruled) >= 50, sorted(keys - ruled)
    assert set(CODED_RULES) <= keys
    # every number has a declared range: a new numeric setting without one fails here
    numeric = {key for key, tp, _ in fields if set(_types(tp)) & {int, float}}
    unranged = sorted(key for key, _, rule in fields if key in numeric and not isinstance(rule, Interval))
    assert not unranged, (f"numeric settings without a range (lowmem_grpo/config/schema.py: "
                          f"setting(..., check=Interval(...))): {unranged}")


@pytest.mark.parametrize("key, value, why", CASES, ids=[f"{k}={_yaml(v)}" for k, v, _ in CASES])
def test_a_refused_value_stops_at_config_time_in_one_line(recipe, capsys, key, value, why):
    assert main(["train", recipe, f"{key}={_yaml(value)}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lowmem-grpo: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and key.split(".")[1] in err, err
