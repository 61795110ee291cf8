"""How a run stops without losing work: Ctrl-C/SIGTERM ask the loop to stop after the current step
(which then saves and exits), a second signal stops at once, and so does the first when the step still
waits, seconds later, on code that may never return (the user's reward functions); any error saves what
the run has before it propagates (an out-of-memory error first names the phase and the cheapest fix)."""

from __future__ import annotations

import _thread
import contextlib
import logging
import signal
import threading
import traceback
from typing import Callable, Iterator, Optional

import torch

from ..config import Config
from ..phases import phase_of
from .checkpoint import CheckpointError

logger = logging.getLogger(__name__)

# Seconds a stop request waits for code that may never return (a reward function) before it stops the run
# at once, abandoning the step (stoppable_wait).
STOP_GRACE_S = 5.0


class _Wait:
    """One stoppable_wait block: what the main thread waits on, and the timer a stop request started."""

    def __init__(self, what: str):
        self.what, self.timer = what, None


_waiting_on: list[_Wait] = []  # the main thread's stoppable_wait blocks, innermost last


class StopRequest:
    """Why the loop should stop after the current step (a signal's name, or a caller's reason), or None."""

    def __init__(self):
        self.reason: Optional[str] = None
        self._overdue: Optional[str] = None  # why a stop that waited STOP_GRACE_S in vain stops now

    def request(self, reason: str) -> None:
        self.reason = reason

    def _on_signal(self, signum, frame):
        name = signal.Signals(signum).name
        if self.reason is not None:  # second signal (or the grace ran out): stop now
            if self._overdue:
                logger.warning(self._overdue)
            raise KeyboardInterrupt
        self.reason = name
        if _waiting_on:  # the step waits on code that may never return: give it STOP_GRACE_S
            wait = _waiting_on[-1]
            logger.warning(f"{name}: saving a checkpoint after this step, which is waiting on {wait.what}; if they "
                           f"have not returned within {STOP_GRACE_S:g} s the run stops then, saving the last "
                           "completed step (send it again to stop at once)")
            wait.timer = threading.Timer(STOP_GRACE_S, self._stop_if_still_waiting, args=(wait, name))
            wait.timer.daemon = True
            wait.timer.start()
            return
        logger.warning(f"{name}: saving a checkpoint after this step, then exiting "
                       "(send it again to stop at once)")

    def _stop_if_still_waiting(self, wait: _Wait, name: str) -> None:
        """The grace timer (its own thread): still waiting, signal the main thread, whose handler stops now."""
        if not any(w is wait for w in _waiting_on):
            return
        self._overdue = (f"{wait.what} did not return within {STOP_GRACE_S:g} s of {name}: stopping now; this step "
                         "is abandoned and the last completed one is saved")
        if hasattr(signal, "pthread_kill"):  # a real signal also interrupts a blocking call
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        else:
            _thread.interrupt_main()

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
def stoppable_wait(what: str) -> Iterator[None]:
    """Inside (main thread), a Ctrl-C/SIGTERM that asks to stop after the step waits at most STOP_GRACE_S
    for the block, then stops the run at once: the block runs code that may never return (a reward function
    with no rewards.reward_timeout), and a stop that waited for the step's end would be ignored."""
    wait = _Wait(what)
    _waiting_on.append(wait)
    try:
        yield
    finally:
        _waiting_on.remove(wait)
        if wait.timer is not None:
            wait.timer.cancel()


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
    logprob_micro = t.logprob_rows
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
                    (t.per_device_train_batch_size > 1, _smaller_micro_batch(cfg)),
                    (not m.offload_weights and t.device != "cpu",
                     "offload_weights=true with offload_optimizer=true and rollout_quantization=nf4 (the decoder "
                     "layers' weights stay in host RAM and cross to the GPU one at a time; rollouts from a 4-bit "
                     "copy)")],
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
