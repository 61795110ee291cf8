"""memory.track(): peak bytes around any code, including allocations inside custom ops."""

import torch

from lowmem_grpo import memory
from lowmem_grpo.kernels import linear_token_logprobs
from lowmem_grpo.kernels.linear import default_chunk_size


def test_cpu_peak_and_what_remains():
    with memory.track("cpu") as t:
        a = torch.ones(4 * 2**20 // 4)  # 4 MiB, freed before the block ends
        del a
        keep = torch.zeros(2**20 // 4)  # 1 MiB, still alive at exit
    assert 4 * 2**20 <= t.peak_bytes < 6 * 2**20, t
    assert 0.9 * 2**20 <= t.end_bytes <= 1.1 * 2**20, t
    assert "MiB" in t.report() and t.as_dict()["device"] == "cpu"
    del keep


def test_cpu_tracking_sees_the_fused_heads_internal_workspace():
    n, h, v = 512, 64, 50_000
    hidden = torch.randn(n, h)
    weight = torch.randn(v, h)
    ids = torch.randint(0, v, (n,))
    workspace = n * min(default_chunk_size(n, v, "cpu"), v) * 4  # the op's own [n, chunk] fp32 slice
    with memory.track("cpu") as t:
        linear_token_logprobs(hidden, weight, ids)
    assert t.peak_bytes >= workspace, (t.peak_bytes, workspace)  # invisible to dispatch-level trackers
