"""The config tree: defaults, recipe + command-line precedence, and errors that name the fix."""

import dataclasses
import importlib.util
from pathlib import Path

import pytest

from lowmem_grpo.config import Config, ConfigError, batch_plan, describe, key_index, load_config

RECIPES = sorted((Path(__file__).parents[2] / "recipes").glob("*.yaml"))
MINIMAL = ["model.name_or_path=some/model", "reward_funcs=[numeric_answer]"]


def test_every_key_is_unique_and_documented():
    index = key_index()  # raises if two sections share a key name
    assert {"num_generations", "beta", "epsilon_high", "loss_type", "scale_rewards", "learning_rate",
            "per_device_train_batch_size", "max_completion_length", "reward_weights"} <= set(index)
    text = describe()
    for section in dataclasses.fields(Config):
        for f in dataclasses.fields(section.type if isinstance(section.type, type) else type(getattr(Config(), section.name))):
            assert f.metadata.get("help"), f"{section.name}.{f.name} has no help text"
            assert f"  {f.name} = " in text


def test_trl_defaults():
    cfg = Config()
    assert (cfg.train.loss_type, cfg.train.beta, cfg.train.epsilon, cfg.generation.num_generations,
            cfg.optim.learning_rate, cfg.generation.temperature) == ("dapo", 0.0, 0.2, 8, 1e-6, 1.0)


def test_recipe_then_command_line_precedence(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {name_or_path: a}\ntrain: {beta: 0.04, max_steps: 7}\n"
                      "optim: {learning_rate: 1e-5}\nrewards: {reward_funcs: [numeric_answer]}\n")
    cfg = load_config(recipe, ["train.beta=0.1", "learning_rate=3e-6"])
    assert cfg.train.beta == 0.1 and cfg.train.max_steps == 7 and cfg.optim.learning_rate == 3e-6
    assert cfg.model.name_or_path == "a"
    # YAML 1.1 would read 1e-05 as a string, even nested in a dict (a model config's rms_norm_eps)
    cfg = load_config(recipe, ["model.name_or_path=null", 'model.config={"model_type": "llama", "rms_norm_eps": 1e-05}'])
    assert cfg.model.config["rms_norm_eps"] == 1e-5


@pytest.mark.parametrize("override, message", [
    ("max_stpes=3", "unknown config key 'max_stpes'.*did you mean 'max_steps'"),
    ("train.learning_rate=1e-5", "did you mean 'optim.learning_rate'"),
    ("trian.beta=0.1", "unknown config key 'trian.beta'.*did you mean 'train.beta'"),
    ("beta=lots", "train.beta must be float, got 'lots'"),
    ("num_generations=1", "num_generations must be >= 2"),
    ("loss_type=dappo", "loss_type must be one of .*did you mean 'dapo'"),
    ("per_device_train_batch_size=6", r"multiple of num_generations \(8\)"),
    ("reward_weights=[1.0, 2.0]", "reward_weights has 2 entries but there are 1 reward functions"),
    ("max_steps", "is not key=value"),
    ("optimizer=sgd", "optimizer must be one of adamw_8bit, paged_adamw_8bit, adamw"),
    ("reference_compute=gpu", "reference_compute must be one of auto, cpu, stream"),
])
def test_bad_overrides_name_the_fix(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, MINIMAL + [override])


