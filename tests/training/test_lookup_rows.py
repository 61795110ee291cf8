"""An embedding lookup's gradient as the rows it read (training/lookup_rows.py) against autograd's whole
(V, H) gradient of the table, and the offloaded optimizer's host buffer filled from those rows."""

import pytest
import torch
from torch import nn

from lowmem_grpo.optim.offload import OffloadedOptimizer
from lowmem_grpo.training.lookup_rows import LookupRows


class ScaledEmbedding(nn.Embedding):
    """As Gemma's: the module's own forward scales what F.embedding returns."""

    def forward(self, ids):
        return super().forward(ids) * 3.0


def _ids(vocab: int, pad: int | None) -> torch.Tensor:
    ids = torch.randint(0, vocab // 3, (3, 40), generator=torch.Generator().manual_seed(1))  # repeats, gaps
    if pad is not None:
        ids[0, :7] = pad
    return ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pad", [None, 5, 99])  # no padding row; one the ids use; one they do not
@pytest.mark.parametrize("cls", [nn.Embedding, ScaledEmbedding])
def test_the_rows_are_the_whole_gradients_rows_bit_for_bit(dtype, pad, cls):
    torch.manual_seed(0)
    table = cls(120, 16, padding_idx=pad).to(dtype)
    ids, upstream = _ids(120, pad if pad != 99 else None), torch.randn(3, 40, 16, dtype=dtype)
    table(ids).backward(upstream)
    whole, table.weight.grad = table.weight.grad, None
    lookup = LookupRows(table)
    with lookup.compact() as calls:
        out = table(ids)
    assert torch.equal(out, table.weight[ids] * (3.0 if cls is ScaledEmbedding else 1.0))
    out.backward(upstream)
    assert table.weight.grad is None and len(calls) == 1
    distinct, rows = calls[0]
    assert torch.equal(distinct, ids.unique())
    assert torch.equal(rows.grad, whole[distinct])
    untouched = torch.ones(120, dtype=torch.bool)
    untouched[distinct] = False
    assert not whole[untouched].any()  # nothing was left out
    assert "forward" not in table.__dict__ and table.padding_idx == pad  # the module as it was


def test_a_module_it_cannot_compact_is_left_whole():
    for table in (nn.Embedding(50, 8, max_norm=1.0), nn.Embedding(50, 8, sparse=True), nn.Linear(8, 8)):
        with LookupRows(table).compact() as calls:
            if isinstance(table, nn.Embedding):
                table(torch.tensor([1, 2, 2])).sum().backward()
        assert calls == [] and "forward" not in table.__dict__
    frozen = nn.Embedding(50, 8).requires_grad_(False)
    assert not LookupRows(frozen).usable


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_the_host_buffer_gets_the_whole_gradients_sum(device):
    """Two micro-batches' rows into an offloaded optimizer's buffer (on CUDA: copied on its side stream):
    the buffer equals the sum of the whole gradients, bit for bit in bf16; outside a step, `.grad`."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    torch.manual_seed(0)
    table = nn.Embedding(64, 8).to(device, torch.bfloat16)
    opt = OffloadedOptimizer([{"params": [table.weight], "lr": 0.0}], lambda g: torch.optim.SGD(g, lr=0.0), None,
                             update_thread=False)
    opt.begin_step()
    expected = None
    for micro_batch in range(2):
        ids = (_ids(64, None) + micro_batch).to(device)
        upstream = torch.randn(3, 40, 8, dtype=torch.bfloat16, device=device)
        reference = nn.Embedding(64, 8).to(device, torch.bfloat16)
        reference.weight.data.copy_(table.weight)
        reference(ids).backward(upstream)
        expected = reference.weight.grad if expected is None else expected + reference.weight.grad
        lookup = LookupRows(table)
        with lookup.compact() as calls:
            table(ids).backward(upstream)
        distinct, rows = calls[0]
        opt.receive_rows(table.weight, distinct, rows.grad)
        opt.end_backward()
    assert torch.equal(opt.host_grad[table.weight], expected.cpu())
    opt.end_step()
    outside = torch.zeros(64, 8, dtype=torch.bfloat16, device=device)  # after the step: into .grad, whole
    opt.receive_rows(table.weight, torch.tensor([3, 7], device=device),
                     torch.ones(2, 8, dtype=torch.bfloat16, device=device))
    outside[[3, 7]] = 1
    assert torch.equal(table.weight.grad, outside)
