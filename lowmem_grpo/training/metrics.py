"""Run logs: output_dir/metrics.jsonl (one object per logged step), completions.jsonl (sampled
completions with their rewards, to catch reward hacking by reading), and the trackers of
output.report_to (trackers.py). Also the step's metric arithmetic (`StepSums`, `step_means`) and the
renaming of internal metric names to the reported, TRL-style ones (`trl_names`, `eval_metrics`)."""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from ..transfers import count_sync
from .output_dir import cannot_write
from .trackers import close_trackers, open_trackers, scalars

logger = logging.getLogger(__name__)


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: the allocator's peak since the last reset (reset every step). CPU: the process's peak RSS."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


class StepSums:
    """The loss and the token-weighted metric sums of one optimizer step's micro-batches, kept where the
    loss is computed and read on the host once per step: on a GPU every host read of a device number
    (`.item()`) waits for all queued work (a pipeline drain), and per micro-batch that was six of them.

    The additions are in fp64, as the Python floats they replace were: each value is widened exactly,
    multiplied by its integer token count and added in the same order, so the sums are bit for bit
    those of `loss.item()` and `v.item() * n` summed in Python."""

    def __init__(self):
        self.loss: Optional[torch.Tensor] = None  # fp64 0-dim: sum of the micro-batches' losses
        self.sums: dict[str, torch.Tensor] = {}  # name -> fp64 0-dim: sum of metric * tokens
        self._host: Optional[tuple[float, dict[str, float]]] = None  # the last read, until the next add

    @staticmethod
    def _added(total: Optional[torch.Tensor], value: torch.Tensor) -> torch.Tensor:
        value = value.detach().to(torch.float64)
        # from an fp64 zero, as from the Python 0.0 before: 0.0 + (-0.0) is 0.0
        return (torch.zeros_like(value) if total is None else total) + value

    def add_loss(self, loss: torch.Tensor) -> None:
        self.loss = self._added(self.loss, loss)
        self._host = None

    def add_metrics(self, metrics: dict[str, torch.Tensor], tokens: int) -> None:
        """metrics: 0-dim tensors (token means over the micro-batch); tokens: its masked token count."""
        for name, value in metrics.items():
            self.sums[name] = self._added(self.sums.get(name), value.detach().to(torch.float64) * tokens)
        self._host = None

    def read(self) -> tuple[float, dict[str, float]]:
        """(loss sum, {name: token-weighted sum}) on the host: one device read for all of them."""
        if self._host is None:
            names = sorted(self.sums)
            values = [self.sums[k] for k in names] + ([self.loss] if self.loss is not None else [])
            host = torch.stack(values).tolist() if values else []  # the step's one sync
            if values:
                count_sync()
            loss = host.pop() if self.loss is not None else 0.0
            self._host = (loss, dict(zip(names, host)))
        return self._host[0], dict(self._host[1])


@dataclass
class StepTotals:
    """One optimizer step's sums, on the host: loss (sum of the micro-batches' losses), sums (token-weighted
    metric sums), tokens (decoder positions computed), computed (completion tokens that learned) and
    backwards (micro-batches that learned)."""

    loss: float
    sums: dict[str, float]
    tokens: int
    computed: int
    backwards: int


class StepTally:
    """What the trainer adds up over one optimizer step's micro-batches: the loss and metric sums on the
    device (StepSums), and on the host the micro-batches that learned and their tokens."""

    def __init__(self):
        self.sums = StepSums()
        self.tokens = self.computed = self.backwards = 0
        self.names: set[str] = set()  # every metric name a learning micro-batch gave

    def add(self, loss: torch.Tensor, metrics: dict[str, torch.Tensor], tokens: Optional[int]) -> None:
        """A micro-batch's loss, and its metrics weighted by its completion `tokens` (None: it learned
        nothing, so its metrics are not the step's; the loss still is, a zero)."""
        self.sums.add_loss(loss)
        if tokens is not None:
            self.sums.add_metrics(metrics, tokens)
        self.names.update(metrics)

    def loss_is_finite(self) -> bool:
        """Whether the losses so far are finite (a host read: the optimizer in backward asks before it steps)."""
        return bool(np.isfinite(self.sums.read()[0]))

    def count(self, positions: int, completion_tokens: int) -> None:
        """A micro-batch that learned: the decoder positions it computed and its completion tokens."""
        self.tokens += positions
        self.computed += completion_tokens
        self.backwards += 1

    def totals(self) -> StepTotals:
        """This rank's totals: the step's one host read of the device sums. Every metric name seen is in
        `sums` (0 where only micro-batches that learned nothing gave it), so ranks sum the same names."""
        loss, sums = self.sums.read()
        return StepTotals(loss, {k: sums.get(k, 0.0) for k in sorted(self.names)}, self.tokens, self.computed,
                          self.backwards)


# The loss's metric names -> TRL's log names
TRL_STEP_NAMES = {"clip_ratio": "clip_ratio/region_mean", "clip_ratio_low": "clip_ratio/low_mean",
                  "clip_ratio_high": "clip_ratio/high_mean", "vespo_phi_mean": "vespo/phi_seq_mean",
                  "entropy_mask_ratio": "entropy/mask_ratio"}

