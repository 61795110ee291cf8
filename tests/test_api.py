"""The Python API (lowmem_grpo.api): GRPOConfig checks like the command line, GRPOTrainer runs the CLI's
Trainer (same weights after the same steps), Python objects work as inputs, callbacks fire, and the
README's notebook example runs."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from lowmem_grpo import GRPOConfig, GRPOTrainer, TrainerCallback
from lowmem_grpo.cli import main
from lowmem_grpo.config import ConfigError, key_index, load_config
from lowmem_grpo.training.data import DataError
from tests.optional import needs_datasets
from tests.training.conftest import TINY_LLAMA, label_reward, toy_rows, write_jsonl

ROOT = Path(__file__).resolve().parents[1]

# The toy token task's settings, as GRPOConfig keywords (and as a recipe for the CLI).
TOY = dict(config=TINY_LLAMA, tokenizer="none", num_generations=4, max_prompt_length=8, max_completion_length=6,
           per_device_train_batch_size=8, max_steps=2, learning_rate=1e-3, optimizer="adamw", progress_bar=False,
           save_steps=0, device="cpu")


def toy_args(**settings) -> GRPOConfig:
    """TOY's settings for a model given as an object (so without its `config`), with `settings` on top."""
    return GRPOConfig(**{**{k: v for k, v in TOY.items() if k != "config"}, **settings})


