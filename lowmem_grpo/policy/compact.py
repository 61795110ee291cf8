"""A compact copy of the policy for sampling rollouts: its decoder layers' Linear weights in int8.

`CompactPolicy(model)` builds a second module tree that shares every tensor of `model` (embeddings, norms,
the output head, biases, buffers) except the weights of the Linear layers inside the decoder, which it holds
as int8 with one scale per output row (symmetric, round to nearest: q = round(w / s), s = max|w_row| / 127).
`refresh()` quantizes the policy's current weights again (after every optimizer step); `head` is the copy's
`Head`, for the sampler's own log-probs that the importance-sampling correction divides by. A quantized
layer computes `x @ (q * s)^T + b` in the input's (or autocast's) dtype, its dequantized weight made for the
call only (bf16 on the CPU: torch's int8 weight-only GEMM, no dequantized weight at all).
Design notes: docs/rollouts.md, "Compact rollouts"
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .model import Head, build_head

QUANTIZATIONS = ("int8",)


class QuantizedLinear(nn.Module):
    """y = x @ (qweight * scale[:, None])^T + bias: an nn.Linear's weight as int8 rows and a scale per row.
    `bias` is the source layer's own tensor (shared, not copied)."""

    def __init__(self, source: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = source.in_features, source.out_features
        w = source.weight
        self.register_buffer("qweight", torch.empty(w.shape, dtype=torch.int8, device=w.device), persistent=False)
        self.register_buffer("scale", torch.empty(w.shape[0], dtype=w.dtype, device=w.device), persistent=False)
        self.bias = source.bias
        self.quantize_from(w)

    @torch.no_grad()
    def quantize_from(self, weight: Tensor) -> None:
        """Quantize `weight` (out, in) into this layer's buffers, in place."""
        absmax = weight.detach().abs().amax(dim=1).float()
        scale = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))
        self.qweight.copy_(torch.round(weight.detach().float() / scale[:, None]).clamp_(-127, 127))
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

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 rows"


class CompactPolicy:
    """The int8 copy of `model`'s decoder Linear layers, sharing everything else (module docstring)."""

    def __init__(self, model: nn.Module, quantization: str = "int8"):
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"generation.rollout_quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
        head_layer = model.get_output_embeddings()
        quantized = {name for name, m in model.named_modules() if isinstance(m, nn.Linear) and m is not head_layer}
        if not quantized:
            raise ValueError(f"{type(model).__name__} has no Linear layers besides its output head to quantize")
        # Every tensor shared: deepcopy copies the module objects (and the config), not the weights; and no
        # hook: a hook that another object registered on the policy (and that object) stays with the policy.
        memo = {id(t): t for t in [*model.parameters(), *model.buffers()]}
        for module in model.modules():
            for name, hooks in vars(module).items():
                if name.startswith("_") and name.endswith("hooks") and isinstance(hooks, dict):
                    memo[id(hooks)] = type(hooks)()
        self.model = copy.deepcopy(model, memo)
        self.model.eval()
        self._pairs: list[tuple[nn.Linear, QuantizedLinear]] = []
        for name in sorted(quantized):
            parent_name, _, child = name.rpartition(".")
            parent = self.model.get_submodule(parent_name) if parent_name else self.model
            source = model.get_submodule(name)
            layer = QuantizedLinear(source)
            setattr(parent, child, layer)
            self._pairs.append((source, layer))
        self.head: Head = build_head(self.model)

    def refresh(self) -> None:
        """Quantize the policy's current weights (call after the weights changed, once their update landed)."""
        for source, layer in self._pairs:
            layer.quantize_from(source.weight)

    def nbytes(self) -> int:
        """Bytes this copy holds of its own: the int8 weights and their scales."""
        return sum(q.qweight.numel() + q.scale.numel() * q.scale.element_size() for _, q in self._pairs)
