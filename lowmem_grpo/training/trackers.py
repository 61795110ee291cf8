"""Experiment trackers behind `output.report_to`: TensorBoard, Weights & Biases, trackio.

Each gets exactly what metrics.jsonl gets, under the same names and step (training rows, and the
`eval_*` rows of `eval.eval_steps`), keeping only numbers (TensorBoard and the dashboards plot scalars).
W&B and trackio also receive the whole config at start. They are optional packages: naming one that
is not installed is an error that says what to install, before any step runs.

A resumed run opens a new W&B / trackio run with the same name; its steps continue from the checkpoint.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from pathlib import Path
from typing import Optional

from ..config import REPORT_TARGETS, report_targets

logger = logging.getLogger(__name__)

_PACKAGE = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio"}


def _require(module: str, target: str):
    """Import an optional tracker package, or explain how to get it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"output.report_to={target} needs the {_PACKAGE[target]} package ({e}): "
                          f"pip install {_PACKAGE[target]} (or pip install 'lowmem-grpo[{target}]'), or leave "
                          f"{target} out of output.report_to") from None


def _installed(target: str) -> bool:
    try:
        return importlib.util.find_spec(_PACKAGE[target]) is not None
    except (ImportError, ValueError):
        return False


def scalars(values: dict) -> dict:
    """The numeric entries of a metrics row (None, strings and the step itself are left out)."""
    return {k: v for k, v in values.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class TensorBoardTracker:
    def __init__(self, output_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ImportError(f"output.report_to=tensorboard needs the tensorboard package ({e}): "
                              "pip install tensorboard, or leave tensorboard out of output.report_to") from None
        self.writer = SummaryWriter(str(output_dir / "tensorboard"))

    def log(self, step: int, values: dict) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, output_dir: Path, run_name: str, project: Optional[str], config: dict):
        wandb = _require("wandb", "wandb")
        self.run = wandb.init(project=project or os.environ.get("WANDB_PROJECT", "lowmem-grpo"), name=run_name,
                              config=config, dir=str(output_dir))

    def log(self, step: int, values: dict) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class TrackioTracker:
    def __init__(self, output_dir: Path, run_name: str, project: Optional[str], config: dict):
        self.trackio = _require("trackio", "trackio")
        self.trackio.init(project=project or "lowmem-grpo", name=run_name, config=config)

    def log(self, step: int, values: dict) -> None:
        self.trackio.log(values, step=step)

    def close(self) -> None:
        self.trackio.finish()


def open_trackers(report_to, output_dir: str | Path, run_name: Optional[str] = None, project: Optional[str] = None,
                  config: Optional[dict] = None) -> list:
    """The trackers `report_to` names, started ('all': every one whose package is installed)."""
    names = report_targets(report_to)
    if names == ["all"]:
        names = [n for n in REPORT_TARGETS if _installed(n)]
    output_dir = Path(output_dir)
    run_name = run_name or output_dir.resolve().name
    opened = []
    try:
        for name in names:
            if name == "tensorboard":
                opened.append(TensorBoardTracker(output_dir))
            elif name == "wandb":
                opened.append(WandbTracker(output_dir, run_name, project, config or {}))
            else:
                opened.append(TrackioTracker(output_dir, run_name, project, config or {}))
    except BaseException:
        close_trackers(opened)  # e.g. wandb missing after tensorboard started: leave nothing half-open
        raise
    return opened


def close_trackers(trackers: list) -> None:
    """Close every tracker; one that fails to (a dashboard's network upload) is reported, not raised, so
    it neither hides the run's own error nor fails a run whose results are already on disk."""
    for t in trackers:
        try:
            t.close()
        except Exception as e:  # noqa: BLE001 - the others must still be closed
            logger.warning(f"closing {type(t).__name__} failed: {type(e).__name__}: {e}")
