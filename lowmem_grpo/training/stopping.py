"""How a run stops without losing work: Ctrl-C/SIGTERM ask the loop to stop after the current step
(which then saves and exits), a second signal stops at once, and any error saves what the run has
before it propagates."""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Callable, Iterator, Optional


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
        print(f"\n[lowmem-grpo] {name}: saving a checkpoint after this step, then exiting "
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
def save_on_error(save: Callable[[], object], unsaved: Callable[[], bool]) -> Iterator[None]:
    """On any exception (KeyboardInterrupt included) call `save()` if `unsaved()`, then re-raise."""
    try:
        yield
    except BaseException:
        if unsaved():  # never die without saving what the run has
            try:
                print(f"[lowmem-grpo] saved {save()} before stopping")
            except Exception as e:  # noqa: BLE001 - report, then let the original error through
                print(f"[lowmem-grpo] could not save a checkpoint: {e}")
        raise