def tiny_llama(seed: int = 42):
    """The tiny Llama as a user would build it with transformers (what load_model makes from TOY's config)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    conf = dict(TINY_LLAMA)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(conf.pop("model_type"), **conf), dtype=torch.float32)


def _weights(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ----------------------------------------------------------------------------------------- GRPOConfig
def test_config_takes_every_key_by_name_and_coerces_like_a_recipe():
    args = GRPOConfig(learning_rate="1e-5", max_steps=3, output_dir="runs/x", beta=0, reward_funcs="numeric_answer")
    cli = load_config(None, ["learning_rate=1e-5", "max_steps=3", "output_dir=runs/x", "beta=0",
                             "reward_funcs=numeric_answer"], check=False)
    assert args.to_config() == cli
    assert args.learning_rate == 1e-5 and isinstance(args.beta, float) and args.reward_funcs == ["numeric_answer"]
    assert args.train.max_steps == 3  # sections are attributes too
    args.max_steps = 7
    assert args.to_config().train.max_steps == 7
    assert GRPOConfig(**{"train.max_steps": 4}).max_steps == 4
    assert set(args.to_dict()) == set(key_index())
    assert "max_steps=7" in repr(args) and "seed" not in repr(args)  # only what differs from the defaults
    import copy
    import pickle
    assert copy.deepcopy(args) == args == pickle.loads(pickle.dumps(args))


@pytest.mark.parametrize("key, value, cli_value", [
    ("learnig_rate", 1e-5, "1e-5"),       # unknown key: the nearest one is named
    ("max_steps", "ten", "ten"),          # wrong type
    ("loss_type", "ppo", "ppo"),          # not a choice
    ("num_generations", 1, "1"),          # cross-field validation
    ("warmup_ratio", 1.5, "1.5"),
])
def test_config_errors_are_the_command_lines(key, value, cli_value):
    with pytest.raises(ConfigError) as api:
        GRPOConfig(**{key: value})
    with pytest.raises(ConfigError) as cli:
        load_config(None, [f"{key}={cli_value}", "name_or_path=m", "reward_funcs=[numeric_answer]"])
    strip = lambda e: str(e.value).replace(" in GRPOConfig()", "").replace(" on the command line", "")
    assert strip(api) == strip(cli)
    if key == "learnig_rate":
        assert "did you mean 'learning_rate'" in str(api.value)


def test_config_attribute_errors_name_the_nearest_key():
    args = GRPOConfig()
    with pytest.raises(ConfigError, match="did you mean 'max_steps'"):
        args.max_stpes = 3
    with pytest.raises(AttributeError, match="did you mean 'max_steps'"):
        args.max_stpes
    with pytest.raises(ConfigError, match="must be an integer, got the text '3': give it as a number"):
        args.max_steps = "3"


def test_help_lists_every_key():
    import inspect
    doc = GRPOConfig.__doc__
    for key in key_index():
        assert re.search(rf"^  {key} = ", doc, re.M), key
    assert list(inspect.signature(GRPOConfig).parameters) == list(key_index())


def test_from_recipe_by_path_or_shipped_name(tmp_path):
    args = GRPOConfig.from_recipe("char_e", max_steps=5)
    assert args.max_steps == 5 and args.tokenizer == "chars" and args.recipe_dir == ROOT / "recipes"
    assert args.train_file == "data/char_e_train.jsonl"
    assert GRPOConfig.from_recipe(ROOT / "recipes" / "char_e.yaml").max_steps == 30
    with pytest.raises(ConfigError, match="did you mean 'max_steps'"):
        GRPOConfig.from_recipe("char_e", max_step=5)
    with pytest.raises(ConfigError, match="not found"):
        GRPOConfig.from_recipe(tmp_path / "nope.yaml")


# ---------------------------------------------------------------------------------- CLI == API
def test_cli_and_api_give_the_same_weights(tmp_path, monkeypatch):
    """The same settings through `lowmem-grpo train` (a recipe, a data file, 'module:function') and through
    GRPOTrainer (a loaded model object, a list of dicts, a Python callable): identical weights after 2 steps."""
    monkeypatch.chdir(tmp_path)
    rows = toy_rows(64)
    recipe = tmp_path / "toy.yaml"
    recipe.write_text(yaml.safe_dump({**TOY, "train_file": write_jsonl(tmp_path / "train.jsonl", rows),
                                      "reward_funcs": ["tests.training.conftest:label_reward"],
                                      "output_dir": str(tmp_path / "cli")}))
    monkeypatch.syspath_prepend(str(ROOT))  # the CLI imports tests.training.conftest by name
    assert main(["train", str(recipe)]) == 0
    from transformers import AutoModelForCausalLM
    cli_weights = _weights(AutoModelForCausalLM.from_pretrained(tmp_path / "cli" / "checkpoint-2"))

    model = tiny_llama()
    initial = _weights(model)
    args = toy_args(output_dir=str(tmp_path / "api"))
    trainer = GRPOTrainer(model=model, reward_funcs=[label_reward], args=args, train_dataset=rows)
    assert trainer.model is model
    trainer.train()
    api_weights = _weights(trainer.model)
    assert set(api_weights) == set(cli_weights)
    assert any(not torch.equal(api_weights[k], initial[k]) for k in initial), "training changed nothing"
    for k in cli_weights:
        assert torch.equal(api_weights[k], cli_weights[k]), k
    # the run's config records the reward function by its import name; data given as rows names no file
    recorded = json.loads((tmp_path / "api" / "config.json").read_text())
    assert recorded["rewards"]["reward_funcs"] == ["tests.training.conftest:label_reward"]
    assert recorded["data"]["train_file"] == ""


def test_reward_specs_are_recorded_as_json():
    from lowmem_grpo.rewards.loading import spec_record
    assert spec_record(label_reward) == "tests.training.conftest:label_reward"
    assert spec_record({"name": label_reward, "pattern": re.compile("a+"), "tag": "answer"}) == \
        {"name": "tests.training.conftest:label_reward", "pattern": "re.compile('a+')", "tag": "answer"}
    assert spec_record("numeric_answer") == "numeric_answer"
    assert spec_record("org/reward-model") == "org/reward-model"  # a hub id is a name, not a loaded model


def test_reward_model_as_folder_object_or_missing_folder(tmp_path, monkeypatch):
    """reward_funcs may name a reward model's folder (absolute, or relative to the current folder) or give
    the loaded model, as the CLI's recipes do; a folder that is not there is named in the error."""
    from transformers import AutoModelForSequenceClassification
    from lowmem_grpo.policy.char_tokenizer import char_tokenizer
    from lowmem_grpo.rewards import RewardError
    from lowmem_grpo.rewards.model import reward_models
    from tests.rewards.tiny_reward_models import random_reward_model
    folder, tok = random_reward_model(tmp_path / "rm")
    monkeypatch.chdir(tmp_path)

    def trainer(reward_funcs, classes):
        return GRPOTrainer(model=tiny_char_model(), reward_funcs=reward_funcs, processing_class=char_tokenizer(),
                           reward_processing_classes=classes, train_dataset=[{"prompt": "1+1="}] * 2,
                           args=GRPOConfig(num_generations=2, per_device_train_batch_size=2, device="cpu",
                                           output_dir=str(tmp_path / "run")))

    loaded = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=1)
    made = trainer([str(folder), "rm/model", loaded, "numeric_answer"], [str(tok), str(tok), str(tok), None])
    models = reward_models(made.reward_funcs)
    assert len(models) == 3 and models[2].model is loaded
    scores = [m(["1+1="], ["2"]) for m in models]
    assert scores[0] == scores[1] == pytest.approx(scores[2], abs=1e-6)
    assert made.loop.cfg.rewards.reward_funcs == [str(folder), "rm/model", str(folder), "numeric_answer"]
    for missing in (str(tmp_path / "no-such-model"), "rm/no/such-model"):
        with pytest.raises(RewardError, match=f"reward_funcs\\[0\\]: no reward model folder '{missing}'"):
            trainer([missing], None)


