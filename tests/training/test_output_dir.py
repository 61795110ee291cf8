"""A run never loses another run's data in output_dir, and a folder it cannot use is one line, before any load."""

import errno
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from lowmem_grpo.cli import main
from lowmem_grpo.config import ConfigError
from lowmem_grpo.training.checkpoint import CheckpointError, list_checkpoints
from lowmem_grpo.training.metrics import read_metrics
from lowmem_grpo.training.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]


def _steps(folder) -> list[int]:
    return [row["step"] for row in read_metrics(folder)]


def _recipe(tmp_path, cfg) -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    return str(path)


def _one_line(capsys) -> str:
    err = capsys.readouterr().err  # with transformers' progress bars ("Writing model shards") around it
    lines = [line for line in err.splitlines() if "lowmem-grpo" in line]
    assert len(lines) == 1 and lines[0].startswith("lowmem-grpo: error: ") and "Traceback" not in err, err
    return lines[0]


@pytest.fixture
def finished_run(toy_config):
    """A finished 4-step run with checkpoints 3 and 4 in it."""
    cfg = toy_config("max_steps=4", "save_steps=1", "save_total_limit=2")
    Trainer(cfg).train()
    out = Path(cfg.output.output_dir)
    assert _steps(out) == [1, 2, 3, 4] and [s for s, _ in list_checkpoints(out)] == [3, 4]
    return out


def test_a_second_run_into_a_folder_with_a_run_is_refused_naming_both_options(finished_run, toy_config):
    before = (finished_run / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match=r"already holds a run \(checkpoint-3, checkpoint-4, completions.jsonl, "
                                          r"metrics.jsonl\): continue it with resume_from=latest, start over in it "
                                          r"with overwrite_output_dir=true .*or set output_dir to a new folder"):
        Trainer(toy_config("max_steps=2", "save_steps=1", "save_total_limit=2"))
    assert (finished_run / "metrics.jsonl").read_text() == before  # steps 1,2,3,4 and nothing after
    assert [s for s, _ in list_checkpoints(finished_run)] == [3, 4]
    # the old run's checkpoint from another folder into it: refused too (its logs would mix with this one's)
    elsewhere = toy_config("max_steps=2", output_dir=finished_run.parent / "other")
    Trainer(elsewhere).train()
    with pytest.raises(ConfigError, match="resume_from=.*checkpoint-2 is a checkpoint of another folder"):
        Trainer(toy_config("max_steps=5", f"resume_from={finished_run.parent / 'other' / 'checkpoint-2'}"))


def test_resume_continues_the_run_in_the_folder(finished_run, toy_config):
    trainer = Trainer(toy_config("max_steps=5", "save_steps=1", "save_total_limit=2", "resume_from=latest"))
    assert trainer.step == 4
    trainer.train()
    assert _steps(finished_run) == [1, 2, 3, 4, 5]
    assert [s for s, _ in list_checkpoints(finished_run)] == [4, 5]


def test_overwrite_deletes_the_old_run_only_and_says_so(finished_run, toy_config, caplog):
    (finished_run / "notes.txt").write_text("mine")
    (finished_run / "tensorboard").mkdir()
    with caplog.at_level(logging.WARNING, logger="lowmem_grpo.training.output_dir"):
        Trainer(toy_config("max_steps=2", "save_steps=1", "save_total_limit=2", "overwrite_output_dir=true")).train()
    deleted = {Path(r.getMessage().split("deleting ")[1]).name for r in caplog.records if "deleting" in r.getMessage()}
    assert deleted == {"checkpoint-3", "checkpoint-4", "metrics.jsonl", "completions.jsonl", "run.png",
                       "tensorboard"}
    assert _steps(finished_run) == [1, 2]
    assert [s for s, _ in list_checkpoints(finished_run)] == [1, 2]  # the new run's, not pruned for the old ones
    assert (finished_run / "notes.txt").read_text() == "mine"  # not a run's file: kept
    with pytest.raises(ConfigError, match="overwrite_output_dir=true deletes the run in .* and resume_from=latest "
                                          "continues it: set only one of them"):
        Trainer(toy_config("overwrite_output_dir=true", "resume_from=latest"))
    assert _steps(finished_run) == [1, 2]


def test_overwrite_is_in_help_config(capsys):
    assert main(["--help-config"]) == 0
    out = capsys.readouterr().out
    assert "overwrite_output_dir" in out and "DELETES" in out


_HOLD = """
import sys, time
from lowmem_grpo.training import distributed, output_dir
from lowmem_grpo.config.schema import OutputConfig
lock = output_dir.claim(OutputConfig(output_dir=sys.argv[1]), distributed.World())
print("locked", flush=True)
time.sleep(600)
"""


def test_a_live_run_holds_the_folder_and_a_killed_one_leaves_no_lock(toy_config, tmp_path):
    folder = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(folder)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "locked"
        with pytest.raises(ConfigError, match=rf"output_dir {folder} is in use by another lowmem-grpo run "
                                              rf"\(pid {proc.pid} on .*\): wait for it to finish or stop it.*"
                                              "set output_dir to another folder"):
            Trainer(toy_config())
    finally:
        proc.send_signal(signal.SIGKILL)  # a crash: the OS drops the lock
        proc.wait()
    Trainer(toy_config()).train()
    assert _steps(folder) == [1, 2]


