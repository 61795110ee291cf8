"""Pinned host memory of exactly the planned size: one block of plain memory, carved into views.

`HostArena(specs, pinned=)` allocates one anonymous mapping of `arena_bytes(...)` bytes (each buffer at an
`ALIGN`-byte offset, the total rounded to whole pages) and, on CUDA, page-locks exactly that range with
cudaHostRegister; `take(shape, dtype)` hands out the views in the planned order, each reporting
`is_pinned()`. Unlike per-tensor `pin_memory`, nothing is rounded up to a power of two; the planner counts
the same bytes. Unlocking happens only at known points (`release()`, a later arena's `pin()`,
`unlock_pending()`), after a device synchronize and never during a CUDA graph capture; an arena collected
while pinned queues its block for the next such point. Without CUDA the block is plain memory.

Design notes: docs/memory-modes.md ("The pinned host arena")
"""

from __future__ import annotations

import logging
import math
import mmap
import weakref
from collections import deque
from typing import Iterable, Sequence

import torch

log = logging.getLogger(__name__)

ALIGN = 64  # bytes between buffers: a cache line, as torch's own CPU allocator aligns (c10::gAlignment)
PAGE = 4096  # page-locking works on whole pages: the block starts on one and is a whole number of them
CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context, as torch pins


def buffer_bytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes of one buffer of `shape` and `dtype`."""
    return math.prod(shape) * dtype.itemsize


def round_up(n: int, multiple: int = ALIGN) -> int:
    """n rounded up to a multiple of `multiple` (a buffer's start: ALIGN; a block's end: PAGE)."""
    return -(-n // multiple) * multiple


def arena_bytes(sizes: Iterable[int]) -> int:
    """Bytes of an arena holding buffers of these byte sizes, in order: each starts on an ALIGN boundary,
    the total is rounded up to whole pages. What a HostArena allocates and pins, to the byte."""
    end = 0
    for size in sizes:
        end = round_up(end) + size
    return round_up(end, PAGE)


def _block(nbytes: int) -> torch.Tensor:
    """A (nbytes,) uint8 CPU tensor whose storage is exactly an anonymous private mapping of `nbytes` bytes:
    it starts on a page and holds nothing else (docs/memory-modes.md). The tensor keeps the mapping alive."""
    if nbytes == 0:  # (a mapping cannot be empty)
        return torch.empty(0, dtype=torch.uint8)
    if hasattr(mmap, "MAP_PRIVATE"):  # private: pages of this process only, copied on write after a fork
        buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    else:  # Windows: an anonymous mapping backed by the paging file
        buffer = mmap.mmap(-1, nbytes)
    return torch.frombuffer(buffer, dtype=torch.uint8)


def _capturing() -> bool:
    """Whether the current stream is capturing a CUDA graph (never without CUDA initialised)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def _reset_cuda_error() -> None:
    """Reset this thread's last CUDA runtime error, which a failed cudaHostRegister/Unregister leaves set:
    torch's next kernel-launch check (cudaGetLastError) would read it and raise it from an unrelated
    launch. torch's Python bindings do not expose cudaGetLastError, so a one-thread kernel is launched
    here and its launch check reads (and so resets) the error; that it raises is expected."""
    try:
        torch.cuda._sleep(1)
    except RuntimeError:
        pass


def _cuda_error(err) -> str:
    try:
        return f"cudaError {int(err)}: {torch.cuda.cudart().cudaGetErrorString(err)}"
    except (TypeError, RuntimeError):
        return f"cudaError {int(err)}"


def _register(base: torch.Tensor) -> None:
    err = torch.cuda.cudart().cudaHostRegister(base.data_ptr(), base.numel(), CUDA_HOST_REGISTER_PORTABLE)
    if int(err) != 0:
        _reset_cuda_error()
        raise MemoryError(f"cudaHostRegister of {base.numel() / 2**30:.2f} GiB of host memory failed "
                          f"({_cuda_error(err)}): too little RAM can be page-locked (ulimit -l, or WSL2's "
                          "pinned-memory limit); `lowmem-grpo plan` shows the pinned total, and "
                          "optim.offload_optimizer=false with train.reference_compute=cpu pins none")


def _unregister(base: torch.Tensor) -> None:
    """Unlock `base`'s pages; the device has finished its copies (`_unlock` synchronised). Raises
    RuntimeError, with CUDA's last-error state reset, if the driver refuses."""
    err = torch.cuda.cudart().cudaHostUnregister(base.data_ptr())
    if int(err) != 0:
        _reset_cuda_error()
        raise RuntimeError(f"cudaHostUnregister of {base.numel() / 2**30:.2f} GiB of host memory failed "
                           f"({_cuda_error(err)})")