def test_recipe_errors_name_the_file(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("model: {name_or_path: a}\ntrain: {num_generation: 4}\n")
    with pytest.raises(ConfigError, match=r"'train.num_generation' in .*bad.yaml; did you mean 'generation.num_generations'"):
        load_config(recipe)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")


def test_batch_plan_follows_trl():
    cfg = load_config(None, MINIMAL + ["per_device_train_batch_size=8", "gradient_accumulation_steps=2",
                                       "num_iterations=2"])
    plan = batch_plan(cfg)
    assert (plan.generation_batch_size, plan.prompts_per_generation, plan.steps_per_generation_batch) == (16, 2, 2)
    assert plan.needs_old_logprobs
    single = batch_plan(load_config(None, MINIMAL))
    assert single.steps_per_generation_batch == 1 and not single.needs_old_logprobs


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_shipped_recipes_validate(recipe):
    text = recipe.read_text()
    assert text.startswith("#") and "Command:" in text and "Hardware:" in text, "recipe header missing"
    load_config(recipe)


def test_optimizer_in_backward_cannot_accumulate():
    with pytest.raises(ConfigError, match="optimizer_in_backward.*set gradient_accumulation_steps=1"):
        load_config(None, MINIMAL + ["optimizer_in_backward=true", "gradient_accumulation_steps=2"])
    plan = batch_plan(load_config(None, MINIMAL + ["optimizer_in_backward=true", "steps_per_generation=4",
                                                   "per_device_train_batch_size=4", "num_generations=4"]))
    assert plan.steps_per_generation_batch == 4 and plan.needs_old_logprobs  # PPO-style mini-batch steps


def test_offload_needs_checkpointing():
    with pytest.raises(ConfigError, match="offload_activations.*gradient_checkpointing=true"):
        load_config(None, MINIMAL + ["offload_activations=true", "gradient_checkpointing=false"])


def test_none_is_the_word_in_text_fields_and_none_elsewhere(tmp_path):
    cfg = load_config(None, [*MINIMAL, "report_to=none", "tokenizer=none", "max_grad_norm=none",
                             "epsilon_high=None", "resume_from=null"], check=False)
    assert cfg.output.report_to == "none" and cfg.model.tokenizer == "none"  # the strings they say
    assert cfg.optim.max_grad_norm is None and cfg.train.epsilon_high is None and cfg.output.resume_from is None
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {name_or_path: a, tokenizer: none}\noutput: {report_to: none}\n"
                      "rewards: {reward_funcs: [numeric_answer]}\n")
    cfg = load_config(recipe)
    assert cfg.model.tokenizer == "none" and cfg.output.report_to == "none"


def test_recipes_are_read_as_yaml_1_2(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {name_or_path: 010}\n"  # YAML 1.1: the int 8; a text field gets "010"
                      "data: {system_prompt: no, train_file: 3.10}\n"  # 1.1: False and 3.1
                      "train: {max_steps: 010, seed: 0x10}\n"  # 1.2: ten (not octal eight), sixteen
                      "optim: {learning_rate: 1e-5, warmup_steps: 0o10}\n"
                      "rewards: {reward_funcs: [{name: regex_format, pattern: off}]}\n")
    cfg = load_config(recipe, check=False)
    assert cfg.model.name_or_path == "010" and cfg.data.system_prompt == "no" and cfg.data.train_file == "3.10"
    assert cfg.train.max_steps == 10 and type(cfg.train.max_steps) is int and cfg.train.seed == 16
    assert cfg.optim.learning_rate == 1e-5 and cfg.optim.warmup_steps == 8
    assert cfg.rewards.reward_funcs == [{"name": "regex_format", "pattern": "off"}]  # nested: the word, not False
    assert type(cfg.rewards.reward_funcs[0]["name"]) is str


@pytest.mark.parametrize("line, message", [
    ("train: {max_steps: 1_000}", r"train.max_steps must be an integer, got the text '1_000': write the number"),
    ("train: {max_steps: '1:30'}", r"train.max_steps must be an integer, got the text '1:30'"),
    ("train: {max_steps: 1:30}", r"train.max_steps must be an integer, got the text '1:30'"),  # 1.1: 90
    ("data: {shuffle: no}", r"data.shuffle must be true or false, got 'no'.*YAML 1.2"),
    ("data: {shuffle: on}", r"data.shuffle must be true or false, got 'on'"),
    ("output: {report_to: yes}", r"report_to must be .*got 'yes'"),  # the word, then checked
    ("output: {report_to: true}", r"output.report_to must be text, got the boolean True: quote it \(report_to: \"true\"\)"),
])
def test_yaml_1_1_surprises_are_errors_that_name_the_key(tmp_path, line, message):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {{name_or_path: a}}\nrewards: {{reward_funcs: [numeric_answer]}}\n{line}\n")
    with pytest.raises(ConfigError, match=message):
        load_config(recipe)


def test_reward_timeout_is_checked():
    assert load_config(None, [*MINIMAL, "reward_timeout=2.5"]).rewards.reward_timeout == 2.5
    with pytest.raises(ConfigError, match="reward_timeout must be > 0"):
        load_config(None, [*MINIMAL, "reward_timeout=0"])


