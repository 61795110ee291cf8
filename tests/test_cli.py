"""The command line's parsing: --version, --help-config after a command, TRL-style `--key value`
options, shipped recipes by name, and `lowmem-grpo recipes [cp]`. Commands that would train are
replaced by a recorder, so these take milliseconds."""

from pathlib import Path

import pytest

import lowmem_grpo
import lowmem_grpo.cli as cli
from lowmem_grpo.cli import main
from lowmem_grpo.cli.options import key_options_to_overrides
from lowmem_grpo.config import ConfigError, load_config
from lowmem_grpo.shipped_recipes import recipes_dir, shipped_recipes

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def recorded(monkeypatch):
    """main()'s train/eval calls, recorded instead of run: a list of (command, recipe, overrides)."""
    calls = []
    monkeypatch.setattr(cli, "train", lambda recipe, overrides: calls.append(("train", recipe, overrides)) or 0)
    monkeypatch.setattr(cli, "evaluate", lambda recipe, overrides: calls.append(("eval", recipe, overrides)) or 0)
    return calls


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"lowmem-grpo {lowmem_grpo.__version__}"


@pytest.mark.parametrize("argv", [["--help-config"], ["train", "--help-config"], ["train", "R.yaml", "--help-config"],
                                  ["plan", "--help-config"], ["profile", "--help-config"]])
def test_help_config_before_or_after_the_command(argv, capsys):
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "[train]" in out and "  max_steps = 100" in out


def test_trl_style_options_set_the_same_keys(recorded):
    recipe = str(ROOT / "recipes" / "char_e.yaml")
    assert main(["train", recipe, "--learning_rate", "1e-5", "--max-steps=3", "--train.beta", "0.04", "--bf16",
                 "--gradient_checkpointing", "false", "--system_prompt", "Be brief.", "seed=7"]) == 0
    (_, got_recipe, overrides), = recorded
    assert got_recipe == recipe
    assert overrides == ["learning_rate=1e-5", "max_steps=3", "train.beta=0.04", "bf16=true",
                         "gradient_checkpointing=false", "system_prompt=Be brief.", "seed=7"]
    cfg = load_config(recipe, overrides)
    assert (cfg.optim.learning_rate, cfg.train.max_steps, cfg.train.beta, cfg.model.bf16) == (1e-5, 3, 0.04, True)
    assert cfg.model.gradient_checkpointing is False and cfg.data.system_prompt == "Be brief." and cfg.train.seed == 7


def test_option_rewriting_rules():
    own = {"--steps", "--out", "-h", "--help"}
    assert key_options_to_overrides(["R", "--steps", "3", "--beta", "0", "--out", "d"], own) == \
        ["R", "--steps", "3", "beta=0", "--out", "d"]
    assert key_options_to_overrides(["--model_name_or_path", "Qwen/Qwen2.5-0.5B"], own) == \
        ["name_or_path=Qwen/Qwen2.5-0.5B"]
    assert key_options_to_overrides(["--bf16", "R.yaml"], own) == ["bf16=true", "R.yaml"]  # a flag takes no word
    assert key_options_to_overrides(["--epsilon", "-1"], own) == ["epsilon=-1"]  # a negative value is a value
    assert key_options_to_overrides(["--", "--beta"], own) == ["--", "--beta"]
    with pytest.raises(ConfigError, match="--max_steps needs a value"):
        key_options_to_overrides(["--max_steps", "--beta", "0"], own)
    with pytest.raises(ConfigError, match="unknown config key 'max_stpes'.*did you mean 'max_steps'"):
        key_options_to_overrides(["--max_stpes", "3"], own)


