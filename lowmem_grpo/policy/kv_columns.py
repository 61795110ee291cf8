"""A growing KV-cache layer that appends a decode step's column in place instead of copying the cache.

transformers' `DynamicLayer.update` concatenates: every decode step copies every layer's whole K and V
to add one column (for a 64-row rollout of SmolLM2-135M in fp32, ~14% of the step). `ColumnsLayer` is
a `DynamicLayer` whose keys and values are views of buffers with room for `capacity` columns: `update`
writes the new columns after the view's last one and widens the view. Its keys and values hold the
same numbers as a DynamicLayer's after the same updates; only their strides (and storage) differ.

Edits outside `update` go through `set(keys, values)`: a view of the buffer that ends where the buffer's
filled columns end (leading columns trimmed) keeps appending in place; any other tensor (rows selected,
columns added at the left) replaces the buffer, which is released at once, and the next update copies
that tensor into a new buffer. Writes into the views in place (`keys[idx] = ...`) are writes into the
buffer. A buffer holds max(capacity, 1.25 x the columns needed) columns, so a caller that passes the
rollout's prompt + completion columns holds what the planner counts for the cache (memory/plan.py,
generation_bytes) unless a row outgrows them.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from transformers.cache_utils import DynamicLayer


class ColumnsLayer(DynamicLayer):
    """A DynamicLayer appending into preallocated columns; `capacity`: columns a buffer is made with."""

    def __init__(self, capacity: int = 0):
        super().__init__()
        self.capacity = capacity
        self.key_buffer: Optional[Tensor] = None  # (B, H, capacity, D); keys is a view of it, or it is None
        self.value_buffer: Optional[Tensor] = None
        self.filled = 0  # columns of the buffers written so far; the views end there

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Append (B, H, n, D) keys and values as n more columns: the (B, H, L + n, D) views."""
        if self.keys is None or self.keys.dim() != 4:
            return super().update(key_states, value_states, *args, **kwargs)  # the first update: as transformers
        n, width = key_states.shape[-2], self.keys.shape[-2] + key_states.shape[-2]
        if not (self._views_of_buffers() and self.filled + n <= self.key_buffer.shape[2]):
            self._new_buffers(width)
        end = self.filled + n
        self.key_buffer[:, :, self.filled:end].copy_(key_states)
        self.value_buffer[:, :, self.filled:end].copy_(value_states)
        self.filled = end
        self.keys = self.key_buffer[:, :, end - width:end]
        self.values = self.value_buffer[:, :, end - width:end]
        return self.keys, self.values

    def set(self, keys: Tensor, values: Tensor) -> None:
        """Replace the layer's keys and values; the buffers are released unless these are views of them
        that end at their filled columns."""
        self.keys, self.values = keys, values
        if self.key_buffer is not None and not self._views_of_buffers():
            self.key_buffer = self.value_buffer = None
            self.filled = 0

    def _views_of_buffers(self) -> bool:
        return all(buffer is not None and view._base is buffer and view.shape[:2] == buffer.shape[:2]
                   and view.shape[3] == buffer.shape[3] and view.stride() == buffer.stride()
                   and view.storage_offset() == buffer.storage_offset() + (self.filled - view.shape[2]) * view.stride(2)
                   for view, buffer in ((self.keys, self.key_buffer), (self.values, self.value_buffer)))

    def _new_buffers(self, width: int) -> None:
        """Buffers of max(capacity, width + a quarter) columns holding today's keys and values at their start."""
        keys, values = self.keys, self.values
        columns = max(self.capacity, width + width // 4)
        L = keys.shape[2]
        self.key_buffer = keys.new_empty((keys.shape[0], keys.shape[1], columns, keys.shape[3]))
        self.value_buffer = values.new_empty((values.shape[0], values.shape[1], columns, values.shape[3]))
        self.key_buffer[:, :, :L].copy_(keys)
        self.value_buffer[:, :, :L].copy_(values)
        self.filled = L
        self.keys, self.values = self.key_buffer[:, :, :L], self.value_buffer[:, :, :L]


def columns_cache(cache, capacity: int):
    """`cache` (a DynamicCache of plain layers) with ColumnsLayer layers of `capacity` columns in place of its
    empty DynamicLayers, and for the layers it adds at its first update; other layers are kept."""
    layers = cache.layers
    for i, layer in enumerate(layers):
        if type(layer) is DynamicLayer and layer.keys is None:
            layers[i] = ColumnsLayer(capacity)
    if getattr(cache, "layer_class_to_replicate", None) is DynamicLayer:
        cache.layer_class_to_replicate = lambda: ColumnsLayer(capacity)
    return cache