# ------------------------------------------------------------------------------------- inputs
@needs_datasets
def test_in_memory_inputs_of_every_kind(tmp_path):
    from datasets import Dataset
    rows = toy_rows(24)
    for r in rows:
        r["answer"] = str(r["label"])
    dict_spec = {"name": "token_answer", "open_id": 4, "close_id": 5, "label_column": "label"}
    trainer = GRPOTrainer(
        model=tiny_llama(), args=toy_args(output_dir=str(tmp_path / "r"), reward_weights=[1, 2, 0.5, 1]),
        reward_funcs=[label_reward, "numeric_answer", dict_spec, lambda completions, **kw: [0.0] * len(completions)],
        train_dataset=Dataset.from_list(rows), eval_dataset=toy_rows(5, seed=3))
    assert len(trainer.loop.train_set) == 24 and len(trainer.loop.eval_set) == 5
    assert [f.name for f in trainer.reward_funcs] == ["label_reward", "numeric_answer", "token_answer", "<lambda>"]
    assert [f.weight for f in trainer.reward_funcs] == [1.0, 2.0, 0.5, 1.0]
    assert trainer.loop.cfg.data.eval_file is None and trainer.args.eval_file is None  # rows given, not a file
    # a data file path works as on the command line
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    by_path = GRPOTrainer(model=tiny_llama(), reward_funcs=label_reward, train_dataset=path,
                          args=toy_args())
    assert by_path.loop.cfg.data.train_file == path
    assert by_path.loop.train_set.prompt_ids == trainer.loop.train_set.prompt_ids


def test_model_by_path_with_its_tokenizer(tmp_path):
    """A save_pretrained folder (model + tokenizer): the tokenizer is found by the model's name."""
    from lowmem_grpo.policy.char_tokenizer import char_tokenizer
    model = tiny_char_model()
    model.save_pretrained(tmp_path / "m")
    char_tokenizer().save_pretrained(tmp_path / "m")
    trainer = GRPOTrainer(model=str(tmp_path / "m"), reward_funcs="numeric_answer",
                          args=GRPOConfig(num_generations=2, per_device_train_batch_size=2, device="cpu"),
                          train_dataset=[{"prompt": "1+1=", "answer": "2"}])
    assert trainer.processing_class.decode(trainer.loop.train_set.prompt_ids[0]) == "1+1="
    assert trainer.loop.cfg.model.name_or_path == str(tmp_path / "m")
    # A model object without a name needs its tokenizer given
    with pytest.raises(ConfigError, match="processing_class"):
        GRPOTrainer(model=tiny_char_model(), reward_funcs="numeric_answer", train_dataset=[{"prompt": "x"}])


def tiny_char_model():
    from transformers import AutoConfig, AutoModelForCausalLM
    from lowmem_grpo.policy.char_tokenizer import CHARACTERS, SPECIAL_TOKENS
    conf = dict(TINY_LLAMA, vocab_size=len(SPECIAL_TOKENS) + len(CHARACTERS))
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(conf.pop("model_type"), **conf))


