"""output.report_to: parsing (TRL/transformers semantics), and the W&B / trackio backends.

Neither wandb nor trackio is installed here (nor is there a network), so each is replaced by a fake
module in sys.modules that records the calls the backend makes."""

import importlib.machinery
import sys
import types

import pytest

from lowmem_grpo.config import ConfigError, load_config, report_targets
from lowmem_grpo.training.metrics import RunLog
from lowmem_grpo.training.trackers import open_trackers
from lowmem_grpo.training.trainer import Trainer


class Calls(list):
    def __call__(self, name):
        return lambda *args, **kwargs: self.append((name, args, kwargs))


def fake_wandb(monkeypatch) -> Calls:
    calls = Calls()
    run = types.SimpleNamespace(log=calls("run.log"), finish=calls("run.finish"))
    module = types.ModuleType("wandb")
    module.__spec__ = importlib.machinery.ModuleSpec("wandb", None)  # "installed", for report_to=all

    def init(**kwargs):
        calls.append(("init", (), kwargs))
        return run

    module.init = init
    monkeypatch.setitem(sys.modules, "wandb", module)
    return calls


def fake_trackio(monkeypatch) -> Calls:
    calls = Calls()
    module = types.ModuleType("trackio")
    module.__spec__ = importlib.machinery.ModuleSpec("trackio", None)
    module.init, module.log, module.finish = calls("init"), calls("log"), calls("finish")
    monkeypatch.setitem(sys.modules, "trackio", module)
    return calls


@pytest.mark.parametrize("value, expected", [
    ("none", []), (None, []), ([], []), (["none"], []), ("tensorboard", ["tensorboard"]), ("wandb", ["wandb"]),
    (["tensorboard", "trackio"], ["tensorboard", "trackio"]), (["wandb", "wandb"], ["wandb"]), ("all", ["all"])])
def test_report_to_names(value, expected):
    assert report_targets(value) == expected


@pytest.mark.parametrize("value, message", [
    ("wandbb", "did you mean 'wandb'"), ("tensorboard,wandb", r"give a list: report_to=\[tensorboard,wandb\]"),
    (["all", "wandb"], "already means every installed backend"), ("mlflow", "report_to must be none, all")])
def test_bad_report_to_names_the_fix(value, message):
    with pytest.raises(ConfigError, match=message):
        report_targets(value)


def test_report_to_from_the_command_line_and_recipes(tmp_path):
    assert load_config(None, ["report_to=[tensorboard,wandb]"], check=False).output.report_to == ["tensorboard", "wandb"]
    recipe = tmp_path / "r.yaml"
    recipe.write_text("output:\n  report_to: [trackio]\n  run_name: first-try\n")
    cfg = load_config(recipe, check=False)
    assert (cfg.output.report_to, cfg.output.run_name) == (["trackio"], "first-try")


def test_wandb_gets_config_name_and_every_numeric_metric_by_step(monkeypatch, tmp_path):
    calls = fake_wandb(monkeypatch)
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    log = RunLog(tmp_path / "my-run", ["wandb"], config={"train": {"beta": 0.0}})
    log.metrics(3, {"reward": 0.5, "kl": None, "note": "text", "skipped": 0, "flag": True})
    log.close()
    assert calls == [
        ("init", (), {"project": "lowmem-grpo", "name": "my-run", "config": {"train": {"beta": 0.0}},
                      "dir": str(tmp_path / "my-run")}),
        ("run.log", ({"reward": 0.5, "skipped": 0},), {"step": 3}),
        ("run.finish", (), {})]


def test_trackio_gets_project_name_config_and_metrics(monkeypatch, tmp_path):
    calls = fake_trackio(monkeypatch)
    log = RunLog(tmp_path, "trackio", run_name="named", project="proj", config={"a": 1})
    log.metrics(1, {"reward": 1.0, "eval_pass_rate/f": 0.25})
    log.close()
    assert calls == [("init", (), {"project": "proj", "name": "named", "config": {"a": 1}}),
                     ("log", ({"reward": 1.0, "eval_pass_rate/f": 0.25},), {"step": 1}),
                     ("finish", (), {})]


@pytest.mark.parametrize("target", ["wandb", "trackio"])
def test_missing_package_says_what_to_install(monkeypatch, tmp_path, target):
    monkeypatch.setitem(sys.modules, target, None)  # what an uninstalled package looks like to import
    with pytest.raises(ImportError, match=f"report_to={target} needs the {target} package.*pip install {target}"):
        RunLog(tmp_path, [target])


def test_a_missing_package_closes_the_trackers_already_open(monkeypatch, tmp_path):
    calls = fake_wandb(monkeypatch)
    monkeypatch.setitem(sys.modules, "trackio", None)
    with pytest.raises(ImportError, match="pip install trackio"):
        open_trackers(["wandb", "trackio"], tmp_path)
    assert calls[-1][0] == "run.finish"


def test_all_means_every_installed_backend(monkeypatch, tmp_path):
    pytest.importorskip("tensorboard")
    fake_wandb(monkeypatch)
    monkeypatch.setitem(sys.modules, "trackio", None)  # not installed: left out, not an error
    trackers = open_trackers("all", tmp_path)
    try:
        assert [type(t).__name__ for t in trackers] == ["TensorBoardTracker", "WandbTracker"]
    finally:
        for t in trackers:
            t.close()


def test_training_reports_each_logged_step_and_eval_to_wandb(toy_config, monkeypatch):
    calls = fake_wandb(monkeypatch)
    cfg = toy_config("max_steps=2", "eval_steps=2", "report_to=wandb", "run_name=toy")
    Trainer(cfg).train()
    init = calls[0]
    assert init[0] == "init" and init[2]["name"] == "toy"
    assert init[2]["config"]["train"]["max_steps"] == 2 and init[2]["config"]["eval"]["eval_steps"] == 2
    logged = [(kw["step"], "eval_reward" in args[0]) for name, args, kw in calls if name == "run.log"]
    assert logged == [(1, False), (2, False), (2, True)]
    assert calls[-1][0] == "run.finish"
