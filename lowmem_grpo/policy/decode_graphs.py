"""CUDA graphs of the compiled decode step, one per (batch, length) bucket, owned by one rollout.

`StepGraphs` runs a bucket's first step as is, captures it with its `GraphRecorder`, and replays the
graph for the bucket's later steps: inputs are copied into its static buffers (ids, positions) and the
logits come out of its static (rows, V) fp32 buffer (returned as a copy). Everything captured must keep
its address until `StepGraphs.reset()`, at the rollout's end, which frees the graphs and their pool.
The recorder is injectable (static_decode.GRAPH_RECORDER), so CPU tests can check the bookkeeping.
Design notes: docs/rollouts.md
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional, Protocol

import torch
from torch import Tensor


class GraphCaptureError(RuntimeError):
    """Capturing a CUDA graph of the decode step failed (the cause is chained)."""


class Graph(Protocol):
    def replay(self) -> None: ...

    def reset(self) -> None: ...


class GraphRecorder(Protocol):
    def record(self, fn: Callable[[], object]) -> Graph:
        """A graph of what `fn` launches, which `fn` does not run."""


_live = [0]  # graphs recorded and not reset, in this process


def live_graphs() -> int:
    """CUDA graphs of the decode step recorded and not reset yet, over every rollout of this process."""
    return _live[0]


class CudaGraphRecorder:
    """Captures on a side stream into one private memory pool (made for this recorder: one rollout's)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)

    def record(self, fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        _clear_cublas_workspaces()  # cuBLAS takes its capture workspace from the pool, not an outside block
        torch.cuda.synchronize(self.device)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                fn()
            except BaseException:
                with contextlib.suppress(Exception):  # the capture's own error would hide fn's
                    graph.capture_end()
                raise
            graph.capture_end()
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        _clear_cublas_workspaces()  # nothing outside the graph reuses that workspace
        return graph


def _clear_cublas_workspaces() -> None:
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # (what Inductor's cudagraph trees call)
    if clear is not None:
        clear()


class StepGraphs:
    """One rollout's graphs of the decode step, one per bucket key, and the static buffers they read and
    write: ids, positions (rows,) long and the logits `out` (rows, V) fp32."""

    def __init__(self, recorder: GraphRecorder, rows: int, vocab: int, device: torch.device):
        self.recorder = recorder
        self.ids = torch.zeros(rows, dtype=torch.long, device=device)  # (rows,)
        self.pos = torch.zeros(rows, dtype=torch.long, device=device)  # (rows,)
        self.out = torch.zeros((rows, vocab), dtype=torch.float32, device=device)  # (rows, V)
        self.graphs: dict[tuple, Graph] = {}
        self.recorded = 0  # captures in this rollout
        self.replays = 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.ids, self.pos, self.out))

    def __call__(self, key: tuple, step: Callable[[Tensor, Tensor, Tensor], Tensor], input_ids: Tensor,
                 positions: Tensor) -> Tensor:
        """The step's (B, V) fp32 logits for B = len(input_ids) rows (a copy: the buffer is the next step's).
        `step(ids, positions, out)` runs the compiled step on the first B rows of the static buffers,
        writing its logits into `out`; `key` names its bucket (the same key, the same shapes and buffers)."""
        B = len(input_ids)
        ids, pos, out = self.ids[:B], self.pos[:B], self.out[:B]
        ids.copy_(input_ids)
        pos.copy_(positions)
        graph = self.graphs.get(key)
        if graph is None:
            step(ids, pos, out)  # this step, run as is: compiles what is new (never inside a capture)
            try:
                graph = self.recorder.record(lambda: step(ids, pos, out))
            except Exception as e:
                raise GraphCaptureError(f"capturing the decode step for bucket {key} failed: "
                                        f"{type(e).__name__}: {e}") from e
            self.graphs[key] = graph
            self.recorded += 1
            _live[0] += 1
        else:
            graph.replay()
            self.replays += 1
        return out.clone()

    def reset(self) -> None:
        """Drop every graph (their pool returns to the allocator) and the static buffers."""
        for graph in self.graphs.values():
            graph.reset()
        _live[0] -= len(self.graphs)
        self.graphs = {}
        self.ids = self.pos = self.out = None


def default_recorder(device: torch.device) -> Optional[GraphRecorder]:
    """CUDA graphs on a CUDA device; none elsewhere (the compiled step then runs as is)."""
    return CudaGraphRecorder(device) if device.type == "cuda" else None
