"""The static-shape decode step: a preallocated KV cache, batch and length buckets, compilable and graphed.

`StaticKV` holds one rollout's K/V buffers, per layer (rows, kv_heads, length + SPARE_COLUMNS, head_dim),
rows = the generation micro-batch; row r keeps its tokens at columns 0 .. n_r - 1 (position = column) and
no padding. `decode_step` takes (B,) ids and (B,) positions, writes each row's new K/V at its position and
returns (B, V) fp32 logits; it runs on the first B rows (B in `buckets`) and first L columns (L in
`length_buckets`) of the buffers. `compiled_step` is that step under torch.compile; on CUDA, StaticKV
captures it as CUDA graphs (decode_graphs.py). `StaticSlots` is decode_slots.Slots over these buffers.
Sampling (processors, draw) stays outside the step. The buffers and graphs are freed when the rollout
ends (`StaticKV.release`).
Design notes: docs/rollouts.md
"""

from __future__ import annotations

import contextlib
import logging
from typing import Optional

import torch
from torch import Tensor

from .decode_graphs import StepGraphs, default_recorder
from .decode_slots import Entry, Prefill, Slots, cache_argument, grouped_attention, grouped_decode_applies
from .packing import sliding_window
from .streaming import HostLookup

log = logging.getLogger(__name__)

DECODE_MODES = ("dynamic", "static", "compiled")
MASKED_IMPLEMENTATIONS = ("sdpa", "eager")  # attention that takes our ready 4D mask


