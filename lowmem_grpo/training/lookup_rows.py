"""The embedding lookup's gradient as the rows it read.

A lookup of N token ids reads at most N rows of a (V, H) table, yet autograd's gradient of the table is the
whole (V, H), mostly zeros. `LookupRows.compact()` runs the embedding module's own forward (a subclass's
scale included) on a copy of just the rows its ids read, indexed by their place among the sorted distinct
ids (`torch.unique`), and collects each call's ids and that copy, a leaf: after backward its `.grad` holds
the table gradient's rows at those ids. The distinct ids keep their order, so each row's gradient is summed
over the same tokens in the same order as the whole table's would be: the same bits, on the CPU and on CUDA
(tests/training/test_lookup_rows.py). The offloaded optimizer adds the rows into its host buffer
(`OffloadedOptimizer.receive_rows`), so a lookup's gradient crosses PCIe as ~N rows, not V.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from torch import Tensor, nn

from ..policy.streaming import table_rows


class LookupRows:
    """An embedding module whose lookups can run on the rows they read (module docstring). A module that is
    not an `nn.Embedding`, renormalises rows (`max_norm`), makes sparse gradients or is frozen is left as
    it is: `compact()` then collects nothing and its gradient arrives whole, as before."""

    def __init__(self, embedding: Optional[nn.Module]):
        self.embedding = embedding
        self.usable = (isinstance(embedding, nn.Embedding) and embedding.max_norm is None
                       and not embedding.sparse and embedding.weight.requires_grad)

    @property
    def weight(self) -> Tensor:
        return self.embedding.weight

    @contextlib.contextmanager
    def compact(self) -> Iterator[list[tuple[Tensor, Tensor]]]:
        """Inside, each call of the embedding module reads a compact leaf; the list gets (ids, leaf) per call,
        ids the distinct token ids in ascending order, the leaf their rows of the table."""
        calls: list[tuple[Tensor, Tensor]] = []
        if not self.usable:
            yield calls
            return
        module = self.embedding

        def forward(ids: Tensor, *args, **kwargs) -> Tensor:
            distinct, inverse = torch.unique(ids, return_inverse=True)
            rows = table_rows(module, distinct).requires_grad_()  # (from host RAM: model.offload_weights)
            calls.append((distinct, rows))
            pad = module.padding_idx
            del module.forward  # the class's own forward, on the rows
            try:
                if pad is not None:  # its row gets no gradient: its place among the distinct ids, if there
                    hit = (distinct == pad).nonzero()
                    module.padding_idx = int(hit[0, 0]) if hit.numel() else None
                return torch.func.functional_call(module, {"weight": rows}, (inverse, *args), kwargs)
            finally:
                module.padding_idx = pad
                module.forward = forward

        module.forward = forward
        try:
            yield calls
        finally:
            module.__dict__.pop("forward", None)