_pending: deque = deque()  # blocks of collected or released arenas to unlock (appends are atomic)


def _unlock(bases: list) -> None:
    """Unlock these blocks now, or queue them for the next known point while a graph is being captured. All
    are tried; the first failure is raised after the rest."""
    if not bases:
        return
    if _capturing():
        _pending.extend(bases)
        return
    if torch.cuda.is_initialized():  # (nothing was registered, or copied, by a process without CUDA)
        torch.cuda.synchronize()  # copies queued on any stream of this device may still use the pages
    failure = None
    for base in bases:
        try:
            _unregister(base)
        except RuntimeError as e:
            failure = failure or e
    if failure is not None:
        raise failure


def unlock_pending() -> None:
    """Unlock the blocks of arenas collected while pinned (their finalizers only queue them), e.g. after
    dropping a trainer whose optimizer was not released, to give the pages back before the process ends.
    A known point: call it outside CUDA graph capture (while capturing it does nothing). Raises
    RuntimeError if an unlock fails."""
    bases = []
    while True:
        try:
            bases.append(_pending.popleft())
        except IndexError:  # (another thread may take the last one first)
            break
    _unlock(bases)


class HostArena:
    """Host buffers of planned shapes and dtypes in one block of exact size, page-locked on CUDA.

        arena = HostArena([(w.shape, w.dtype) for w in weights], pinned=torch.cuda.is_available())
        buffers = [arena.take(w.shape, w.dtype) for w in weights]   # in the planned order

    `nbytes` is what the block holds (alignment padding included) and, when `pinned`, what is
    page-locked: `arena_bytes` of the planned sizes. Every view's storage is the whole block, starting
    on the registered page. `release()` unlocks it; an arena garbage-collected while pinned is unlocked
    at the next known point (module docstring). Views handed out keep the memory itself alive, as
    ordinary memory, if they outlive the arena."""

    def __init__(self, specs: Sequence[tuple[Sequence[int], torch.dtype]], pinned: bool = False):
        self.specs = [(tuple(shape), dtype) for shape, dtype in specs]
        self.nbytes = arena_bytes(buffer_bytes(shape, dtype) for shape, dtype in self.specs)
        self._base = _block(self.nbytes)  # its storage is the registered range, to the byte
        self._next = 0  # the next spec to hand out
        self._offset = 0  # its byte offset, before alignment
        self.pinned = False
        self._finalizer = None
        if pinned:
            self.pin()

    def pin(self) -> None:
        """Page-lock the block (CUDA), after unlocking the blocks of collected arenas (a known point: raises
        as `release()` does). Pinning after the buffers are filled from other host memory lets each source
        be freed as it is copied: pages are only taken as they are first written."""
        if self.pinned or not self.nbytes:
            return
        unlock_pending()  # a known point: collected arenas' pages go before more are locked
        _register(self._base)
        self.pinned = True
        self._finalizer = weakref.finalize(self, _pending.append, self._base)  # no CUDA call in a finalizer
        self._finalizer.atexit = False  # at exit the driver unlocks everything; CUDA may be gone by then
        log.info("pinned %.3f GiB of host memory in one block (%d buffers)", self.nbytes / 2**30, len(self.specs))

    def take(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """The next planned buffer (uninitialised), which must be of this shape and dtype."""
        if self._next == len(self.specs):
            raise RuntimeError(f"this HostArena was planned for {len(self.specs)} buffers, all handed out")
        planned = self.specs[self._next]
        if planned != (tuple(shape), dtype):
            raise RuntimeError(f"HostArena buffer {self._next} was planned as {planned}, asked for "
                               f"{(tuple(shape), dtype)}: take buffers in the order they were planned")
        start = round_up(self._offset)
        size = buffer_bytes(shape, dtype)
        self._next += 1
        self._offset = start + size
        return self._base[start:start + size].view(dtype).view(shape)

    def release(self) -> None:
        """Unlock the pages now (after the device's pending copies), with those of collected arenas; the views
        stay valid, unpinned. While the current stream captures a CUDA graph they are queued instead, for
        the next known point (module docstring). Raises RuntimeError if cudaHostUnregister fails."""
        mine = []
        if self._finalizer is not None:
            mine = [self._finalizer.detach()[2][0]]  # (obj, func, args): args = (the block,)
            self._finalizer = None
            self.pinned = False
        _pending.extend(mine)
        unlock_pending()
