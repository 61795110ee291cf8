"""The rows that decode together (one per slot) and the growing KV cache they share, for sampling.py.

Columns are aligned across slots: column j of every slot's cache, token history and attention mask is
the same decode step; a slot's tokens end at the last column, with (masked) left padding before them,
and columns that are padding in every slot are trimmed at host reads. Each prompt is prefilled once
(`Prefill`); its samples copy its K/V into slots (`Slots.place`). A refilled row takes its prompt's
prefix and the last prompt token as its next decode input, so it joins without a forward of its own.
Each slot's left padding is also kept on the host, so no device read decides the attention mask.
Also here: `grouped_decode_attention`, the attention of both decode steps (this one and static_decode.py's)
under sdpa, which reads each K/V head once for all its query heads.
Design notes: docs/rollouts.md
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor
from transformers import AttentionInterface, DynamicCache

from .decode_attention import cpu_decode_attention
from .kv_columns import ColumnsLayer, columns_cache
from .packing import sliding_window


def new_cache(model):
    """An empty DynamicCache for `model`, built as generate() builds it."""
    return DynamicCache(config=model.config.get_text_config(decoder=True))


def cache_argument(model) -> str:
    """The forward's name for the cache: `cache` (transformers >= 5.2x, where `past_key_values` is
    deprecated) or `past_key_values` (older)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def returned_cache(output):
    """The cache a forward returned, under either name (see cache_argument)."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def last_logits(output) -> Tensor:
    """The forward's logits at each row's last position as fp32 (B, V), in a tensor of their own: the forward's
    own (B, 1, V) fp32 logits as they are (no other tensor holds them), else an fp32 copy of the last column
    (so that the whole (B, L, V) tensor can be freed)."""
    logits = output.logits
    if logits.shape[1] == 1 and logits.dtype == torch.float32:
        return logits[:, 0]
    return logits[:, -1].to(copy=True, dtype=torch.float32)


def cache_layers_problem(cache) -> Optional[str]:
    """None where every layer of `cache` (after a forward) holds plain (B, H, L, D) keys and values
    this module may edit; sliding-window or recurrent layers keep other state."""
    for layer in cache.layers:
        if type(layer).__name__ != "DynamicLayer":
            return f"its cache layers ({type(layer).__name__}) are not plain growing key/value layers"
        if not all(isinstance(getattr(layer, n, None), Tensor) and getattr(layer, n).dim() == 4
                   for n in ("keys", "values")):
            return f"its cache layers ({type(layer).__name__}) hold no (batch, heads, length, dim) keys/values"
    return None


GROUPED_ATTENTION = "lowmem_grouped_decode"  # its name in transformers' attention registry


def grouped_decode_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                             dropout: float = 0.0, scaling: Optional[float] = None, **kwargs) -> tuple[Tensor, None]:
    """sdpa for one query token per row, each K/V head read once: query (B, heads, 1, D), key/value (B, kv_heads,
    L, D), mask (B, 1, 1, L) -> (B, 1, heads, D) as transformers' attention functions return it.

    Query head h attends with K/V head h // (heads / kv_heads) (repeat_kv's order), so the query heads
    reshape to (B, kv_heads, heads / kv_heads, D): each group is its K/V head's "queries", the mask
    broadcasts over them, and no copy of K or V is made. On the CPU the kernel of decode_attention.py
    computes it where it applies (decode_attention.problem), else sdpa."""
    B, heads, q_len, D = query.shape
    if q_len != 1:
        raise ValueError(f"grouped_decode_attention takes one query token per row, got {q_len}")
    grouped = query.reshape(B, key.shape[1], heads // key.shape[1], D)  # (B, kv_heads, group, D)
    out = None
    if dropout == 0.0:
        out = cpu_decode_attention(grouped, key, value, attention_mask, D ** -0.5 if scaling is None else scaling)
    if out is None:
        out = torch.nn.functional.scaled_dot_product_attention(grouped, key, value, attn_mask=attention_mask,
                                                               dropout_p=dropout, scale=scaling)
    return out.reshape(B, 1, heads, value.shape[-1]), None


@contextlib.contextmanager
def grouped_attention(model):
    """The model's attention is grouped_decode_attention inside the block (a config field its layers read)."""
    AttentionInterface.register(GROUPED_ATTENTION, grouped_decode_attention)  # (again: the same entry)
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = GROUPED_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = before


def grouped_decode_applies(model) -> bool:
    """Whether a decode step of `model` may run grouped_decode_attention: its attention is sdpa (which the
    function computes) over one full mask (no sliding-window layers)."""
    return getattr(model.config, "_attn_implementation", None) == "sdpa" and sliding_window(model.config) is None


