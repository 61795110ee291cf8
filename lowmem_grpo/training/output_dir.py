"""One run per output_dir: the folder is checked before anything loads, and a lock keeps a second live run out.

A folder that holds another run (metrics.jsonl, completions.jsonl or a checkpoint-<step> folder) is refused
unless this run continues it (output.resume_from) or the user asked to start over in it
(output.overwrite_output_dir=true, which deletes that run's files, and logs each one it deletes). Files
lowmem-grpo does not write are never touched.

The lock is an flock on output_dir/.lowmem-grpo.lock, held from the trainer's setup to the end of train().
The OS drops it when the process dies, so a crash leaves no stale lock; a pid file would need a liveness
check, which a reused pid or a process on another machine sharing the folder defeats. Under torchrun only
rank 0 checks and locks; the other ranks raise rank 0's error, if any. Design notes: docs/training.md
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import re
import shutil
import socket
import weakref
from pathlib import Path
from typing import IO, Optional

from ..config import ConfigError
from ..config.schema import OutputConfig

try:
    import fcntl
except ImportError:  # Windows: no flock; the folder check still runs
    fcntl = None

logger = logging.getLogger(__name__)

LOCK_FILE = ".lowmem-grpo.lock"
# What a run writes into output_dir: the logs that mark a folder as holding a run, and the rest of its files
RUN_LOGS = ("metrics.jsonl", "completions.jsonl")
RUN_FILES = RUN_LOGS + ("eval_start.json", "eval_end.json", "eval_completions.jsonl", "run.png", "tensorboard")
_CHECKPOINT = re.compile(r"^(checkpoint-\d+|\.tmp-checkpoint-.+)$")


class OutputDirError(ConfigError):
    """output_dir cannot take this run: it holds another run, another live run holds its lock, it is not a
    writable folder, or its disk is full. The message names the folder and the fix, on one line."""


def disk_full(e: BaseException) -> bool:
    """Whether an error is a full disk (or quota), also when a library wrapped the OSError in its own."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return "No space left on device" in str(e) or "os error 28" in str(e)


def cannot_write(folder: Path, what: str, e: OSError) -> OutputDirError:
    """The one-line error for an OSError while writing `what` in output_dir `folder`."""
    if disk_full(e):
        free = shutil.disk_usage(folder).free if folder.is_dir() else 0
        return OutputDirError(f"no space left on the disk holding output_dir {folder} while writing {what} "
                              f"({free / 2**20:.0f} MiB free): free space there or set output_dir on a bigger "
                              "disk, then continue with resume_from=latest")
    return OutputDirError(f"cannot write {what} in output_dir {folder} ({e.strerror or e}): set output_dir to a "
                          "folder this user can write to (it is created if missing)")


# This process's locks by folder: a Trainer built for a folder takes it over from an earlier Trainer of
# this process that is not training (a notebook cell run again), never from one inside train().
_HELD: "weakref.WeakValueDictionary[str, OutputLock]" = weakref.WeakValueDictionary()


class OutputLock:
    """An exclusive flock on output_dir/.lowmem-grpo.lock; acquire() and release() may be repeated."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.running = False  # inside train(): no other Trainer of this process may take the lock over
        self.taken_over = False  # a Trainer built later for the folder took it: this one may not train there
        self._file: Optional[IO[str]] = None

    @property
    def held(self) -> bool:
        return self._file is not None

    def acquire(self, running: bool = False, take_over: bool = False) -> None:
        """Take the lock (a no-op while held); OutputDirError if another process holds it, or another Trainer
        of this process. With `take_over` (a Trainer being built), an earlier Trainer of this process that is
        not training gives it up for good: the folder's check was made for the new one."""
        if self.taken_over:
            raise OutputDirError(f"output_dir {self.folder} was claimed by a Trainer built after this one: train "
                                 "that one, or build a new Trainer (resume_from=latest continues the folder's run)")
        if self._file is None:
            self._take(take_over)
        self.running = running

    def _take(self, take_over: bool) -> None:
        key = str(self.folder.resolve())
        earlier = _HELD.get(key)
        if take_over and earlier is not None and earlier is not self and not earlier.running:
            earlier.release()
            earlier.taken_over = True
        path = self.folder / LOCK_FILE
        try:
            f = os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT, 0o644), "r+")
        except OSError as e:
            raise cannot_write(self.folder, LOCK_FILE, e) from None
        if fcntl is not None:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                holder = f.read().strip() or "a process"
                f.close()
                here = holder == _me()
                raise OutputDirError(
                    f"output_dir {self.folder} is in use by another lowmem-grpo run ({holder}"
                    f"{', a Trainer of this process that is training' if here else ''}): wait for it to finish or "
                    f"stop it{' (or let its train() finish)' if here else ''}, or set output_dir to another folder"
                ) from None
        try:
            f.seek(0)
            f.truncate()
            f.write(_me() + "\n")
            f.flush()
        except OSError as e:
            f.close()
            raise cannot_write(self.folder, LOCK_FILE, e) from None
        self._file = f
        _HELD[key] = self

    def release(self) -> None:
        """Drop the lock (closing the file drops the flock); the file stays, holding no one's name."""
        self.running = False
        f, self._file = self._file, None
        if f is not None:
            try:
                f.seek(0)
                f.truncate()
            except OSError:
                pass
            f.close()

    def __del__(self):
        self.release()