def test_the_loss_hyper_parameters_follow_the_kernels_rule():
    """epsilon, epsilon_high, beta and temperature: the config refuses exactly what the fused ops refuse
    (one rule, lowmem_grpo/ranges.py), so a bad value stops before the model loads, not inside the loss."""
    from lowmem_grpo.kernels._checks import check_temperature
    from lowmem_grpo.kernels.grpo_loss import check_grpo_hparams
    kernel_checks = {"epsilon": lambda v: check_grpo_hparams(v, None, 0.0, None),
                     "epsilon_high": lambda v: check_grpo_hparams(0.2, v, 0.0, None),
                     "beta": lambda v: check_grpo_hparams(0.2, None, v, object()),
                     "temperature": check_temperature}
    for key, kernel_check in kernel_checks.items():
        for value in (-1.0, -1e-9, 0.0, 1e-9, 0.2, 0.999, 1.0, 5.0, float("nan"), float("inf")):
            try:
                kernel_check(value)
                kernel_ok = True
            except ValueError:
                kernel_ok = False
            text = {"nan": ".nan", "inf": ".inf"}.get(str(value), repr(value))
            try:
                load_config(None, [*MINIMAL, f"{key}={text}"])
                config_ok = True
            except ConfigError as e:
                assert key in str(e)
                config_ok = False
            assert config_ok == kernel_ok, (key, value, config_ok, kernel_ok)
    with pytest.raises(ConfigError, match=r"train.epsilon must be in \[0, 1\), got 5.0 .*the default is 0.2"):
        load_config(None, [*MINIMAL, "epsilon=5"])