def test_bad_option_is_one_line_naming_the_nearest_key(capsys, recorded):
    assert main(["train", "R.yaml", "--learnig_rate", "1e-5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "did you mean 'learning_rate'" in err and not recorded


def test_eval_model_option_is_its_shorthand(recorded):
    recipe = str(ROOT / "recipes" / "char_e.yaml")
    assert main(["eval", recipe, "--model", "runs/x/checkpoint-3", "--eval_max_samples", "5"]) == 0
    assert recorded == [("eval", recipe, ["model=runs/x/checkpoint-3", "eval_max_samples=5"])]


def test_eval_of_a_missing_checkpoint_lists_the_ones_there(tmp_path, capsys):
    from lowmem_grpo.training.checkpoint import MANIFEST
    run = tmp_path / "run"
    for step in (10, 2, 30):  # complete checkpoints (a manifest); an unfinished one is not offered
        (run / f"checkpoint-{step}").mkdir(parents=True)
        (run / f"checkpoint-{step}" / MANIFEST).write_text("{}")
    (run / "checkpoint-40").mkdir()
    recipe = str(ROOT / "recipes" / "char_e.yaml")
    assert main(["eval", recipe, f"model={run}/checkpoint-3", f"output_dir={tmp_path / 'elsewhere'}"]) == 2
    err = capsys.readouterr().err
    assert f"model={run}/checkpoint-3: no such checkpoint; the checkpoints there are: {run}/checkpoint-2, " \
           f"{run}/checkpoint-10, {run}/checkpoint-30" in err and "Traceback" not in err
    assert main(["eval", recipe, f"model={tmp_path}/nothing/checkpoint-3", f"output_dir={tmp_path / 'x'}"]) == 2
    assert "no such folder" in capsys.readouterr().err  # none to list: the loader's message


# ------------------------------------------------------------------------------------- shipped recipes
def test_shipped_recipes_are_the_source_trees_here():
    assert recipes_dir() == ROOT / "recipes"
    assert set(shipped_recipes()) == {p.stem for p in (ROOT / "recipes").glob("*.yaml")}


def test_recipes_lists_each_with_its_whole_description_wrapped_at_words(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "90")
    assert main(["recipes"]) == 0
    lines = capsys.readouterr().out.split("\n\n")[0].splitlines()
    assert all(len(line) < 90 for line in lines)
    names = list(shipped_recipes())
    starts = [i for i, line in enumerate(lines) if line.split(" ")[0] in names] + [len(lines)]
    assert [lines[i].split(" ")[0] for i in starts[:-1]] == names
    for (name, path), a, b in zip(shipped_recipes().items(), starts, starts[1:]):
        comment = " ".join(line.lstrip("#") for line in path.read_text().splitlines()[:10]).split()
        shown = " ".join(lines[a:b]).split()[1:]  # no word cut in two at a line's end
        assert shown == comment[:len(shown)] and shown[-1][-1] in ".!?", name  # its first sentence, whole


def test_output_into_a_reader_that_stops_early_ends_quietly():
    import subprocess
    import sys
    import fcntl
    proc = subprocess.Popen([sys.executable, "-m", "lowmem_grpo", "--help-config"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    # a one-page pipe (F_SETPIPE_SZ), set while the child still imports: its ~20 KB cannot all fit before
    # the close below, so it meets the closed pipe however fast it writes
    fcntl.fcntl(proc.stdout.fileno(), getattr(fcntl, "F_SETPIPE_SZ", 1031), 4096)
    proc.stdout.readline()
    proc.stdout.close()  # as `| head -1` does
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141 and err == "", err


def test_train_accepts_a_shipped_recipe_name(recorded, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "char_e", "--max_steps", "2"]) == 0
    assert recorded == [("train", str(ROOT / "recipes" / "char_e.yaml"), ["max_steps=2"])]
    assert main(["train", "chare"]) == 2
    assert "did you mean the shipped recipe 'char_e'" in capsys.readouterr().err
    (tmp_path / "char_e").write_text("x")  # a file of that name wins over the shipped recipe
    assert main(["train", "char_e"]) == 0 and recorded[-1][1] == "char_e"


def test_recipes_cp_copies_the_recipe_and_its_data(tmp_path, capsys):
    assert main(["recipes", "cp", "smollm2-135m_arithmetic_cpu", str(tmp_path / "mine")]) == 0
    recipe = tmp_path / "mine" / "smollm2-135m_arithmetic_cpu.yaml"
    assert recipe.read_text() == (ROOT / "recipes" / recipe.name).read_text()
    for name in ("arithmetic_train.jsonl", "arithmetic_eval.jsonl"):
        assert (tmp_path / "mine" / "data" / name).read_bytes() == (ROOT / "recipes" / "data" / name).read_bytes()
    assert sorted(p.name for p in (tmp_path / "mine" / "data").iterdir()) == ["arithmetic_eval.jsonl",
                                                                             "arithmetic_train.jsonl"]
    cfg = load_config(recipe)
    assert (recipe.parent / cfg.data.train_file).is_file() and (recipe.parent / cfg.data.eval_file).is_file()
    # again: refused without --force, naming the files; with --force, overwritten
    assert main(["recipes", "cp", "smollm2-135m_arithmetic_cpu", str(tmp_path / "mine")]) == 2
    assert "--force" in capsys.readouterr().err
    assert main(["recipes", "cp", "smollm2-135m_arithmetic_cpu", str(tmp_path / "mine"), "--force"]) == 0


def test_recipes_cp_unshipped_data_gets_its_script_and_a_note(tmp_path, capsys):
    assert main(["recipes", "cp", "qwen2.5-0.5b_gsm8k_8gb", str(tmp_path / "g.yaml")]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "g.yaml").is_file() and (tmp_path / "data" / "prepare_gsm8k.py").is_file()
    assert "data/gsm8k_train.jsonl is not shipped" in out and "prepare_gsm8k.py" in out
    assert main(["recipes", "cp", "gsm8k"]) == 2
    assert "no shipped recipe 'gsm8k'" in capsys.readouterr().err


# ------------------------------------------------------------------------------------- bad input at the door
def _one_line_error(err: str) -> str:
    assert err.startswith("lowmem-grpo: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_a_recipe_with_a_yaml_syntax_error_is_one_line_from_the_real_command(tmp_path):
    """Run as a user does (a process, `python -m lowmem_grpo`): no PyYAML traceback, the config-error exit code."""
    import subprocess
    import sys
    recipe = tmp_path / "typo.yaml"
    recipe.write_text("model: {config: {model_type: llama}\nrewards: {reward_funcs: [numeric_answer]}\n")
    run = subprocess.run([sys.executable, "-m", "lowmem_grpo", "train", str(recipe)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    err = _one_line_error(run.stderr)
    assert f"recipe '{recipe}' is not valid YAML: line 2, column 1: expected ',' or '}}'" in err


@pytest.fixture
def no_trainer(monkeypatch):
    """The CLI's real train path up to the Trainer, which fails the test if reached (it loads the model)."""
    import lowmem_grpo.training.trainer as trainer_module
    monkeypatch.setattr(trainer_module, "Trainer", lambda *a, **k: pytest.fail("the model would load"))


def test_an_override_that_is_not_yaml_is_one_line(capsys, no_trainer):
    recipe = str(ROOT / "recipes" / "char_e.yaml")
    assert main(["train", recipe, "system_prompt=Be brief: one: word"]) == 2
    err = _one_line_error(capsys.readouterr().err)
    assert "value of system_prompt on the command line is not valid YAML" in err and "quote it" in err
    assert main(["train", recipe, "system_prompt=Be brief: one word"]) == 2  # valid YAML, but a mapping
    err = _one_line_error(capsys.readouterr().err)
    assert "data.system_prompt must be text, got the mapping {'Be brief': 'one word'}" in err and "quote" in err
    assert main(["plan", recipe, "beta=[0.1"]) == 2  # the planner reads overrides the same way
    assert "value of beta on the command line is not valid YAML" in _one_line_error(capsys.readouterr().err)


def test_epsilon_out_of_the_kernels_range_stops_before_the_model_loads(capsys, no_trainer):
    assert main(["train", str(ROOT / "recipes" / "char_e.yaml"), "epsilon=5"]) == 2
    assert "train.epsilon must be in [0, 1), got 5.0" in _one_line_error(capsys.readouterr().err)


def test_two_model_sources_on_the_command_line_are_one_line(capsys, no_trainer):
    recipe = str(ROOT / "recipes" / "char_e.yaml")  # it builds its model from model.config
    for argv in (["train", recipe, "model.name_or_path=/some/path"], ["train", recipe, "--model_name_or_path", "x/y"]):
        assert main(argv) == 2
        err = _one_line_error(capsys.readouterr().err)
        assert "two model sources: model.name_or_path=" in err and "model.config=null" in err


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_configuration_error_under_torchrun_is_said_by_rank_0_while_the_others_wait(rank, monkeypatch, capsys):
    """torchrun stops every rank as soon as one exits: a silent rank that exited at once could stop rank 0
    before it printed the error (seen as an empty stderr). The others wait; rank 0 says it and exits."""
    slept = []
    monkeypatch.setattr(cli.time, "sleep", slept.append)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", rank)
    assert main(["eval", "recipes/toy_tokens.yaml"]) == 2
    said = capsys.readouterr().err
    if rank == "0":
        assert "runs in one process" in said and slept == []
    else:
        assert said == "" and slept == [cli.SILENT_RANK_GRACE_S]
