"""An optional time limit on each reward-function call (rewards.reward_timeout).

A reward function that never returns (a catastrophic regex, a sandbox that hangs, a network call)
would stall the run forever without a word. With a limit, each call runs in a daemon worker thread
and the caller waits at most `seconds`; a call still running then raises RewardTimeout naming the
function, which stops the run (the trainer saves what it has first).

Why a thread: it works on every OS and from any thread, and passes the arguments without pickling
(a subprocess would need picklable functions and batches). SIGALRM would interrupt the call itself,
but only in the main thread of a Unix process. The cost, stated plainly: Python cannot kill a thread,
so the hung call keeps running in the background until the process exits (as a daemon it does not
keep the process alive), and a call stuck inside C code that never releases the GIL blocks the
waiting thread too. Without a limit (the default) functions are called directly.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Callable, Optional

from .base import RewardError, RewardFunction


class RewardTimeout(RewardError):
    """A reward-function call did not return within rewards.reward_timeout seconds."""


def call_with_timeout(fn: Callable, seconds: Optional[float], name: str, *args, **kwargs):
    """fn(*args, **kwargs), or RewardTimeout if it has not returned after `seconds` (None: no limit)."""
    if seconds is None:
        return fn(*args, **kwargs)
    result: dict = {}

    def run():
        try:
            result["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread below
            result["error"] = e

    worker = threading.Thread(target=run, name=f"reward:{name}", daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise RewardTimeout(f"reward function '{name}' did not return within reward_timeout={seconds:g} s; the run "
                            f"stops here. Make the function faster (or bound its own work), or raise "
                            f"rewards.reward_timeout. (The hung call keeps running in a background thread until "
                            f"the process exits.)")
    if "error" in result:
        raise result["error"]
    return result["value"]


def with_timeout(funcs: list[RewardFunction], seconds: Optional[float]) -> list[RewardFunction]:
    """The same reward functions, each call limited to `seconds` (unchanged when None)."""
    if seconds is None:
        return funcs
    out = []
    for f in funcs:
        limited = functools.wraps(f.fn)(functools.partial(call_with_timeout, f.fn, seconds, f.name))
        out.append(dataclasses.replace(f, fn=limited))
    return out