# Metrics known only for the tokens a backward computed (not the skipped zero-advantage completions)
COMPUTED_ONLY = ("entropy", "vespo_phi_mean", "entropy_mask_ratio")

# evaluate()'s keys -> the names logged during training. transformers' Trainer prefixes evaluation
# metrics with "eval_" and calls the wall time eval_runtime; the length follows TRL's completions/ names.
EVAL_NAMES = {"seconds": "eval_runtime", "mean_length": "eval_completions/mean_length"}


def step_means(sums: dict[str, float], *, num_items: int, computed: int, backwards: int) -> dict[str, float]:
    """A step's token-weighted metric sums -> means under the loss's names. Skipped completions have no
    clipped tokens (A == 0), so clip ratios are over every token of the step (`num_items`); entropy is
    known only for the tokens computed (so are vespo's phi, weighted by tokens here, and the entropy
    mask's fraction). With no backward, no token was clipped and (beta == 0) the KL
    is 0; entropy is unknown."""
    out = {k: v / max(computed if k in COMPUTED_ONLY else num_items, 1) for k, v in sums.items()}
    if not backwards:
        out.update(kl=0.0, clip_ratio=0.0, clip_ratio_low=0.0, clip_ratio_high=0.0)
    return out


def trl_names(metrics: dict) -> dict:
    """`metrics` with the loss's names replaced by TRL's (TRL_STEP_NAMES), in place; renamed keys move
    to the end."""
    for ours, trl in TRL_STEP_NAMES.items():
        if ours in metrics:
            metrics[trl] = metrics.pop(ours)
    return metrics


def eval_metrics(result: dict) -> dict:
    """An evaluate() result as a metrics.jsonl row: eval_reward, eval_pass_rate/<name>,
    eval_rewards/<name>/mean, eval_completions/mean_length, eval_samples, eval_runtime."""
    return {EVAL_NAMES.get(k, f"eval_{k}"): v for k, v in result.items()}


def _clean(value):
    """JSON-safe scalars: tensors -> floats, NaN/inf -> None (JSON has no NaN)."""
    if isinstance(value, torch.Tensor):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _append(folder: Path, name: str, text: str) -> None:
    """Append to folder/name; a full disk or an unwritable folder is an OutputDirError naming the fix."""
    try:
        with open(folder / name, "a") as f:
            f.write(text)
    except OSError as e:
        raise cannot_write(folder, name, e) from None


def append_metrics_row(output_dir: str | Path, step: int, values: dict) -> dict:
    """Append {"step": step, **values} (JSON-safe) to output_dir/metrics.jsonl; returns the row."""
    row = {"step": step, **{k: _clean(v) for k, v in values.items()}}
    _append(Path(output_dir), "metrics.jsonl", json.dumps(row) + "\n")
    return row


class RunLog:
    """Appends to the run's JSONL files; opened in append mode so a resumed run continues them."""

    def __init__(self, output_dir: str | Path, report_to="none", resume_step: Optional[int] = None,
                 run_name: Optional[str] = None, project: Optional[str] = None, config: Optional[dict] = None):
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        if resume_step is not None:  # drop lines written after the checkpoint we resume from
            for name in ("metrics.jsonl", "completions.jsonl"):
                _truncate_after(self.dir / name, resume_step)
        self.trackers = open_trackers(report_to, self.dir, run_name, project, config)

    def _append(self, name: str, text: str) -> None:
        _append(self.dir, name, text)

    def metrics(self, step: int, values: dict) -> None:
        row = append_metrics_row(self.dir, step, values)
        for tracker in self.trackers:
            tracker.log(step, scalars(row))

    def completions(self, step: int, samples: list[dict]) -> None:
        self._append("completions.jsonl", "".join(
            json.dumps({"step": step, **{k: _clean(v) for k, v in s.items()}}, default=str) + "\n" for s in samples))

    def close(self) -> None:
        close_trackers(self.trackers)


def _parsed_lines(path: Path) -> list[tuple[str, dict]]:
    """(line, row) for every complete JSON line. A line that does not parse (a run killed mid-write leaves
    a torn last line) is dropped with a warning naming the file and line."""
    out = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            logger.warning(f"{path}: dropping line {number}, which is not complete JSON (a run killed while "
                           f"writing it): {line[:80]!r}")
            continue
        out.append((line, row))
    return out


def _truncate_after(path: Path, step: int) -> None:
    """Keep the rows of steps <= `step` (the checkpoint resumed from); rewrite the file atomically."""
    if not path.is_file():
        return
    kept = [line for line, row in _parsed_lines(path) if isinstance(row, dict) and row.get("step", 0) <= step]
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write("".join(line + "\n" for line in kept))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_metrics(output_dir: str | Path) -> list[dict]:
    path = Path(output_dir) / "metrics.jsonl"
    return [row for _, row in _parsed_lines(path)] if path.is_file() else []


class NullLog:
    """RunLog's stand-in on ranks other than 0 under torchrun: rank 0 writes the run's files."""

    def metrics(self, step: int, values: dict) -> None:
        pass

    def completions(self, step: int, samples: list[dict]) -> None:
        pass

    def close(self) -> None:
        pass