def test_bad_inputs_are_named(tmp_path):
    args = toy_args()
    with pytest.raises(DataError, match="train_dataset index 1 is a str"):
        GRPOTrainer(model=tiny_llama(), reward_funcs=label_reward, args=args, train_dataset=[toy_rows(1)[0], "x"])
    with pytest.raises(DataError, match="train_dataset has no 'prompt' column"):
        GRPOTrainer(model=tiny_llama(), reward_funcs=label_reward, args=args, train_dataset=[{"question": "x"}])
    with pytest.raises(DataError, match="train_dataset is a int"):
        GRPOTrainer(model=tiny_llama(), reward_funcs=label_reward, args=args, train_dataset=3)
    with pytest.raises(ConfigError, match="no training prompts"):
        GRPOTrainer(model=tiny_llama(), reward_funcs=label_reward, args=args)
    with pytest.raises(ConfigError, match="no model"):
        GRPOTrainer(reward_funcs=label_reward, args=args, train_dataset=toy_rows(4))
    with pytest.raises(ConfigError, match="reward_funcs is empty"):
        GRPOTrainer(model=tiny_llama(), args=args, train_dataset=toy_rows(4))
    with pytest.raises(TypeError, match="GRPOConfig"):
        GRPOTrainer(model=tiny_llama(), reward_funcs=label_reward, args={"max_steps": 2}, train_dataset=toy_rows(4))


# ---------------------------------------------------------------------------------- callbacks
class Recorder(TrainerCallback):
    def __init__(self):
        self.events = []

    def on_step_end(self, trainer, step, metrics):
        self.events.append(("step_end", step, "reward" in metrics))

    def on_log(self, trainer, step, metrics):
        self.events.append(("log", step, "reward" in metrics))

    def on_save(self, trainer, step, path):
        self.events.append(("save", step, Path(path, "config.json").is_file()))


def test_callbacks_fire_at_step_end_log_and_save(tmp_path):
    recorder, stopper = Recorder(), Recorder()
    stopper.on_step_end = lambda trainer, step, metrics: trainer.stop.request("enough") if step == 3 else None
    args = toy_args(output_dir=str(tmp_path / "r"), max_steps=5, logging_steps=2, save_steps=2)
    trainer = GRPOTrainer(model=tiny_llama(), reward_funcs=label_reward, args=args, train_dataset=toy_rows(16),
                          callbacks=[recorder])
    trainer.add_callback(stopper)
    result = trainer.train()
    assert result["stopped_by"] == "enough" and trainer.loop.step == 3
    assert recorder.events == [("step_end", 1, True), ("step_end", 2, True), ("log", 2, True), ("save", 2, True),
                               ("step_end", 3, True), ("save", 3, True)]
    with pytest.raises(TypeError, match="not a callback"):
        trainer.add_callback(object())


# ----------------------------------------------------------------------------------- the README
def test_readme_notebook_example_runs(tmp_path, monkeypatch):
    """README's "Python API (notebooks)" example, verbatim except for the model (a tiny random one saved
    locally with the character tokenizer: no download) and max_steps (2)."""
    from transformers import AutoModelForCausalLM
    from lowmem_grpo.policy.char_tokenizer import char_tokenizer
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Python API (notebooks)", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    model_line = re.search(r'model="([^"]+)"', code)
    assert model_line and "max_steps=20" in code and "GRPOTrainer(" in code and "trainer.train()" in code
    tiny_char_model().save_pretrained(tmp_path / "tiny")
    char_tokenizer().save_pretrained(tmp_path / "tiny")
    code = code.replace(model_line.group(1), str(tmp_path / "tiny")).replace("max_steps=20", "max_steps=2")
    monkeypatch.chdir(tmp_path)
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)
    trainer = namespace["trainer"]
    assert trainer.loop.step == 2
    checkpoint = tmp_path / "runs" / "notebook" / "checkpoint-2"
    loaded = AutoModelForCausalLM.from_pretrained(checkpoint)
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, trainer.model.state_dict()[k].cpu()), k
    rows = [json.loads(line) for line in (tmp_path / "runs" / "notebook" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and "rewards/brevity/mean" in rows[0]


def test_import_stays_light():
    """`import lowmem_grpo` loads no torch; the API names load on first use."""
    code = ("import sys, lowmem_grpo; assert 'torch' not in sys.modules, 'torch imported'; "
            "import lowmem_grpo.kernels; print(lowmem_grpo.GRPOTrainer.__module__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "lowmem_grpo.api.trainer"
