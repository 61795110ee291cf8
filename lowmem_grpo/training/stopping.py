"""How a run stops without losing work: Ctrl-C/SIGTERM ask the loop to stop after the current step
(which then saves and exits), a second signal stops at once, and so does the first while the step waits
on code that may never return (the user's reward functions); any error saves what the run has before
it propagates (an out-of-memory error first names the phase and the cheapest fix)."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
import traceback
from typing import Callable, Iterator, Optional

import torch

from ..config import Config
from ..phases import phase_of
from .checkpoint import CheckpointError

logger = logging.getLogger(__name__)

# What the main thread is waiting on that may never return, and since when (stop_at_once_inside).
_waiting_on: list[tuple[str, float]] = []


class StopRequest:
    """Why the loop should stop after the current step (a signal's name, or a caller's reason), or None."""

    def __init__(self):
        self.reason: Optional[str] = None

    def request(self, reason: str) -> None:
        self.reason = reason

    def _on_signal(self, signum, frame):
        name = signal.Signals(signum).name
        if self.reason is not None:  # second signal: stop now
            raise KeyboardInterrupt
        self.reason = name
        if _waiting_on:  # the step may never end: stop now, the last completed step is what gets saved
            what, since = _waiting_on[-1]
            logger.warning(f"{name} while {what} had run for {time.monotonic() - since:.0f} s: stopping now; this "
                           "step is abandoned and the last completed one is saved")
            raise KeyboardInterrupt
        logger.warning(f"{name}: saving a checkpoint after this step, then exiting "
              "(send it again to stop at once)")

    @contextlib.contextmanager
    def on_signals(self) -> Iterator["StopRequest"]:
        """SIGINT and SIGTERM request a stop while inside. Signal handlers can only be installed from the
        main thread: a trainer run in a worker thread keeps the default behaviour."""
        in_main = threading.current_thread() is threading.main_thread()
        handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)} if in_main else {}
        try:
            yield self
        finally:
            for s, h in handlers.items():
                signal.signal(s, h)


@contextlib.contextmanager
def stop_at_once_inside(what: str) -> Iterator[None]:
    """Inside (main thread), the first Ctrl-C/SIGTERM stops at once rather than after the step: the block
    runs code that may never return (a reward function with no rewards.reward_timeout), so a stop that
    waits for the step's end would be ignored. Nested blocks name the innermost `what`."""
    _waiting_on.append((what, time.monotonic()))
    try:
        yield
    finally:
        _waiting_on.pop()


@contextlib.contextmanager
def save_on_error(save: Callable[[], object], unsaved: Callable[[], bool]) -> Iterator[None]:
    """On any exception (KeyboardInterrupt included) call `save()` if `unsaved()`, then re-raise."""
    try:
        yield
    except BaseException as e:
        if isinstance(e, torch.OutOfMemoryError):  # free what the failed step's frames hold, so the save fits
            traceback.clear_frames(e.__traceback__)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        if unsaved() and not isinstance(e, CheckpointError):  # never die without saving (unless saving failed)
            try:
                logger.info(f"saved {save()} before stopping")
            except Exception as e:  # noqa: BLE001 - report, then let the original error through
                logger.error(f"could not save a checkpoint: {e}")
        raise


class RunOutOfMemory(torch.OutOfMemoryError):
    """The device ran out of memory during a step: the message names the phase and the cheapest setting
    to change; what the run had was saved first. Still a torch.OutOfMemoryError for callers that catch it."""


