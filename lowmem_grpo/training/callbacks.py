"""Callbacks: user code the training loop calls at the end of each step, when it logs, and when it saves.

Subclass `TrainerCallback` and override what you need (or pass any object with some of these
methods); give them to `GRPOTrainer(callbacks=[...])`, `Trainer(callbacks=[...])` or
`trainer.add_callback(cb)`. `trainer` is the running Trainer (GRPOTrainer's `loop`; `trainer.policy` is the model,
`trainer.step` the optimizer steps done); a callback stops the run after the current step with
`trainer.stop.request("why")`, which saves a checkpoint first, as Ctrl-C does. An exception raised in a
callback stops the run too (after saving what it has).
"""

from __future__ import annotations

EVENTS = ("on_step_end", "on_log", "on_save")


class TrainerCallback:
    """No-op base: override any of the methods below."""

    def on_step_end(self, trainer, step: int, metrics: dict) -> None:
        """After every optimizer step; `metrics` holds the step's values (reward, loss, kl, step_time, ...)."""

    def on_log(self, trainer, step: int, metrics: dict) -> None:
        """When the step's metrics are written (every logging_steps, and the last step)."""

    def on_save(self, trainer, step: int, path) -> None:
        """After a checkpoint folder is complete at `path`."""


def as_callback(callback):
    """A callback instance from an instance or a class (TRL accepts both); anything else is refused by name."""
    if isinstance(callback, type):
        callback = callback()
    if not any(callable(getattr(callback, e, None)) for e in EVENTS):
        raise TypeError(f"{callback!r} is not a callback: give a TrainerCallback subclass (or an object with "
                        f"{', '.join(EVENTS)} methods)")
    return callback


def notify(callbacks: list, event: str, *args) -> None:
    """Call `event` on every callback that defines it, in the order they were added."""
    for cb in callbacks:
        method = getattr(cb, event, None)
        if method is not None:
            method(*args)
