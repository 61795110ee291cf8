"""Device bytes of generation.rollout_quantization's compact copy of the policy (policy/compact.py), which the
planner (plan.py) counts as "rollout copy"."""

from __future__ import annotations

from ..policy.compact import NF4_BLOCK
from .arch import Arch


def compact_copy_bytes(arch: Arch, weight_bytes: int, streams_weights: bool = False,
                       quantization: str = "int8") -> int:
    """Bytes of the rollout copy (policy/compact.py: CompactPolicy.nbytes) of the decoder layers' Linears: int8, a
    byte per weight and a scale (in the weight dtype) per output row; nf4, half a byte per weight and an fp32
    absmax per NF4_BLOCK. The rest is shared, but for the layers' norms under model.offload_weights
    (`streams_weights`), which the copy holds on the device."""
    q, kv = arch.heads * arch.head_dim, arch.kv_heads * arch.head_dim
    shapes = [(q, arch.hidden), (kv, arch.hidden), (kv, arch.hidden), (arch.hidden, q),
              (arch.intermediate, arch.hidden), (arch.intermediate, arch.hidden), (arch.hidden, arch.intermediate)]
    if quantization == "nf4":
        linears = sum((r * c + 1) // 2 + 4 * -(-r * c // NF4_BLOCK) for r, c in shapes)
    else:
        linears = sum(r * c + weight_bytes * r for r, c in shapes)
    norms = 2 * arch.hidden * weight_bytes if streams_weights else 0
    return arch.layers * (linears + norms)
