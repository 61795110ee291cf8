"""A compact copy of the policy for sampling rollouts: its Linear weights (but the output head's) in int8 or nf4.

`CompactPolicy(model, quantization)` builds a second module tree that shares every tensor of `model`
(embeddings, norms, the output head, biases, buffers) except the weights of its Linear layers other than the
output head (the decoder layers'), which it holds as int8 with one scale per output row (symmetric, round to
nearest: q = round(w / s), s = max|w_row| / 127), or as bitsandbytes' 4-bit NormalFloat (nf4: two weights
per byte, an fp32 absmax per NF4_BLOCK weights). `refresh()` quantizes the policy's current weights again
(after every optimizer step); `head` is the copy's `Head`, for the sampler's own log-probs that the
importance-sampling correction divides by. A quantized layer computes in the input's (or autocast's) dtype,
its dequantized weight made for the call only (int8 in bf16 on the CPU: torch's int8 weight-only GEMM, no
dequantized weight at all).
Design notes: docs/rollouts.md, "Compact rollouts"
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..transfers import count
from .model import Head, build_head, decoder_of
from .streaming import HostLookup

QUANTIZATIONS = ("int8", "nf4")
# Weights per absmax of the 4-bit copy: half bitsandbytes' default of 64, because 64 cost the CPU demo learning and
# 32 did not (benchmarks/RESULTS.md, "Compact rollouts"); 0.625 bytes per weight.
NF4_BLOCK = 32


class QuantizedLinear(nn.Module):
    """y = x @ (qweight * scale[:, None])^T + bias: an nn.Linear's weight as int8 rows and a scale per row.
    `bias` is the source layer's own tensor (shared, not copied) unless another is given."""

    def __init__(self, source: nn.Linear, device: Optional[torch.device] = None, bias: Optional[Tensor] = None,
                 from_host: bool = False):
        """`device`: where the int8 weight lives (default the source weight's); `bias`: the bias to use (default
        the source's own); `from_host`: the source weight is in host RAM (its copies are counted as transfers
        even where host and device are one: transfers.py)."""
        super().__init__()
        self.from_host = from_host
        self.in_features, self.out_features = source.in_features, source.out_features
        w = source.weight
        device = w.device if device is None else device
        self.register_buffer("qweight", torch.empty(w.shape, dtype=torch.int8, device=device), persistent=False)
        self.register_buffer("scale", torch.empty(w.shape[0], dtype=w.dtype, device=device), persistent=False)
        self.bias = source.bias if bias is None else bias
        self.quantize_from(w)

    @torch.no_grad()
    def quantize_from(self, weight: Tensor) -> None:
        """Quantize `weight` (out, in) into this layer's buffers, in place (copied to their device first)."""
        if self.from_host or weight.device != self.qweight.device:  # model.offload_weights: from the host copy
            count("rollout copy", "h2d", weight.numel() * weight.element_size())
        weight = weight.detach().to(self.qweight.device)
        if self.qweight.shape != weight.shape:  # (released)
            self.qweight = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
            self.scale = torch.empty(weight.shape[0], dtype=weight.dtype, device=weight.device)
        absmax = weight.abs().amax(dim=1).float()
        scale = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))
        self.qweight.copy_(torch.round(weight.float() / scale[:, None]).clamp_(-127, 127))
        self.scale.copy_(scale)

    def dequantized(self, dtype: torch.dtype) -> Tensor:
        return self.qweight.to(dtype) * self.scale.to(dtype)[:, None]

    def forward(self, x: Tensor) -> Tensor:
        """In autocast's dtype where it is on (one conversion of the weight, not two), else the input's; bf16
        on the CPU through torch's int8 weight-only GEMM (scales applied to its output rows)."""
        kind = x.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
        x = x.to(dtype)
        if kind == "cpu" and dtype == torch.bfloat16:
            y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, self.in_features), self.qweight,
                                                   self.scale.to(dtype)).reshape(*x.shape[:-1], self.out_features)
        else:
            y = F.linear(x, self.dequantized(dtype))
        return y if self.bias is None else y + self.bias.to(dtype)

    def nbytes(self) -> int:
        return self.qweight.numel() + self.scale.numel() * self.scale.element_size()

    def release(self) -> None:
        """Free the int8 weight and scales (`quantize_from` makes them again)."""
        self.qweight = self.qweight.new_empty(0)
        self.scale = self.scale.new_empty(0)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 rows"