def test_two_trainers_in_one_process_do_not_share_a_folder(toy_config):
    first = Trainer(toy_config())
    second = Trainer(toy_config())  # a notebook cell run again: the later Trainer takes the folder over
    with pytest.raises(ConfigError, match="was claimed by a Trainer built after this one"):
        first.train()  # never into the folder that the later one's check was made for
    second.train()  # its train() ends: the folder holds its run, which a resume continues
    assert Trainer(toy_config("max_steps=3", "resume_from=latest")).step == 2
    with pytest.raises(ConfigError, match="was claimed by a Trainer built after this one"):
        first.train()


def test_a_trainer_that_is_training_keeps_its_folder(toy_config):
    from lowmem_grpo.training.callbacks import TrainerCallback
    refused = []

    class BuildAnother(TrainerCallback):
        def on_step_end(self, trainer, step, metrics):
            with pytest.raises(ConfigError, match="in use by another lowmem-grpo run .*a Trainer of this process "
                                                  "that is training"):
                Trainer(toy_config("max_steps=4"))
            refused.append(step)

    trainer = Trainer(toy_config())
    trainer.add_callback(BuildAnother())
    trainer.train()
    assert refused == [1, 2]


def test_a_failed_setup_releases_the_folder(toy_config, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "no prompt"}) + "\n")
    with pytest.raises(Exception, match="prompt"):
        Trainer(toy_config(f"train_file={bad}"))
    Trainer(toy_config()).train()  # not refused as "in use"


def test_other_ranks_take_rank_0s_verdict_and_no_lock(tmp_path, monkeypatch):
    from lowmem_grpo.config.schema import OutputConfig
    from lowmem_grpo.training import distributed, output_dir
    folder = tmp_path / "run"
    out = OutputConfig(output_dir=str(folder))
    rank1 = distributed.World(rank=1, size=2)
    monkeypatch.setattr(distributed.World, "gather_objects", lambda self, obj: [None, obj])
    assert output_dir.claim(out, rank1) is None and not folder.exists()  # rank 0 owns the folder
    monkeypatch.setattr(distributed.World, "gather_objects", lambda self, obj: ["output_dir x is a file, ...", obj])
    with pytest.raises(ConfigError, match="output_dir x is a file"):
        output_dir.claim(out, rank1)
    rank0 = distributed.World(rank=0, size=2)
    folder.parent.mkdir(exist_ok=True)
    folder.write_text("a file")
    seen = []
    monkeypatch.setattr(distributed.World, "gather_objects", lambda self, obj: seen.append(obj) or [obj, None])
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        output_dir.claim(out, rank0)
    assert "is a file" in seen[0]  # rank 0 reached the collective, so the others do not wait on it


# ----- one line, not a traceback ----------------------------------------------------------------------
def test_output_dir_that_is_a_file_is_one_line(toy_config, tmp_path, capsys):
    (tmp_path / "run").write_text("notes")
    assert main(["train", _recipe(tmp_path, toy_config())]) == 2
    assert f"output_dir {tmp_path / 'run'} is a file, not a folder: set output_dir to a folder" in _one_line(capsys)


def test_a_read_only_output_dir_is_one_line_before_the_model_loads(toy_config, tmp_path, capsys, monkeypatch):
    folder = tmp_path / "run"
    folder.mkdir()
    folder.chmod(0o555)
    real_open = os.open

    def read_only(path, *args, **kwargs):  # root ignores the mode bits: refuse as a read-only folder would
        if Path(path).parent == folder:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only)
    monkeypatch.setattr("lowmem_grpo.training.setup.load_model", lambda *a: pytest.fail("the model loaded"))
    try:
        assert main(["train", _recipe(tmp_path, toy_config())]) == 2
    finally:
        folder.chmod(0o755)
    assert f"in output_dir {folder} (Permission denied): set output_dir to a folder this user can write" \
        in _one_line(capsys)


def test_a_full_disk_during_a_save_is_one_line(toy_config, tmp_path, capsys, monkeypatch):
    real_save = torch.save

    def full_disk(obj, f, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    try:
        assert main(["train", _recipe(tmp_path, toy_config("save_steps=1"))]) == 2
    finally:
        monkeypatch.setattr(torch, "save", real_save)
    err = _one_line(capsys)
    assert "no space left on the disk holding" in err and "then continue with resume_from=latest" in err


def test_a_full_disk_while_logging_is_one_line(toy_config, tmp_path, capsys, monkeypatch):
    from lowmem_grpo.training import metrics

    def full_disk(path, mode="r", *args, **kwargs):
        if Path(path).name == "metrics.jsonl" and "a" in mode:
            raise OSError(errno.ENOSPC, "No space left on device")
        return open(path, mode, *args, **kwargs)

    monkeypatch.setattr(metrics, "open", full_disk, raising=False)  # the module's writes see a full disk
    assert main(["train", _recipe(tmp_path, toy_config())]) == 2
    err = _one_line(capsys)
    assert f"no space left on the disk holding output_dir {tmp_path / 'run'} while writing metrics.jsonl" in err


@pytest.mark.parametrize("damage", ["truncated weights", "no trainer_state.pt"])
def test_an_explicit_damaged_checkpoint_is_one_line(finished_run, toy_config, tmp_path, capsys, damage):
    target = finished_run / "checkpoint-4"
    if damage == "truncated weights":
        weights = target / "model.safetensors"
        os.truncate(weights, weights.stat().st_size // 2)
    else:
        (target / "trainer_state.pt").unlink()
    assert main(["train", _recipe(tmp_path, toy_config("max_steps=5", f"resume_from={target}"))]) == 2
    err = _one_line(capsys)
    assert f"resume_from={target}: " in err and "resume_from=latest picks the newest complete one" in err
    with pytest.raises(CheckpointError, match="resume from another checkpoint"):
        Trainer(toy_config("max_steps=5", f"resume_from={target}"))
