"""Comparison rules for weights computed by two paths that round through different code: each element
within one bf16 ulp of the reference, the ulp computed per element (`assert_within_one_bf16_ulp`), and,
for optimizer steps through different kernels, that plus a share of an update per step
(`assert_within_updates`; its bounds are argued in test_offload_cuda.py)."""

import torch


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """Per element, the spacing of bf16 numbers at |x|: 2**(e - 8) for |x| in [2**(e - 1), 2**e) (8
    significant bits); below the smallest normal number (2**-126, and at 0) the subnormal spacing 2**-133."""
    x = x.detach().float().abs()
    spacing = torch.ldexp(torch.ones_like(x), torch.frexp(x).exponent - 8)
    return torch.where(x < 2.0 ** -126, torch.full_like(x, 2.0 ** -133), spacing)


def assert_within_one_bf16_ulp(ref: torch.Tensor, got: torch.Tensor, msg: str) -> None:
    """Each element of `got` is its `ref` element or one of that element's bf16 neighbours: |got - ref| at
    most the smaller spacing of the two (just below a power of two the spacing is half that above it).
    The rule for paths that round through different code. It does not show that a weight moved: at a
    norm gain near 1.0 an update may be under one ulp, so the tests check that separately."""
    ref, got = ref.detach().float().cpu(), got.detach().float().cpu()
    bound = torch.minimum(bf16_ulp(ref), bf16_ulp(got))
    over = (got - ref).abs() > bound
    assert not over.any(), (f"{msg}: {int(over.sum())} of {ref.numel()} elements more than one bf16 ulp from the "
                            f"reference (worst {float(((got - ref).abs() / bound).max()):.1f} ulps)")


# What two kernels' arithmetic may add to an optimizer step computed from the same gradient, as a fraction of
# one update (lr) per step (assert_within_updates):
FP32_STATES = 2.0 ** -11  # fp32 Adam arithmetic (torch AdamW; bitsandbytes' 8-bit AdamW computes in fp32)
BF16_STATES = 2.0 ** -5  # torch AdamW on bf16 weights: moments stored in bf16, each rounding up to 2**-8


def assert_within_updates(ref: torch.Tensor, got: torch.Tensor, msg: str, *, lr: float, steps: int,
                          fraction: float) -> None:
    """Each element of `got` within `ref`'s own rounding -- one bf16 ulp (the smaller spacing of the two) for
    bf16, 1e-5 relative + 1e-7 for fp32 -- plus `fraction` x `lr` per step. The rule for weights stepped by
    two implementations of one optimizer (the host's CPU kernels, the device's CUDA kernels): Adam's update
    is ~lr per element whatever the weight's size, so what the arithmetic changes scales with lr, not with
    the weight, while a dropped gradient contribution or a missed step moves elements by whole updates."""
    bf16 = torch.bfloat16 in (ref.dtype, got.dtype)
    ref, got = ref.detach().float().cpu(), got.detach().float().cpu()
    own = torch.minimum(bf16_ulp(ref), bf16_ulp(got)) if bf16 else 1e-7 + 1e-5 * ref.abs()
    excess = ((got - ref).abs() - own - fraction * lr * steps).clamp(min=0)
    over = excess > 0
    assert not over.any(), (f"{msg}: {int(over.sum())} of {ref.numel()} elements further than the rule "
                            f"allows (worst by {float(excess.max()) / lr:.2e} x lr)")