class NF4Linear(nn.Module):
    """y = x @ dequantize(w)^T + bias: an nn.Linear's weight in bitsandbytes' 4-bit NormalFloat (two weights per
    byte, one fp32 absmax per NF4_BLOCK), dequantized for the call (bitsandbytes' own kernels on CPU and
    CUDA). `bias`, `device`, `from_host`: as QuantizedLinear's."""

    def __init__(self, source: nn.Linear, device: Optional[torch.device] = None, bias: Optional[Tensor] = None,
                 from_host: bool = False):
        super().__init__()
        self.from_host = from_host
        self.in_features, self.out_features = source.in_features, source.out_features
        self.device = source.weight.device if device is None else device
        self.bias = source.bias if bias is None else bias
        self.packed: Optional[Tensor] = None
        self.state = None  # bitsandbytes' QuantState: absmax, the NF4 code, shape and dtype
        self.quantize_from(source.weight)

    @torch.no_grad()
    def quantize_from(self, weight: Tensor) -> None:
        """Quantize `weight` (out, in) anew (copied to this layer's device first)."""
        import bitsandbytes.functional as bnbf
        if self.from_host or weight.device != self.device:
            count("rollout copy", "h2d", weight.numel() * weight.element_size())
        self.packed = self.state = None  # (the old copy freed before the new one is made)
        self.packed, self.state = bnbf.quantize_4bit(weight.detach().to(self.device), blocksize=NF4_BLOCK,
                                                     quant_type="nf4")

    def nbytes(self) -> int:
        """The packed weights and their absmax (the 256-entry code, shared by every block, not counted)."""
        if self.packed is None:
            return 0
        return self.packed.numel() * self.packed.element_size() + self.state.absmax.numel() * 4

    def release(self) -> None:
        """Free the packed weight (`quantize_from` makes it again)."""
        self.packed = self.state = None

    def forward(self, x: Tensor) -> Tensor:
        """In autocast's dtype where it is on, else the input's."""
        import bitsandbytes.functional as bnbf
        kind = x.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
        y = F.linear(x.to(dtype), bnbf.dequantize_4bit(self.packed, self.state).to(dtype))
        return y if self.bias is None else y + self.bias.to(dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, nf4 blocks of {NF4_BLOCK}"


class CompactPolicy:
    """The int8 (or nf4) copy of `model`'s decoder Linear layers, sharing everything else (module docstring).

    `device` (default: where the input embedding is): where the copy computes. A tensor of `model` elsewhere
    (model.offload_weights: the decoder layers' norms and biases in host RAM) gets a copy of its own there,
    refreshed with the rest, but for an embedding table looked up in host RAM (policy/streaming.py:
    look_up_on_host), which stays shared; a quantized weight is quantized there from wherever it is.
    `layers_on_host`: the decoder layers' weights are in host RAM (model.offload_weights), so their copies
    count as transfers (transfers.py) on a CPU-only run too."""

    def __init__(self, model: nn.Module, quantization: str = "int8", device: Optional[torch.device] = None,
                 layers_on_host: bool = False):
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"generation.rollout_quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
        device = model.get_input_embeddings().weight.device if device is None else torch.device(device)
        head_layer = model.get_output_embeddings()
        quantized = {name for name, m in model.named_modules() if isinstance(m, nn.Linear) and m is not head_layer}
        if not quantized:
            raise ValueError(f"{type(model).__name__} has no Linear layers besides its output head to quantize")
        # Every tensor shared: deepcopy copies the module objects (and the config), not the weights; and no
        # hook: a hook that another object registered on the policy (and that object) stays with the policy.
        to_quantize = {id(model.get_submodule(name).weight) for name in quantized}
        layers = getattr(decoder_of(model), "layers", None) if layers_on_host else None
        in_layers = {id(t) for t in layers.parameters()} if layers is not None else set()
        looked_up = {id(t) for m in model.modules() if isinstance(m, HostLookup)  # tables looked up in host RAM
                     for t in [*m.parameters(), *m.buffers()]}
        memo: dict[int, object] = {}
        self._copies: list[tuple[Tensor, Tensor]] = []  # (the policy's tensor, this copy's own on `device`)
        for t in [*model.parameters(), *model.buffers()]:
            if id(t) in memo:
                continue
            memo[id(t)] = t
            if ((t.device != device or (layers_on_host and id(t) in in_layers))
                    and id(t) not in to_quantize and id(t) not in looked_up):
                own = t.detach().to(device, copy=True)
                memo[id(t)] = nn.Parameter(own, requires_grad=False) if isinstance(t, nn.Parameter) else own
                self._copies.append((t, memo[id(t)]))
        for module in model.modules():
            for name, hooks in vars(module).items():
                if name.startswith("_") and name.endswith("hooks") and isinstance(hooks, dict):
                    memo[id(hooks)] = type(hooks)()
        self.model = copy.deepcopy(model, memo)
        self.model.eval()
        self._pairs: list[tuple[nn.Linear, nn.Module]] = []
        for name in sorted(quantized):
            parent_name, _, child = name.rpartition(".")
            parent = self.model.get_submodule(parent_name) if parent_name else self.model
            source = model.get_submodule(name)
            bias = None if source.bias is None else memo[id(source.bias)]
            kind = QuantizedLinear if quantization == "int8" else NF4Linear
            layer = kind(source, device, bias, from_host=layers_on_host)
            setattr(parent, child, layer)
            self._pairs.append((source, layer))
        self.head: Head = build_head(self.model)
        self.released = False  # `release`d: nothing of its own held until the next `refresh`

    def refresh(self) -> None:
        """Quantize the policy's current weights (call after the weights changed, once their update landed)."""
        with torch.no_grad():
            for source, own in self._copies:
                count("rollout copy", "h2d", source.numel() * source.element_size())
                own.data = source.detach().to(own.device, copy=True)
        for source, layer in self._pairs:
            layer.quantize_from(source.weight)
        self.released = False

    def release(self) -> None:
        """Free what this copy holds of its own on its device until the next `refresh` (model.offload_weights:
        the copy is needed only to sample, and is made again from the host copy before each rollout)."""
        for _, own in self._copies:
            own.data = own.data.new_empty(0)
        for _, layer in self._pairs:
            layer.release()
        self.released = True

    def nbytes(self) -> int:
        """Bytes this copy holds of its own: the int8 weights and their scales, and the copies `device` needed."""
        return (sum(q.nbytes() for _, q in self._pairs)
                + sum(own.numel() * own.element_size() for _, own in self._copies))
