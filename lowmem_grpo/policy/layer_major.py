"""A decoder's layers run one at a time, outside the decoder's own forward: what lets a pass go layer-major
(every row of a batch through layer i while its weights are on the device, then layer i + 1).

    layers = DecoderLayers(decoder.layers)
    inputs = layers.record(lambda: decoder(...))      the decoder runs up to its layers, which do not run:
                                                      LayerInputs(first layer's input, each layer's arguments)
    hidden = layers.run(i, hidden, inputs.calls[i])   layer i, as the decoder would have called it
    with layers.finishing_from(final):                a decoder call inside skips its layers and continues
        out = decoder(...)                            from `final` (final norm, slicing, the loss head)

Recording and finishing replace the entries of the `nn.ModuleList` for the duration of the call (the
real layers' hooks, a streamer's or the offloaded optimizer's, do not run then; in `run` they do). The
arguments a decoder passes its layers (masks, rotary tables, a Gemma layer's own kind of each) do not
depend on the hidden states, so they are taken as the decoder computes them, per layer, for any family
whose forward loops over `self.layers`. Layers returning a tensor or a tuple (transformers 4.x Gemma) both work.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Iterator, NamedTuple, Optional, TypeVar

import torch
from torch import Tensor, nn

T = TypeVar("T")


class LayerInputs(NamedTuple):
    """What a decoder's forward gives its layers: the first layer's hidden states and, per layer, the
    other positional arguments and the keyword arguments."""

    hidden: Tensor
    calls: list[tuple[tuple, dict]]


class _Recorded(Exception):
    """Raised by the last layer's stand-in: the rest of the forward is not run."""


class _StandIn(nn.Module):
    """Takes a decoder layer's place in its ModuleList for one call; attributes fall back to the layer (a
    decoder may read e.g. `attention_type` from it)."""

    def __init__(self, layer: nn.Module, on_call: Callable[[Tensor, tuple, dict], object]):
        super().__init__()
        object.__setattr__(self, "_layer", layer)  # not a child: its parameters stay the layer's own
        object.__setattr__(self, "_on_call", on_call)

    def forward(self, hidden: Tensor, *args, **kwargs):
        return self._on_call(hidden, args, kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_layer"), name)


class DecoderLayers:
    """The layers of a decoder (`decoder.layers`, an nn.ModuleList), run one at a time (module docstring)."""

    def __init__(self, layers: nn.ModuleList):
        if not isinstance(layers, nn.ModuleList):
            raise NotImplementedError(f"a layer-major pass needs the decoder's layers as an nn.ModuleList, got "
                                      f"{type(layers).__name__}")
        self.layers = layers
        self.returns_tuple: Optional[bool] = None  # learned from the first real layer call

    def __len__(self) -> int:
        return len(self.layers)

    def record(self, forward: Callable[[], object]) -> LayerInputs:
        """Call `forward()` (a call of the decoder, or of code that calls it) with every layer replaced by a
        stand-in that records its arguments and returns its input; stops at the last layer. The first
        layer's input keeps its autograd graph (the embedding's gradient flows through it)."""
        calls: list[tuple[tuple, dict]] = []
        first: list[Tensor] = []
        last = len(self.layers) - 1

        def on_call(hidden: Tensor, args: tuple, kwargs: dict):
            if not calls:
                first.append(hidden)
            calls.append((args, kwargs))
            if len(calls) > last:
                raise _Recorded
            return self._as_output(hidden)

        try:
            with self._replaced(on_call):
                forward()
        except _Recorded:
            pass
        if len(calls) != len(self.layers):
            raise RuntimeError(f"the decoder called {len(calls)} of its {len(self.layers)} layers: a layer-major "
                               "pass needs a forward that runs every layer once, in order")
        return LayerInputs(first[0], calls)

    def run(self, i: int, hidden: Tensor, call: tuple[tuple, dict]) -> Tensor:
        """Layer `i` on `hidden` with the arguments the decoder gave it (`LayerInputs.calls[i]`); the hidden
        states it returns. The layer's own hooks run."""
        args, kwargs = call
        out = self.layers[i](hidden, *args, **kwargs)
        is_tuple = isinstance(out, tuple)
        if self.returns_tuple is None:
            self.returns_tuple = is_tuple
        return out[0] if is_tuple else out

    @contextlib.contextmanager
    def finishing_from(self, final: Tensor) -> Iterator[None]:
        """Inside, a decoder call skips its layers: the first layer's place returns `final` (the last
        layer's output), the others pass it on; what follows the layers runs on it as usual."""
        if self.returns_tuple is None:
            raise RuntimeError("finishing_from needs one layer run first (it learns the layers' output type)")
        first = [True]

        def on_call(hidden: Tensor, args: tuple, kwargs: dict):
            out = final if first[0] else hidden
            first[0] = False
            return self._as_output(out)

        with self._replaced(on_call):
            yield

    def _as_output(self, hidden: Tensor):
        return (hidden,) if self.returns_tuple else hidden

    @contextlib.contextmanager
    def _replaced(self, on_call: Callable[[Tensor, tuple, dict], object]) -> Iterator[None]:
        real = list(self.layers)
        try:
            for i, layer in enumerate(real):
                self.layers[i] = _StandIn(layer, on_call)
            yield
        finally:
            for i, layer in enumerate(real):
                self.layers[i] = layer


def decoder_layers(decoder: nn.Module) -> DecoderLayers:
    """The `DecoderLayers` of a transformers decoder (its `.layers`), with a clear error for one without."""
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise NotImplementedError(f"{type(decoder).__name__} has no .layers list: a layer-major pass cannot run it")
    return DecoderLayers(layers)


@torch.no_grad()
def run_layer_major(layers: DecoderLayers, inputs: list[LayerInputs],
                    keep: Optional[Callable[[int, int, Tensor], None]] = None,
                    around: Optional[Callable[[int], ContextManager]] = None) -> list[Tensor]:
    """Every micro-batch of `inputs` through layer 0, then every one through layer 1, ...: each layer's
    weights are used by all rows while they are on the device. Returns each micro-batch's last hidden
    states. `keep(i, m, hidden)`: called with layer i's input for micro-batch m before it runs (a training
    pass keeps them for its backward). `around(i)`: a context around layer i's calls (a streamer's
    `resident`: the layer's weights cross once)."""
    hidden = [x.hidden.detach() for x in inputs]
    for i in range(len(layers)):
        with around(i) if around is not None else contextlib.nullcontext():
            for m, x in enumerate(inputs):
                if keep is not None:
                    keep(i, m, hidden[m])
                hidden[m] = layers.run(i, hidden[m], x.calls[i])
    return hidden


def layer_major_outputs(layers: DecoderLayers, forwards: list[Callable[[], T]],
                        around: Optional[Callable[[int], ContextManager]] = None) -> list[T]:
    """What each of `forwards` (a call of code that calls the decoder, one per micro-batch) returns, with
    the layers run layer-major for all of them (`run_layer_major`, `around` as there): each is recorded,
    the layers run (without a graph), then each is called again to finish from its last layer's output."""
    inputs = [layers.record(forward) for forward in forwards]
    finals = run_layer_major(layers, inputs, around=around)
    out = []
    for forward, final in zip(forwards, finals):
        with layers.finishing_from(final):
            out.append(forward())
    return out
