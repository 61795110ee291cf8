"""The offloaded optimizer's update thread: `UpdateThread`, a mixin of offload.py's `OffloadedOptimizer`.

`end_step` hands a step's host updates (clip, inner step, upload; `_update_all`) to one long-lived daemon
thread and returns; every parameter handed over gets a readiness signal. `wait_in_forward` makes each
module's forward (and the fused loss head's weight read) wait for exactly its own parameters;
`synchronize()` waits for all. An error on the worker is re-raised once on the caller's thread at its next
wait. Stochastic-rounding draws come from a copy of torch's global CPU generator, which the global one
adopts once all updates are waited for, so results match an inline update bit for bit.

The host class provides `params`, `on_cuda`, `side` (its CUDA side stream), `_index_of` and
`_update_all(order, coef, lrs, generator, ready)`, and calls `_init_update_thread` before first use.

Design notes: docs/memory-modes.md ("The update thread")
"""

from __future__ import annotations

import logging
import queue
import threading
import weakref
from typing import Optional

import torch
from torch import nn

from .optimizer_in_backward import weakly

logger = logging.getLogger("lowmem_grpo.optim.offload")  # the offloaded optimizer's messages, one logger

UPDATE_THREAD = True  # the default: the host update runs on a worker thread


class UpdateThread:
    """The worker thread, the readiness signals and the per-step rounding generator (module docstring)."""

    def _init_update_thread(self, update_thread: bool) -> None:
        """Used once the forward waits for it (`wait_in_forward`); until then end_step updates inline."""
        self.update_thread = update_thread
        self._forward_waits = False
        self._waiting_models: set[int] = set()  # ids of the models given to wait_in_forward
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._worker: Optional[threading.Thread] = None
        self._ready: dict[int, threading.Event] = {}  # handed-over updates not yet waited for, by index
        self._uploaded: dict[int, torch.cuda.Event] = {}  # CUDA: each one's upload, on the side stream
        self._step_done = threading.Event()  # the worker finished the step handed to it
        self._step_done.set()
        self._handed = False  # an update was handed over since the last synchronize (CUDA: wait for its uploads)
        self._error: Optional[BaseException] = None  # raised by the worker, re-raised at the next wait
        self._step_generator = None  # (generator, global state it copied) of the step in flight
        self._warned_rng = False

    def _rounding_generator(self) -> torch.Generator:
        """The step's stochastic-rounding draws: a copy of torch's global CPU generator as it stands, so the
        updates draw the numbers they drew from the global generator before (the plain path's: the tests
        compare bit for bit) on whichever thread they run, never racing the caller's own draws. The global
        generator takes the copy's final state once every update is done and waited for (`_adopt_rng`):
        where the plain path's step would have left it, so the caller's later sampling is the plain path's
        too, and `torch.manual_seed` and a checkpoint's RNG state (saved after `synchronize()`) fix the run."""
        start = torch.get_rng_state()
        generator = torch.Generator()
        generator.set_state(start)
        self._step_generator = (generator, start)
        return generator

    def _adopt_rng(self) -> None:
        """Move the global generator to where the step's updates left their copy (once they are done). If the
        caller drew from it in the meantime (before a forward or synchronize() waited for the updates), it
        is left where those draws took it: moving it back would hand out their numbers again."""
        pending, self._step_generator = self._step_generator, None
        if pending is None:
            return
        generator, start = pending
        if torch.equal(torch.get_rng_state(), start):
            torch.set_rng_state(generator.get_state())
        elif not self._warned_rng:
            self._warned_rng = True
            logger.warning("torch's global CPU generator was drawn from while the offloaded optimizer's update "
                           "was still running (after end_step, before a forward or synchronize()): this run's "
                           "random numbers now differ from a run without the update thread; call "
                           "optimizer.synchronize() before such draws to keep them the same")

    def wait_in_forward(self, model: nn.Module, heads=()) -> None:
        """Make every use of the weights wait for their own updates: a forward pre-hook on each module of
        `model` that owns parameters directly, and the fused loss heads' weight (`heads`: policy/model.py
        `Head`, whose weight is read without its module's forward). Until this is called, end_step
        updates inline. Idempotent per model.

        A forward traced by torch.compile does not wait (the hook returns at once when compiling, so it adds
        no graph break): the compiled decode step (policy/static_decode.py) runs only after its rollout's
        prefill, an eager forward of the same modules, has waited for all of them, and neither the compiled
        code nor a CUDA graph replay of it calls the hooks. Code that compiles another forward of the model
        calls `synchronize()` before it, as the trainer does before its compiled layers (model.torch_compile)."""
        if id(model) in self._waiting_models:
            return

        def waits_for(indices: list[int], wait=weakly(self._wait_for)):
            def hook(_module, _args):
                if torch.compiler.is_compiling():
                    return
                wait(indices)
            return hook
        for module in model.modules():
            indices = [self._index_of[p] for p in module.parameters(recurse=False) if p in self._index_of]
            if indices:
                module.register_forward_pre_hook(waits_for(indices))
        for head in heads:
            if head.weight_source is None:  # (the tied head's leaf waits itself: head_leaf)
                output = head.output
                indices = [self._index_of[p] for p in output.parameters(recurse=False) if p in self._index_of]
                head.weight_source = lambda output=output, wait=weakly(self._wait_for), indices=indices: (
                    wait(indices), output.weight)[1]
        self._waiting_models.add(id(model))
        self._forward_waits = True

    def _hand_over(self, order: list[int], coef: Optional[torch.Tensor], lrs: list[float],
                   generator: torch.Generator) -> None:
        """Queue the step's updates on the worker thread (started on first use) and return."""
        if self._worker is None or not self._worker.is_alive():
            # The thread holds the optimizer only through a weak reference, so an optimizer nobody uses any
            # more (a notebook's finished trainer) is collected with its host RAM and pinned blocks; its
            # finalizer then ends the thread. The finalizer also runs at interpreter exit (atexit), and it
            # joins the thread there: a daemon thread still inside the C++ update when Python finalizes is
            # torn down mid-call, which aborts the process ("terminate called without an active exception").
            self._worker = threading.Thread(target=_work, args=(weakref.ref(self), self._jobs),
                                            name="lowmem-grpo-host-update", daemon=True)
            self._worker.start()
            weakref.finalize(self, _stop_worker, self._jobs, self._worker)
        ready = {index: threading.Event() for index in order}
        self._ready.update(ready)
        self._handed = True
        self._step_done.clear()
        self._jobs.put((order, coef, lrs, generator, ready))

    def _run_job(self, job: tuple) -> None:
        """One optimizer step's updates on the worker. An error is kept for the caller's next wait, and
        every readiness signal of the job is set so that no wait hangs on an update that will not come."""
        try:
            self._update_all(*job)
        except BaseException as error:  # noqa: BLE001 -- re-raised on the caller's thread
            self._error = error
        finally:
            for event in job[-1].values():
                event.set()
            self._step_done.set()

    def _wait_for(self, indices: list[int]) -> None:
        """Wait until these parameters' updates are done and (CUDA) make the current stream wait for their
        uploads; re-raise an error of the worker. Free when nothing is pending."""
        if not self._ready:
            self._raise_worker_error()
            return
        for index in indices:
            ready = self._ready.pop(index, None)
            if ready is None:
                continue
            ready.wait()
            self._raise_worker_error()
            uploaded = self._uploaded.pop(index, None)
            if uploaded is not None:
                torch.cuda.current_stream(self.params[index].device).wait_event(uploaded)
        if not self._ready:  # every update waited for: the step's draws are all made
            self._adopt_rng()

    def synchronize(self) -> None:
        """Wait for every handed-over update (and, on CUDA, make the current stream wait for the uploads);
        re-raise an error of the worker. Call it before reading the weights other than through a forward
        (a checkpoint's save, save_pretrained); the optimizer's own state_dict, load_state_dict,
        begin_step and refresh_host_weights call it."""
        self._step_done.wait()
        self._ready, self._uploaded = {}, {}
        self._adopt_rng()
        if self._handed and self.on_cuda:
            torch.cuda.current_stream(self.params[0].device).wait_stream(self.side)
        self._handed = False
        self._raise_worker_error()

    def _raise_worker_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error


def _stop_worker(jobs: queue.SimpleQueue, worker: threading.Thread) -> None:
    """End the update thread after the job it is running (the optimizer's finalizer, at collection or exit)."""
    jobs.put(None)
    if worker is not threading.current_thread():  # (collected on the worker itself: it ends on its own)
        worker.join()


def _work(optimizer_ref: "weakref.ref[UpdateThread]", jobs: queue.SimpleQueue) -> None:
    """The update thread's loop: one job per optimizer step, until None (release_host_memory, or the
    optimizer's finalizer) or the optimizer is gone."""
    while True:
        job = jobs.get()
        optimizer = optimizer_ref() if job is not None else None
        if optimizer is None:
            return
        optimizer._run_job(job)
        del optimizer  # no strong reference while waiting for the next job
