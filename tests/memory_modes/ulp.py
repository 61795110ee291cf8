"""The comparison rule for weights computed by two paths that round through different code (issue 26):
each element within one bf16 ulp of the reference, the ulp computed per element."""

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
