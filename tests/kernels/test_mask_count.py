"""linear_grpo_loss with `mask_count` (the padding dropped without a device sync): the same loss,
metrics and gradients as counting on the device, bit for bit, and no `nonzero`."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lowmem_grpo.kernels import linear_grpo_loss
from lowmem_grpo.kernels.linear_loss import kept_rows

from .test_linear_loss import _batch


class _CountNonzero(TorchDispatchMode):
    """Counts `nonzero` calls: its output size depends on the data, so on CUDA it reads a count back
    from the device (a pipeline drain)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.nonzero.default:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _loss_and_grads(batch, **kw):
    params = [batch[k] for k in ("hidden", "weight", "bias")]
    loss, metrics = linear_grpo_loss(**batch, loss_type="grpo", **kw)
    return loss, metrics, torch.autograd.grad(loss, params)


def test_kept_rows_are_the_nonzero_indices():
    g = torch.Generator().manual_seed(0)
    for mask in (torch.rand(5, 123, generator=g) < 0.3, torch.zeros(3, 4, dtype=torch.bool),
                 torch.ones(2, 7, dtype=torch.bool)):
        expected = mask.reshape(-1).nonzero().squeeze(1)
        assert torch.equal(kept_rows(mask, int(mask.sum())), expected)
        assert torch.equal(kept_rows(mask), expected)


def test_a_host_count_gives_the_same_loss_without_nonzero(device):
    batch = _batch(device)
    n = int(batch["mask"].sum())  # the trainer counts it on the host, before the batch moves
    loss, metrics, grads = _loss_and_grads(batch)
    with _CountNonzero() as counter:
        loss_c, metrics_c, grads_c = _loss_and_grads(batch, mask_count=n)
    assert counter.calls == 0
    assert torch.equal(loss, loss_c)
    for k in metrics:
        assert torch.equal(metrics[k], metrics_c[k]), k
    for a, b in zip(grads, grads_c):
        assert torch.equal(a, b)


def test_a_wrong_count_is_an_error_naming_the_fix():
    batch = _batch(torch.device("cpu"))
    n = int(batch["mask"].sum())
    with pytest.raises(ValueError, match=rf"mask_count={n + 1} but the mask has {n} True entries: pass the mask's own"):
        linear_grpo_loss(**batch, mask_count=n + 1)


@pytest.mark.cuda
def test_cuda_loss_with_a_host_count_makes_no_sync():
    # torch's sync debug mode raises on any synchronising call: forward and backward of the fused loss
    # with the count given read nothing back from the device.
    torch.manual_seed(0)
    batch = _batch(torch.device("cuda"))
    n = int(batch["mask"].sum())
    expected = _loss_and_grads(batch)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = _loss_and_grads(batch, mask_count=n)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(expected[0], got[0])
    for a, b in zip(expected[2], got[2]):
        assert torch.equal(a, b)
