"""The fused loss head's memory as the planner counts it: its workspace, or the logits it keeps for the backward
on the CPU, and the buffers around its GEMMs (lowmem_grpo/kernels/linear.py states them; this reads them)."""

from __future__ import annotations

from ..kernels.linear import default_chunk_size, keep_logits_fits
from ..kernels.logprobs import _rows_per_chunk  # the CPU fallback's row chunk: its bound, read, not restated
from .arch import Arch


def loss_head_bytes(n: int, arch: Arch, compute_bytes: int, weight_bytes: int, backward: bool, device: str,
                    differentiated: bool = False) -> int:
    """The fused head's memory for n completion tokens (lowmem_grpo/kernels/linear.py), beyond its inputs, in
    its forward (`differentiated`: one whose backward follows) or its backward."""
    chunk = default_chunk_size(n, arch.vocab, device)
    kept = (backward or differentiated) and keep_logits_fits(n, arch.vocab, compute_bytes, device)
    # the kept logits; the workspace (a forward that keeps its logits writes them there instead); the hidden
    # states in the compute dtype
    workspace = 0 if kept and not backward else n * chunk * compute_bytes
    total = (n * arch.vocab if kept else 0) * compute_bytes + workspace + n * arch.hidden * compute_bytes
    if compute_bytes != weight_bytes:
        total += chunk * arch.hidden * compute_bytes  # one weight slice cast per GEMM
    if backward:
        total += 4 * n * arch.hidden  # fp32 d hidden accumulator
    if device == "cpu":  # the torch fallback: fp32 copies of row chunks of the slice (lowmem_grpo/kernels/logprobs.py):
        # three in the forward (the entropy's two and logsumexp's transient); one in the backward, which
        # writes the gradient into the chunk's own copy (the loss puts no gradient on the entropy)
        rows = min(n, _rows_per_chunk(chunk, device))
        total += (1 if backward else 3) * 4 * rows * chunk
    return total
