"""model.torch_compile: the policy's decoder layers compiled with torch.compile for the training passes.

    compiled = CompiledLayers(decoder_layers(decoder).layers, backend="inductor", mode=None)
    with compiled.active():        inside: every decoder layer's forward is the compiled one (the forward and,
        loss.backward()            through AOTAutograd, the backward; a checkpointed layer's recomputation too)

Regional compilation: each layer is compiled on its own, with dynamic shapes, so the identical layers share one
graph (one compilation for the model, not one per layer or per sequence length), and the rollout, evaluation and
no-grad scoring passes, which run outside `active()`, keep the eager layers (the rollout has compile_decode).
The compiled layers compute the same function, rounded differently where the compiler fuses or reorders
(fp32: ~1e-5 relative in the gradients; tests/training/test_compiled_layers.py).

If compiling fails (no C++ compiler for the CPU backend, a backend that refuses the graph), the call runs the
eager layer instead and every later call does too, with one warning: a run never stops for its speed-up.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator, Optional

import torch
import torch.utils.checkpoint
from torch import nn

from ..config import ConfigError
from ..config.schema import ModelConfig
from ..policy.layer_major import decoder_layers

log = logging.getLogger(__name__)
# torch.utils.checkpoint ends a non-reentrant recomputation early by raising this through the layer's forward
STOP_RECOMPUTATION = getattr(torch.utils.checkpoint, "_StopRecomputationError", ())


class CompiledLayers:
    """torch.compile of each layer's forward (`backend`, `mode`: torch.compile's own arguments), swapped in
    only inside `active()`."""

    def __init__(self, layers: nn.ModuleList, backend: str = "inductor", mode: Optional[str] = None):
        known = torch._dynamo.list_backends(exclude_tags=())
        if backend not in known:
            raise ConfigError(f"model.torch_compile_backend={backend!r} is not a torch.compile backend: one of "
                              f"{', '.join(known)} (or null: inductor)")
        self.layers = list(layers)
        self.backend, self.mode = backend, mode
        self.compiled = [torch.compile(layer.forward, backend=backend, mode=mode, dynamic=True)
                         for layer in self.layers]
        self.failed: Optional[str] = None  # why compiling failed: every call is eager from then on
        self.calls = 0  # compiled calls that returned (what the tests read)

    def _forward(self, i: int):
        eager, compiled = self.layers[i].forward, self.compiled[i]

        def forward(*args, **kwargs):
            if self.failed is None:
                try:
                    out = compiled(*args, **kwargs)
                except STOP_RECOMPUTATION:  # checkpoint's early stop: how a recomputation ends, not a failure
                    raise
                except Exception as exc:  # noqa: BLE001 - any failure falls back; eager re-raises a real error
                    self.failed = _reason(exc)
                    log.warning("model.torch_compile: compiling the decoder layers (backend %s) failed, so they run "
                                "eagerly from here on: %s", self.backend, self.failed)
                else:
                    self.calls += 1
                    return out
            return eager(*args, **kwargs)

        return forward

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Inside: each layer's forward is its compiled one (an instance attribute over the class's)."""
        had = [layer.__dict__.get("forward") for layer in self.layers]
        for i, layer in enumerate(self.layers):
            layer.forward = self._forward(i)
        try:
            yield
        finally:
            for layer, old in zip(self.layers, had):
                if old is None:
                    del layer.forward
                else:
                    layer.forward = old


def _reason(exc: BaseException) -> str:
    """One line: the exception and, where it wraps another (a backend's own error), the innermost one."""
    root = exc
    while True:  # torch's BackendCompilerFailed keeps the backend's error as inner_exception
        inner = getattr(root, "inner_exception", None) or root.__cause__
        if not isinstance(inner, BaseException) or inner is root:
            break
        root = inner
    text = f"{type(exc).__name__}: {str(exc).strip()}".splitlines()[0]
    if root is not exc:
        text += f" ({type(root).__name__}: {str(root).strip()})".splitlines()[0]
    return text[:400]


def torch_compile_wanted(m: ModelConfig) -> bool:
    """model.torch_compile, or torch_compile_backend / torch_compile_mode set (which turn it on, as in TRL)."""
    return bool(m.torch_compile) or m.torch_compile_backend is not None or m.torch_compile_mode is not None


def compiled_layers(m: ModelConfig, decoder: nn.Module, world_size: int) -> Optional[CompiledLayers]:
    """The decoder's layers compiled as model.torch_compile* say, or None where it is off. ConfigError, naming
    the setting to change, where the run is not one it is built and tested for: one process, the layers'
    weights resident (not model.offload_weights, whose streamer swaps them per layer) and no
    model.offload_activations (its saved-tensor hooks)."""
    if not torch_compile_wanted(m):
        return None
    if world_size > 1:
        raise ConfigError("model.torch_compile runs in one process: under torchrun set model.torch_compile=false")
    if m.offload_weights:
        raise ConfigError("model.torch_compile does not run with model.offload_weights (its layers' weights are "
                          "streamed in per layer): set one of them to false")
    if m.offload_activations:
        raise ConfigError("model.torch_compile does not run with model.offload_activations (its saved-tensor "
                          "hooks): set one of them to false")
    return CompiledLayers(decoder_layers(decoder).layers, m.torch_compile_backend or "inductor", m.torch_compile_mode)