def _halve(value: int) -> int:
    return max(1, value // 2)


def _smaller_micro_batch(cfg: Config) -> str:
    """Half the rows per forward and backward. Accumulating gradients keeps the optimizer step as it was;
    on-device optimizer_in_backward cannot accumulate (an update per micro-batch), so there it takes twice
    the micro-batches per generation batch, and twice the updates."""
    t, half = cfg.train, _halve(cfg.train.per_device_train_batch_size)
    if t.optimizer_in_backward and not cfg.optim.offload_optimizer:
        spg = t.steps_per_generation or t.gradient_accumulation_steps
        return (f"per_device_train_batch_size={half} with steps_per_generation={spg * 2} (optimizer_in_backward "
                f"updates once per micro-batch: twice the updates per generation batch; optim.offload_optimizer=true "
                f"would keep one, with gradient_accumulation_steps)")
    return (f"per_device_train_batch_size={half} with gradient_accumulation_steps={t.gradient_accumulation_steps * 2} "
            f"(the same optimizer step)")


def _cheapest_fix(phase: Optional[str], cfg: Config) -> str:
    """The first change that applies, for the phase that ran out, cheapest (to quality and speed) first.
    A static table on purpose: the planner (memory/, a layer above the training loop) ranks changes by
    predicted bytes for a whole configuration; `lowmem-grpo plan` is where to get that."""
    m, g, t, o = cfg.model, cfg.generation, cfg.train, cfg.optim
    logprob_micro = t.logprob_micro_batch_size or t.per_device_train_batch_size
    fixes = {
        "rollout": [(g.generation_micro_batch_size > 1,
                     f"generation_micro_batch_size={_halve(g.generation_micro_batch_size)} "
                     "(the KV cache scales with it)"),
                    (True, f"max_completion_length={max(1, int(g.max_completion_length * 0.75))}")],
        "old log-probs": [(logprob_micro > 1, f"logprob_micro_batch_size={_halve(logprob_micro)}")],
        "reference log-probs": [(t.reference_compute == "stream"
                                 or (t.reference_compute == "auto" and t.device != "cpu"),
                                 "reference_compute=cpu (the reference runs on the CPU)"),
                                (logprob_micro > 1, f"logprob_micro_batch_size={_halve(logprob_micro)}")],
        "rewards": [(cfg.rewards.model_placement in ("gpu", "auto") and t.device != "cpu",
                     "rewards.model_placement=stream (the reward model's layers are copied in one at a time)"),
                    ((cfg.rewards.model_batch_size or t.per_device_train_batch_size) > 1,
                     f"rewards.model_batch_size="
                     f"{_halve(cfg.rewards.model_batch_size or t.per_device_train_batch_size)}")],
        "forward": [(not m.gradient_checkpointing, "gradient_checkpointing=true"),
                    (not m.offload_activations, "offload_activations=true"),
                    (t.per_device_train_batch_size > 1, _smaller_micro_batch(cfg))],
        "evaluation": [(cfg.eval.eval_batch_size > 1,
                        f"eval_batch_size={_halve(cfg.eval.eval_batch_size)} (evaluation decodes that many prompts "
                        f"at once: its KV cache scales with it)"),
                       (True, f"max_completion_length={max(1, int(g.max_completion_length * 0.75))}")],
        "optimizer": [(o.optimizer == "adamw", "optimizer=adamw_8bit (2 bytes of state per parameter instead of 8)"),
                      (not (t.optimizer_in_backward or o.offload_optimizer),
                       "optimizer_in_backward=true with gradient_accumulation_steps=1 (no full-model gradient)"),
                      (m.precision != "bf16_sr", "precision=bf16_sr (bf16 weights and gradients)")],
    }
    fixes["backward"] = fixes["forward"]
    for applies, fix in fixes.get(phase, []):
        if applies:
            return fix
    return "shorter completions or a smaller batch"


def out_of_memory_message(error: BaseException, cfg: Config, step: int, checkpoint: Optional[str]) -> str:
    phase = phase_of(error)
    if phase == "evaluation":  # (between steps: `step` of them are done)
        where = f"the evaluation after step {step}" if step else "the evaluation before training"
    else:
        where = (f"the {phase} phase" if phase else "a step (outside the marked phases)") + f" of step {step + 1}"
    saved = (f"Checkpoint {checkpoint} holds the run so far; continue with resume_from=latest after the change."
             if checkpoint else "No checkpoint exists yet (the run had not finished a step).")
    return (f"out of memory in {where}. Cheapest fix: {_cheapest_fix(phase, cfg)}. "
            f"`lowmem-grpo plan RECIPE` predicts the peak of every phase for these settings and lists the changes "
            f"that fit, cheapest first. {saved}\n  (torch: {str(error).splitlines()[0] if str(error) else 'OOM'})")