def test_two_model_sources_are_an_error_naming_both(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {config: {model_type: llama}, tokenizer: none}\nrewards: {reward_funcs: [numeric_answer]}\n")
    with pytest.raises(ConfigError, match=r"two model sources: model.name_or_path='/some/path' .*model.config "
                                          r"\(a randomly initialised llama\).*model.config=null.*model.name_or_path=null"):
        load_config(recipe, ["model.name_or_path=/some/path"])
    # each fix the message names works
    cfg = load_config(recipe, ["model.name_or_path=/some/path", "model.config=null"])
    assert cfg.model.name_or_path == "/some/path" and cfg.model.config is None
    cfg = load_config(recipe, ["model.name_or_path=/some/path", "model.name_or_path=null"])
    assert cfg.model.name_or_path == "" and cfg.model.config == {"model_type": "llama"}
    assert load_config(recipe, ["model.name_or_path="]).model.name_or_path == ""  # `key=` clears it too
    with pytest.raises(ConfigError, match=r"model.gguf_file='m.gguf' is a file inside model.name_or_path, which is "
                                          "not set"):
        load_config(recipe, ["model.gguf_file=m.gguf"])


def test_a_recipe_that_is_not_yaml_names_file_line_and_column(tmp_path):
    recipe = tmp_path / "broken.yaml"
    recipe.write_text("model: {name_or_path: a\ntrain: {beta: 0.1}\n")
    with pytest.raises(ConfigError) as e:
        load_config(recipe)
    message = str(e.value)
    assert "\n" not in message and str(recipe) in message and "is not valid YAML: line 2, column 6" in message
    assert "(while parsing a flow mapping at line 1, column 8)" in message
    recipe.write_text("train:\n\tbeta: 0.1\n")  # a tab for indentation
    with pytest.raises(ConfigError, match=r"broken.yaml' is not valid YAML: line 2, column 1: found character '\\t'"):
        load_config(recipe)
    recipe.write_bytes(b"train: {beta: \xff}\n")
    with pytest.raises(ConfigError, match="broken.yaml' cannot be read: 'utf-8' codec can't decode"):
        load_config(recipe)


def test_an_override_that_is_not_yaml_names_the_key_and_the_fix():
    with pytest.raises(ConfigError) as e:
        load_config(None, [*MINIMAL, "system_prompt=Answer: in one word: yes"])
    message = str(e.value)
    assert "\n" not in message
    assert message == ("the value of system_prompt on the command line is not valid YAML: 'Answer: in one word: yes', "
                       "line 1, column 20: mapping values are not allowed here; if it is text, quote it: "
                       "'system_prompt=\"Answer: in one word: yes\"'")
    assert load_config(None, [*MINIMAL, 'system_prompt="Answer: in one word: yes"']).data.system_prompt == \
        "Answer: in one word: yes"  # the fix it names works
    with pytest.raises(ConfigError, match=r"value of reward_weights .*'\[1.0,', line 1, column 6: expected the node"):
        load_config(None, [*MINIMAL, "reward_weights=[1.0,"])


def test_loss_type_options_have_trls_names_and_defaults():
    """Every loss option of TRL 1.16's GRPOConfig under its name, with its default (where installed)."""
    t = Config().train
    ours = {k: getattr(t, k) for k in ("delta", "top_entropy_quantile", "use_bias_correction_kl",
                                       "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos",
                                       "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg",
                                       "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max",
                                       "vllm_importance_sampling_clip_min")}
    assert ours["use_bias_correction_kl"] is True and ours["delta"] is None
    for lt in ("grpo", "bnpo", "dapo", "dr_grpo", "cispo", "sapo", "luspo", "vespo"):
        assert load_config(None, [*MINIMAL, f"loss_type={lt}", "importance_sampling_level=sequence"
                                  if lt == "luspo" else "seed=1"]).train.loss_type == lt
    trl_config = pytest.importorskip("trl").GRPOConfig
    trl_defaults = {f.name: f.default for f in dataclasses.fields(trl_config)}
    assert ours == {k: trl_defaults[k] for k in ours}
    assert t.vllm_importance_sampling_correction is None  # by engine: off for the native rollout


@pytest.mark.parametrize("override, message", [
    ("delta=0", "train.delta must be > 0"),
    ("top_entropy_quantile=1.5", r"train.top_entropy_quantile must be in \[0, 1\]"),
    ("sapo_temperature_neg=0", "train.sapo_temperature_neg must be > 0"),
    ("vespo_k_pos=-1", "train.vespo_k_pos must be > 0"),
    ("loss_type=cispoo", "did you mean 'cispo'"),
    ("vllm_importance_sampling_mode=token", "vllm_importance_sampling_mode must be one of token_truncate"),
    ("vllm_importance_sampling_clip_min=3", r"clip_min \(3.0\) must be less than .*clip_max \(3.0\)"),
])
def test_bad_loss_options_name_the_fix(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, MINIMAL + [override])


def test_vespo_with_is_correction_needs_a_token_mode():
    with pytest.raises(ConfigError, match="vespo .* token_truncate or token_mask"):
        load_config(None, [*MINIMAL, "loss_type=vespo", "vllm_importance_sampling_correction=true"])
    load_config(None, [*MINIMAL, "loss_type=vespo", "vllm_importance_sampling_correction=true",
                       "vllm_importance_sampling_mode=token_mask"])


@pytest.mark.parametrize("overrides, warning", [
    (["loss_type=luspo"], "luspo: set importance_sampling_level=sequence"),
    (["loss_type=vespo", "importance_sampling_level=sequence"], "vespo .* should be token"),
    (["vllm_importance_sampling_correction=true"], "correction=true has no effect: the native rollout"),
])
def test_trls_warnings_for_paper_mismatches(overrides, warning, logged):
    with logged(warning):
        load_config(None, MINIMAL + overrides)


def test_the_vllm_engine_settings():
    from lowmem_grpo.config import importance_sampling_correction
    cfg = load_config(None, MINIMAL)
    assert cfg.generation.engine == "native" and not importance_sampling_correction(cfg.train, "native")
    assert importance_sampling_correction(cfg.train, "vllm")  # TRL: on with vLLM unless set false
    with pytest.raises(ConfigError, match="generation.engine must be one of native, vllm"):
        load_config(None, [*MINIMAL, "engine=sglang"])
    # vespo with vLLM: the correction is on by default, so its mode must be per token
    with pytest.raises(ConfigError, match="vespo .* token_truncate or token_mask"):
        load_config(None, [*MINIMAL, "loss_type=vespo", "engine=vllm"])
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(ConfigError, match=r"engine=vllm needs vLLM: pip install 'lowmem-grpo\[vllm\]'"):
            load_config(None, [*MINIMAL, "engine=vllm"])
    else:
        with pytest.raises(ConfigError, match="vllm_enable_sleep_mode=true is not built"):
            load_config(None, [*MINIMAL, "engine=vllm", "vllm_enable_sleep_mode=true"])