def buckets(micro_batch: int) -> list[int]:
    """The batch sizes the step runs at: the micro-batch and its halves down to an eighth (rounded up)."""
    return sorted({max(1, -(-micro_batch // 2 ** k)) for k in range(4)})


def bucket_for(rows: int, micro_batch: int) -> int:
    """The smallest bucket that holds `rows` rows."""
    return next(b for b in buckets(micro_batch) if b >= rows)


# Columns each K/V buffer holds past its length, which no view covers: no view is then contiguous along its
# length, so torch.compile compiles the step once per batch bucket, not twice (docs/rollouts.md).
SPARE_COLUMNS = 8


def length_buckets(length: int) -> list[int]:
    """The attended lengths the step runs at: the cache's length and its halves down to an eighth, each
    rounded up to a multiple of 8 (and at most the length)."""
    return sorted({min(length, -(-b // 8) * 8) for b in buckets(length)})


def length_bucket_for(columns: int, length: int) -> int:
    """The smallest length bucket that holds `columns` columns (the whole length if none does)."""
    return next((b for b in length_buckets(length) if b >= columns), length)


def static_decode_problem(model) -> Optional[str]:
    """Why the static step cannot run this model, or None."""
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    if impl not in MASKED_IMPLEMENTATIONS:
        return f"attention implementation {impl!r} takes no ready 4D mask (static decode needs sdpa or eager)"
    if isinstance(model.get_input_embeddings(), HostLookup):
        return "the input embedding is looked up in host RAM (model.offload_weights), which a captured step cannot do"
    window = sliding_window(model.config)
    if window is not None:  # the step's one full mask would reach past the window on the sliding layers
        return (f"{model.config.model_type} has sliding-window attention (window {window}), which the static "
                "step's one mask omits")
    return None


def bf16_weight_copies(model, device_type: str) -> dict:
    """Under bf16 autocast, the compiled step's own bf16 copies of the fp32 weights and biases of the model's
    Linear layers (the tied output head's included), made once per rollout: {module: {name: copy}}; {}
    without autocast or where they are not fp32.

    Autocast casts those for every matmul. Eager, it caches each cast until the autocast region ends, so a
    rollout casts every weight once; a compiled graph has no such cache and casts every weight on every
    step (~4x the weight traffic of bf16 weights), and on CUDA its pool would hold the head's cast (272 MB
    at Qwen2.5-0.5B's vocabulary). The copies round as autocast does (`.to(bfloat16)`), so the step computes
    with the same weights. The embedding (a gather of a few rows, not a matmul) keeps reading the fp32
    weight, as under autocast."""
    if not torch.is_autocast_enabled(device_type) or torch.get_autocast_dtype(device_type) != torch.bfloat16:
        return {}
    made: dict[int, torch.nn.Parameter] = {}  # one copy of a weight that two Linear layers share
    copies = {}
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            mine = {}
            for name, p in module.named_parameters(recurse=False):
                if p.dtype == torch.float32:
                    if id(p) not in made:
                        made[id(p)] = torch.nn.Parameter(p.detach().to(torch.bfloat16), requires_grad=False)
                    mine[name] = made[id(p)]
            if mine:
                copies[module] = mine
    return copies


@contextlib.contextmanager
def _weights_swapped(copies: dict):
    """Inside the block the modules hold these copies in place of their parameters (bf16_weight_copies)."""
    saved = [(module, name, module._parameters[name]) for module, mine in copies.items() for name in mine]
    for module, mine in copies.items():
        module._parameters.update(mine)
    try:
        yield
    finally:
        for module, name, p in saved:
            module._parameters[name] = p


class _RowCache:
    """What the model's attention layers call as their cache: each row's new K/V go to its own column."""

    is_compileable = True

    def __init__(self, keys: list[Tensor], values: list[Tensor], positions: Tensor):
        self.keys, self.values, self.positions = keys, values, positions
        self.rows = torch.arange(positions.shape[0], device=positions.device)

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        k, v = self.keys[layer_idx], self.values[layer_idx]  # (B, H, L, D) views of the buffers
        k[self.rows, :, self.positions] = key_states[:, :, 0].to(k.dtype)  # (B, H, D) at (row, position)
        v[self.rows, :, self.positions] = value_states[:, :, 0].to(v.dtype)
        return k, v

    def get_seq_length(self, layer_idx: int = 0) -> int:  # not used: position ids are always given
        return 0


def decode_step(model, input_ids: Tensor, positions: Tensor, keys: list[Tensor], values: list[Tensor], *,
                additive_mask: bool, cache_arg: str, keep_logits: bool,
                into: Optional[Tensor] = None) -> Tensor:
    """One decode step of the first B = len(input_ids) rows: (B,) ids at (B,) positions -> (B, V) fp32 logits.

    keys/values: per layer, (B, H, L, D) views of the buffers' first B rows and L columns (StaticKV.bucket_views:
    made once per bucket and rollout, at fixed addresses). A row attends to its columns 0 .. position;
    positions past the end (finished rows decoding until the host's next read) write into the last column.
    `into`: a (B, V) fp32 buffer the logits are written into and returned as (a CUDA graph's static
    output)."""
    B, L = input_ids.shape[0], keys[0].shape[2]
    positions = positions.clamp(max=L - 1)
    visible = torch.arange(L, device=positions.device)[None, :] <= positions[:, None]  # (B, L)
    mask = visible[:, None, None, :]  # (B, 1, 1, L)
    if additive_mask:  # eager attention adds the mask to its scores
        dtype = model.get_input_embeddings().weight.dtype
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
    cache = _RowCache(keys, values, positions)
    kwargs = {"logits_to_keep": 1} if keep_logits else {}
    out = model(input_ids=input_ids[:, None], attention_mask=mask, position_ids=positions[:, None],
                use_cache=True, return_dict=True, **{cache_arg: cache}, **kwargs)
    logits = out.logits[:, -1].float()  # (B, V)
    return logits if into is None else into.copy_(logits)


_compiled: dict[object, object] = {}  # backend -> decode_step compiled with it


def compiled_step(backend: str = "inductor"):
    """decode_step under torch.compile: one graph per batch bucket (dynamic=False); no CUDA graphs of its own
    (StaticKV captures them: decode_graphs.py)."""
    if backend not in _compiled:
        _compiled[backend] = torch.compile(decode_step, backend=backend, dynamic=False)
    return _compiled[backend]


# The backend `compiled` decoding uses; tests set "eager" to count dynamo's compilations without Inductor.
COMPILE_BACKEND = "inductor"
# device -> the recorder of the compiled step's CUDA graphs for one rollout, or None (no graphs). Tests
# inject one that records on the CPU (decode_graphs.py).
GRAPH_RECORDER = default_recorder


class StaticKV:
    """The preallocated K/V buffers of one rollout and the step that runs on them."""

    def __init__(self, model, micro_batch: int, rows: int, length: int, like: Prefill, *, compiled: bool,
                 keep_logits: bool):
        """rows: the buffers' (a bucket of micro_batch; a call with fewer rows than the micro-batch allocates
        fewer). The step's graphs depend on the bucket alone, not on `rows`: it gets views (bucket_views)."""
        device = like.keys[0].device
        columns = length + SPARE_COLUMNS
        self.keys = [torch.zeros((rows, k.shape[1], columns, k.shape[3]), dtype=k.dtype, device=device)
                     for k in like.keys]  # per layer (rows, H, L + spare, D)
        self.values = [torch.zeros((rows, v.shape[1], columns, v.shape[3]), dtype=v.dtype, device=device)
                       for v in like.values]
        self.micro_batch, self.rows, self.length, self.compiled = micro_batch, rows, length, compiled
        self.nbytes = sum(t.numel() * t.element_size() for t in self.keys + self.values)  # what it allocated
        # compiled under bf16 autocast: the step decodes from bf16 copies of the fp32 Linear weights
        self.weights = bf16_weight_copies(model, device.type) if compiled else {}
        unique = {id(p): p for mine in self.weights.values() for p in mine.values()}
        self.weight_bytes = sum(p.numel() * p.element_size() for p in unique.values())
        recorder = GRAPH_RECORDER(device) if compiled else None
        # the CUDA graphs of this rollout's steps, with their static buffers (rows x V fp32 logits)
        self.graphs = None if recorder is None else StepGraphs(recorder, rows, like.logits.shape[-1], device)
        self._views: dict[tuple[int, int], tuple[list[Tensor], list[Tensor]]] = {}
        impl = getattr(model.config, "_attn_implementation", None) or "eager"
        self.kwargs = dict(additive_mask=impl == "eager", cache_arg=cache_argument(model), keep_logits=keep_logits)
        self.grouped = grouped_decode_applies(model)  # sdpa; eager (the additive mask) runs as the model has it
        self.step = compiled_step(COMPILE_BACKEND) if compiled else decode_step

    def release(self) -> None:
        """End of the rollout: the CUDA graphs (with their pool and static buffers) and the K/V buffers go
        (the training step needs the memory); the next rollout allocates and captures afresh. The compiled
        code stays (compiled once per batch bucket and process)."""
        if self.graphs is not None:
            self.graphs.reset()  # first: they read the buffers and weight copies below
            self.graphs = None
        self.weights = {}
        # Freed now, whatever still refers to the tensors: under the memory profiler, in some test orders,
        # something still held them after the rollout (the profile counted them in the rollout batch; the
        # holder was not found), and an 8 GB card's training step needs that memory at once.
        for t in self.keys + self.values:
            t.untyped_storage().resize_(0)
        self.keys, self.values, self._views = [], [], {}

    def bucket_views(self, B: int, L: int) -> tuple[list[Tensor], list[Tensor]]:
        """Per layer, the K and V buffers' first B rows and first L columns: (B, H, L, D) views, made once per
        (batch, length) bucket and rollout. Compiled, their length is marked dynamic: one graph per batch
        bucket serves every length bucket (on CUDA, one captured graph per batch x length bucket)."""
        if (B, L) not in self._views:
            views = [k[:B, :, :L] for k in self.keys], [v[:B, :, :L] for v in self.values]
            for t in views[0] + views[1]:
                if self.compiled and len(length_buckets(self.length)) > 1:
                    torch._dynamo.maybe_mark_dynamic(t, 2)
            self._views[B, L] = views
        return self._views[B, L]

    def __call__(self, model, input_ids: Tensor, positions: Tensor, columns: int) -> Tensor:
        """The step for len(input_ids) rows whose positions are all below `columns` (finished rows' may not be:
        decode_step clamps them): it attends over the smallest length bucket that holds them. With CUDA
        graphs, a bucket's first step runs as is and is captured, its later steps replay it
        (decode_graphs.py)."""
        B, L = len(input_ids), length_bucket_for(columns, self.length)
        keys, values = self.bucket_views(B, L)

        def step(ids: Tensor, pos: Tensor, into: Optional[Tensor] = None) -> Tensor:
            with _weights_swapped(self.weights), (grouped_attention(model) if self.grouped
                                                  else contextlib.nullcontext()):
                return self.step(model, ids, pos, keys, values, into=into, **self.kwargs)
        if self.graphs is None:
            return step(input_ids, positions)
        return self.graphs((B, L), step, input_ids, positions)


class StaticSlots(Slots):
    """Slots (decode_slots.py) whose K/V live in a StaticKV, one row per slot, tokens from column 0.

    The history and its left-padded columns stay as in Slots (the repetition penalty reads them); only
    the cache differs: it never grows, never trims and never shifts, and a slot's length is its position."""

    def __init__(self, kv: StaticKV, n: int, pad_id: int, device: torch.device, empty_row: int):
        if n > kv.rows:
            raise ValueError(f"{n} slots do not fit the static cache's {kv.rows} rows")
        super().__init__(None, n, pad_id, device, empty_row=empty_row)
        self.kv = kv

    def _layers_ready(self) -> bool:
        return True

    def _cache_grow_left(self, n: int, like: Prefill) -> None:
        pass  # rows start at column 0: a longer prefix only widens the (host-side) history

    def _cache_trim(self, n: int) -> None:
        pass

    def _cache_place(self, idx: Tensor, slots: list[int], group: list[Entry], prefill: Prefill, W: int) -> None:
        """Each entry's prompt tokens among the prefill's first W columns go to columns 0.. of its slot's row."""
        by_prompt: dict[int, list[int]] = {}
        for s, e in zip(slots, group):
            by_prompt.setdefault(e.index, []).append(s)
        for j, rows in by_prompt.items():
            pad = prefill.width - next(e.prompt_len for e in group if e.index == j)  # its left padding
            n = W - pad  # its cached tokens
            if n <= 0:
                continue
            r = torch.tensor(rows, device=idx.device)
            for buf, src in zip(self.kv.keys + self.kv.values, prefill.keys + prefill.values):
                buf[r, :, :n] = src[j, :, pad:W]  # (len(rows), H, n, D) broadcast from one prompt

    def _cache_select(self, idx: Tensor) -> None:
        for buf in self.kv.keys + self.kv.values:
            buf[:len(idx)] = buf[idx]  # a gather (copy), then into the front rows

    def compaction(self, live: list[int], free: list[int], fraction: float) -> Optional[list[int]]:
        """Only into a smaller bucket: the live rows, then finished ones (inert) up to the bucket's size."""
        b = bucket_for(max(len(live), 1), self.kv.micro_batch)
        return live + free[:b - len(live)] if b < len(self) else None

    def forward(self, model, keep_logits: bool, cache_arg: str) -> Tensor:
        """(S, V). A slot's position is its cached tokens, width - its left padding (kept on the host): the step
        attends over the columns of the longest row (finished ones included until they leave), no device read."""
        return self.kv(model, self.inp, self.pos, columns=self.width - min(self.left_pad))