def _set(layer, keys: Tensor, values: Tensor) -> None:
    """A cache layer's keys and values replaced (through ColumnsLayer.set, which keeps or releases its buffers)."""
    if isinstance(layer, ColumnsLayer):
        layer.set(keys, values)
    else:
        layer.keys, layer.values = keys, values


@dataclass
class Prefill:
    """Some prompts, run once as a left-padded batch (each prompt's last token is in the last column)."""

    keys: list  # per layer (k, H, W, D)
    values: list  # per layer (k, H, W, D)
    ids: Tensor  # (k, W) long, left-padded prompts
    mask: Tensor  # (k, W) bool
    logits: Tensor  # (k, V) fp32, at each prompt's last token

    @property
    def width(self) -> int:
        return self.ids.shape[1]


@dataclass
class Entry:
    """A row about to take a slot: where its prompt's K/V are, its last prompt token, its output row."""

    prefill: Prefill
    index: int  # its row in prefill
    last_token: int
    prompt_len: int
    out_row: int


class Slots:
    """Per-slot decode state; device tensors, with the left padding also kept on the host.

    The K/V live in a growing DynamicCache here, whose layers append each step's column into buffers of
    `columns` columns (kv_columns.py; the rollout's prompt + completion columns) rather than copying the
    cache; static_decode.StaticSlots keeps the same bookkeeping (history, mask, positions, stop flags) over
    a preallocated cache by overriding the `_cache_*` hooks, `forward` and `compaction`."""

    def __init__(self, model, n: int, pad_id: int, device: torch.device, empty_row: int = 0, columns: int = 0):
        self.cache = columns_cache(new_cache(model), columns) if model is not None else None
        self.pad_id = pad_id
        self.history = torch.full((n, 0), pad_id, dtype=torch.long, device=device)  # (S, L) cached tokens
        self.attention = torch.zeros((n, 0), dtype=torch.bool, device=device)  # (S, L) real (not padding)
        self.left_pad = [0] * n  # host: padding columns at the left of each slot
        self.inp = torch.zeros(n, dtype=torch.long, device=device)  # (S,) next decode input
        self.pos = torch.zeros(n, dtype=torch.long, device=device)  # (S,) its position id
        # (S,) output row of the slot's row; an empty slot's goes to `empty_row` (a row nobody reads)
        self.out_row = torch.full((n,), empty_row, dtype=torch.long, device=device)
        self.ngen = torch.zeros(n, dtype=torch.long, device=device)  # (S,) tokens generated by the slot's row
        self.done = torch.ones(n, dtype=torch.bool, device=device)  # (S,) finished (or empty)

    def __len__(self) -> int:
        return len(self.left_pad)

    @property
    def width(self) -> int:
        return self.history.shape[1]

    def _layers_ready(self) -> bool:
        return all(getattr(layer, "keys", None) is not None and layer.keys.dim() == 4 for layer in self.cache.layers)

    def grow_left(self, n: int, like: Prefill) -> None:
        """Add n padding columns at the left of every slot (a newcomer's prefix is longer than the cache)."""
        self._cache_grow_left(n, like)
        S = len(self)
        self.history = torch.cat([self.history.new_full((S, n), self.pad_id), self.history], 1)
        self.attention = torch.cat([self.attention.new_zeros((S, n)), self.attention], 1)
        self.left_pad = [p + n for p in self.left_pad]

    def _cache_grow_left(self, n: int, like: Prefill) -> None:
        S = len(self)
        if self._layers_ready():
            for layer in self.cache.layers:
                k, v = layer.keys, layer.values
                _set(layer, torch.cat([k.new_zeros((S, k.shape[1], n, k.shape[3])), k], 2),
                     torch.cat([v.new_zeros((S, v.shape[1], n, v.shape[3])), v], 2))
        else:  # nothing decoded yet: the cache's first update() builds its layers
            width = self.width + n
            for i, (k, v) in enumerate(zip(like.keys, like.values)):
                self.cache.update(k.new_zeros((S, k.shape[1], width, k.shape[3])),
                                  v.new_zeros((S, v.shape[1], width, v.shape[3])), i)

    def place(self, slots: list[int], entries: list[Entry], whole_prompt: bool) -> None:
        """Start each entry's row in its slot, its K/V at the right end of the cache, padding before.

        whole_prompt: the whole prompt is cached and the row's first token is sampled from the prefill's
        logits (`first_logits`); else the prefix is cached and the last prompt token is the next input."""
        groups: dict[int, tuple[Prefill, list[int], list[Entry]]] = {}
        for s, e in zip(slots, entries):
            groups.setdefault(id(e.prefill), (e.prefill, [], []))
            groups[id(e.prefill)][1].append(s)
            groups[id(e.prefill)][2].append(e)
        for prefill, group_slots, group in groups.values():
            W = prefill.width - (0 if whole_prompt else 1)  # columns copied
            if W > self.width:
                self.grow_left(W - self.width, prefill)
            L, dev = self.width, self.history.device
            idx = torch.tensor(group_slots, device=dev)
            self.history[idx] = self.pad_id
            self.attention[idx] = False
            if W:
                j = torch.tensor([e.index for e in group], device=dev)
                self.history[idx, L - W:] = prefill.ids[j, :W]
                self.attention[idx, L - W:] = prefill.mask[j, :W]
            self._cache_place(idx, group_slots, group, prefill, W)
            cached = [e.prompt_len - (0 if whole_prompt else 1) for e in group]  # tokens of each row in the cache
            for s, n in zip(group_slots, cached):
                self.left_pad[s] = L - n
            self.inp[idx] = torch.tensor([e.last_token for e in group], device=dev)  # (whole_prompt: unused)
            self.pos[idx] = torch.tensor(cached, device=dev)  # the position of the next input
            self.out_row[idx] = torch.tensor([e.out_row for e in group], device=dev)
            self.ngen[idx] = 0
            self.done[idx] = False

    def _cache_place(self, idx: Tensor, slots: list[int], group: list[Entry], prefill: Prefill, W: int) -> None:
        """These slots' K/V: the prefill's last W columns of each entry's prompt, at the right end."""
        L = self.width
        if self._layers_ready():
            for layer in self.cache.layers:
                layer.keys[idx] = 0  # stale rows are finite, but zeros make the masked columns plainly inert
                layer.values[idx] = 0
        if W:
            j = torch.tensor([e.index for e in group], device=idx.device)
            for layer, k, v in zip(self.cache.layers, prefill.keys, prefill.values):
                layer.keys[idx, :, L - W:] = k[j, :, :W]
                layer.values[idx, :, L - W:] = v[j, :, :W]

    def compaction(self, live: list[int], free: list[int], fraction: float) -> Optional[list[int]]:
        """The slots to keep when the finished rows `free` may leave, or None to leave the batch as it is:
        here once at least `fraction` of the rows have finished (sampling._COMPACT_FRACTION says why)."""
        return live if free and len(free) >= fraction * (len(live) + len(free)) else None

    def select(self, keep: list[int]) -> None:
        """Keep only these slots (finished rows leave the batch)."""
        idx = torch.tensor(keep, dtype=torch.long, device=self.history.device)
        self._cache_select(idx)
        for name in ("history", "attention", "inp", "pos", "out_row", "ngen", "done"):
            setattr(self, name, getattr(self, name)[idx])
        self.left_pad = [self.left_pad[i] for i in keep]

    def _cache_select(self, idx: Tensor) -> None:
        if self._layers_ready():
            for layer in self.cache.layers:
                _set(layer, layer.keys[idx], layer.values[idx])

    def trim(self) -> None:
        """Drop the leading columns that are padding in every slot (views: the next step appends after them)."""
        n = min(self.left_pad, default=0)
        if n == 0:
            return
        self._cache_trim(n)
        self.history, self.attention = self.history[:, n:], self.attention[:, n:]
        self.left_pad = [p - n for p in self.left_pad]

    def _cache_trim(self, n: int) -> None:
        if self._layers_ready():
            for layer in self.cache.layers:
                _set(layer, layer.keys[:, :, n:], layer.values[:, :, n:])

    def forward(self, model, keep_logits: bool, cache_arg: str) -> Tensor:
        """One decode step of every slot (after append_input): fp32 logits (S, V); the cache grows by a column.
        Under sdpa, with grouped_decode_attention and the mask as (S, 1, 1, L + 1): transformers' sdpa path
        copies every K/V head once per query head on some versions (docs/rollouts.md)."""
        kwargs = {"logits_to_keep": 1} if keep_logits else {}
        grouped = grouped_decode_applies(model)
        mask = self.attention[:, None, None, :] if grouped else self.attention if self.padded else None
        with grouped_attention(model) if grouped else contextlib.nullcontext():
            out = model(input_ids=self.inp[:, None], attention_mask=mask, position_ids=self.pos[:, None],
                        use_cache=True, return_dict=True, **{cache_arg: self.cache}, **kwargs)
        self.cache = returned_cache(out)
        return last_logits(out)

    def append_input(self) -> None:
        """The decode input joins the history and the mask: (S, L) -> (S, L + 1), as the cache will."""
        self.history = torch.cat([self.history, self.inp[:, None]], 1)
        self.attention = torch.cat([self.attention, self.attention.new_ones((len(self), 1))], 1)

    @property
    def padded(self) -> bool:
        """Whether any slot has left padding (else the step runs without a mask, as generate() does)."""
        return any(self.left_pad)
