"""run.png from metrics.jsonl: every panel drawn from what was logged (old and new metric names, None
values, missing keys, a torn last line), a valid PNG, `lowmem-grpo plot`, and never failing a run."""

import json
import struct
import subprocess
import sys

import pytest

from lowmem_grpo.cli import main
from lowmem_grpo.training import plot as plot_module
from lowmem_grpo.training.plot import PANELS, draw_run, plot_run, save_run_plot

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


def synthetic_run(path, torn=True):
    """Steps 1-2 with the old clip names, 3-4 with TRL's; a None KL, a row missing keys, an eval row,
    eval_start.json, and (torn=True) a line cut off mid-write."""
    path.mkdir(parents=True, exist_ok=True)
    rows = [
        {"step": 1, "reward": 0.1, "rewards/acc/mean": 0.0, "rewards/fmt/mean": 0.2, "kl": None, "entropy": 2.0,
         "clip_ratio": 0.0, "clip_ratio_low": 0.0, "clip_ratio_high": 0.0, "completions/mean_length": 10.0,
         "completions/min_length": 4.0, "completions/max_length": 16.0, "step_time": 1.5, "generation_time": 1.0},
        {"step": 2, "reward": 0.3, "rewards/acc/mean": 0.2, "rewards/fmt/mean": 0.4, "kl": 0.01, "entropy": 1.9,
         "clip_ratio": 0.1, "clip_ratio_low": 0.05, "clip_ratio_high": 0.05, "completions/mean_length": 12.0,
         "completions/min_length": 5.0, "completions/max_length": 20.0, "step_time": 1.4, "generation_time": 0.9},
        {"step": 2, "eval_samples": 8, "eval_reward": 0.25, "eval_pass_rate/acc": 0.125,
         "eval_completions/mean_length": 9.0, "eval_runtime": 0.5},
        {"step": 3, "reward": 0.5, "kl": 0.02, "clip_ratio/region_mean": 0.2, "clip_ratio/low_mean": 0.1,
         "clip_ratio/high_mean": 0.1, "step_time": 1.3},  # missing lengths, entropy and per-function rewards
        {"step": 4, "reward": 0.7, "rewards/acc/mean": 0.6, "rewards/fmt/mean": 0.8, "kl": 0.03, "entropy": 1.7,
         "clip_ratio/region_mean": 0.3, "clip_ratio/low_mean": 0.1, "clip_ratio/high_mean": 0.2,
         "completions/mean_length": 14.0, "step_time": 1.2},
    ]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if torn:
        text += '{"step": 5, "reward": 0.'
    (path / "metrics.jsonl").write_text(text)
    (path / "eval_start.json").write_text(json.dumps({"samples": 8, "reward": 0.0, "pass_rate/acc": 0.0}))
    return path


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", "not a PNG"
    return struct.unpack(">II", data[16:24])


def _lines(ax) -> dict:
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}


def test_every_panel_reads_what_was_logged(tmp_path, logged):
    run = synthetic_run(tmp_path / "run")
    with logged("skipped 1 unreadable line"):
        fig = draw_run(run)
    axes = fig.axes[:len(PANELS)]
    assert _lines(axes[0]) == {"reward": ([1, 2, 3, 4], [0.1, 0.3, 0.5, 0.7]),
                               "acc": ([1, 2, 4], [0.0, 0.2, 0.6]), "fmt": ([1, 2, 4], [0.2, 0.4, 0.8])}
    assert _lines(axes[1]) == {"reward": ([0, 2], [0.0, 0.25]), "pass rate acc": ([0, 2], [0.0, 0.125])}
    assert _lines(axes[2]) == {"sampled mean": ([1, 2, 4], [10.0, 12.0, 14.0]), "held-out greedy": ([2], [9.0])}
    assert _lines(axes[3]) == {"kl": ([2, 3, 4], [0.01, 0.02, 0.03])}  # the None is a gap, not a zero
    assert _lines(fig.axes[-1]) == {"entropy": ([1, 2, 4], [2.0, 1.9, 1.7])}  # entropy's own y-axis
    assert _lines(axes[4]) == {"region": ([1, 2, 3, 4], [0.0, 0.1, 0.2, 0.3]),  # old and TRL names in one line
                               "low": ([1, 2, 3, 4], [0.0, 0.05, 0.1, 0.1]),
                               "high": ([1, 2, 3, 4], [0.0, 0.05, 0.1, 0.2])}
    assert _lines(axes[5]) == {"step": ([1, 2, 3, 4], [1.5, 1.4, 1.3, 1.2]), "generation": ([1, 2], [1.0, 0.9])}


def test_panels_without_data_say_so(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward": 0.5}) + "\n")
    fig = draw_run(tmp_path)
    texts = [" ".join(t.get_text() for t in ax.texts) for ax in fig.axes]
    assert texts[0] == ""  # the reward panel has its line
    assert "no held-out evaluation" in texts[1] and "eval_steps" in texts[1]
    assert all(t.startswith("no ") for t in texts[2:])


def test_plot_run_writes_a_png(tmp_path):
    run = synthetic_run(tmp_path / "run", torn=False)
    path = plot_run(run)
    assert path == run / "run.png"
    assert png_size(path) == (13 * 90, 10 * 90)
    other = plot_run(run, tmp_path / "sub" / "other.png")
    assert png_size(other) == (13 * 90, 10 * 90)


def test_no_metrics_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl in .*output_dir of a lowmem-grpo run"):
        plot_run(tmp_path)


def test_a_failure_to_plot_warns_and_never_raises(tmp_path, monkeypatch, logged):
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing logged yet (a crash before step 1): nothing to draw, no warning
        assert save_run_plot(tmp_path) is None and not (tmp_path / "run.png").exists()

    def broken(run_dir):
        raise RuntimeError("font cache corrupt")

    monkeypatch.setattr(plot_module, "plot_run", broken)
    with logged("font cache corrupt"):
        assert save_run_plot(synthetic_run(tmp_path / "run")) is None


def test_training_finishes_when_plotting_fails(toy_config, monkeypatch, logged):
    monkeypatch.setattr(plot_module, "plot_run", lambda run_dir: 1 / 0)
    from lowmem_grpo.training.trainer import Trainer
    with logged("ZeroDivisionError"):
        assert Trainer(toy_config("max_steps=1")).train()["step"] == 1


def test_cli_plot(tmp_path, capsys, logged):
    run = synthetic_run(tmp_path / "run")
    with logged("skipped 1 unreadable line"):  # the torn line is reported, not fatal
        assert main(["plot", str(run)]) == 0
    assert png_size(run / "run.png")[0] > 0 and str(run / "run.png") in capsys.readouterr().out
    with logged("skipped 1 unreadable line"):
        assert main(["plot", str(run), "--out", str(tmp_path / "x.png")]) == 0 and png_size(tmp_path / "x.png")
    assert main(["plot", str(tmp_path / "nowhere")]) == 2
    assert "no metrics.jsonl in" in capsys.readouterr().err


def test_cli_plot_does_not_load_torch(tmp_path):
    run = synthetic_run(tmp_path / "run", torn=False)
    code = ("import sys; from lowmem_grpo.cli import main; rc = main(['plot', sys.argv[1]]); "
            "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", code, str(run)], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