def _me() -> str:
    return f"pid {os.getpid()} on {socket.gethostname()}"


def run_files(folder: Path) -> list[str]:
    """The names of another run's files in `folder`: its logs and checkpoint folders (sorted), or []."""
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if p.name in RUN_LOGS or _CHECKPOINT.match(p.name))


def _inside(checkpoint: str, folder: Path) -> bool:
    return Path(checkpoint).expanduser().resolve().parent == folder.resolve()


def _overwrite(folder: Path) -> None:
    """Delete the previous run's files (only those a run writes), logging each."""
    doomed = sorted(p for p in folder.iterdir() if p.name in RUN_FILES or _CHECKPOINT.match(p.name))
    for p in doomed:
        logger.warning(f"overwrite_output_dir=true: deleting {p}")
        try:
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        except OSError as e:
            raise cannot_write(folder, f"(deleting) {p.name}", e) from None


def check_previous_run(folder: Path, out: OutputConfig) -> None:
    """Refuse a folder that holds another run unless resume_from continues it or overwrite_output_dir is set."""
    found = run_files(folder)
    resume = out.resume_from
    continues = resume == "latest" or (resume is not None and _inside(resume, folder))
    if out.overwrite_output_dir and continues:
        raise OutputDirError(f"overwrite_output_dir=true deletes the run in {folder}, and resume_from={resume} "
                             "continues it: set only one of them")
    if not found or continues:
        return
    if out.overwrite_output_dir:
        _overwrite(folder)
        return
    shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
    extra = f", and resume_from={resume} is a checkpoint of another folder" if resume else ""
    raise OutputDirError(f"output_dir {folder} already holds a run ({shown}){extra}: continue it with "
                         "resume_from=latest, start over in it with overwrite_output_dir=true (deletes its "
                         "checkpoints and logs), or set output_dir to a new folder")


def _claim(out: OutputConfig, check_previous: bool) -> OutputLock:
    folder = Path(os.path.expanduser(out.output_dir))
    if folder.exists() and not folder.is_dir():
        raise OutputDirError(f"output_dir {folder} is a file, not a folder: set output_dir to a folder (it is "
                             "created if missing)")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise cannot_write(folder.parent if not disk_full(e) else folder, f"the folder {folder.name}", e) from None
    lock = OutputLock(folder)
    lock.acquire(take_over=True)
    try:
        if check_previous:
            check_previous_run(folder, out)
    except BaseException:
        lock.release()
        raise
    return lock


def refuse_previous_run(out: OutputConfig, world) -> None:
    """check_previous_run on rank 0, its verdict on every rank (after a claim made with check_previous=False)."""
    _on_main(lambda: check_previous_run(Path(os.path.expanduser(out.output_dir)), out), world)


def claim(out: OutputConfig, world, check_previous: bool = True) -> Optional[OutputLock]:
    """Check output_dir and lock it for this run (rank 0); None on the other ranks. Under torchrun every
    rank learns rank 0's verdict (a collective), so all of them stop with its OutputDirError. Without
    `check_previous`, a folder that holds another run is checked later (`refuse_previous_run`)."""
    return _on_main(lambda: _claim(out, check_previous), world)


def _on_main(fn, world):
    """fn() on rank 0 (its result; None elsewhere); an OutputDirError there is raised on every rank."""
    result, error = None, None
    if world.is_main:
        try:
            result = fn()
        except OutputDirError as e:
            if not world.distributed:
                raise
            error = str(e)
    if world.distributed:
        verdict = world.gather_objects(error)[0]
        if verdict is not None:
            raise OutputDirError(verdict)
    return result


def released_on_error(init):
    """Decorates Trainer.__init__: a setup that fails releases the output_dir lock it took."""
    @functools.wraps(init)
    def wrapped(self, *args, **kwargs):
        try:
            init(self, *args, **kwargs)
        except BaseException:
            lock = getattr(self, "output_lock", None)
            if lock is not None:
                lock.release()
            raise
    return wrapped
