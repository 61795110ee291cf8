"""Fast rollout sampling: one prefill per prompt, finished rows leave the batch, free slots are refilled.

`sample` returns completions of the same distribution as transformers' generate() (greedy: the same
tokens, up to floating-point differences): up to `micro_batch` rows decode in slots (decode_slots.py),
each distinct prompt is prefilled once for all its samples, a finished row's slot goes to the next
waiting sample, and finished rows are compacted away once nothing waits. The host reads the stop flags
only every `_READ_EVERY` steps. The decode step is "dynamic" (a growing DynamicCache), "static" or
"compiled" (static_decode.py). Settings are resolved and logits processed as generate() does;
`fast_sampling_problem` says where that cannot be matched, and rollout.generate then uses generate().
Also here: the switches that pick the decode step and fall back from a failed compiled step.
Design notes: docs/rollouts.md
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections import deque
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch._dynamo.exc
from torch import Tensor, nn
from transformers.generation import (LogitsProcessorList, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                     TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from ..config import GenerationConfig
from .batch import left_pad
from .decode_graphs import GraphCaptureError
from .decode_slots import (Entry, Prefill, Slots, cache_argument, cache_layers_problem, last_logits, new_cache,
                           returned_cache)
from .model import position_ids_for
from .packed_linear import packed_linears
from .static_decode import DECODE_MODES, StaticKV, StaticSlots, bucket_for, static_decode_problem

try:
    from torch._inductor.exc import InductorError
except ImportError:  # older torch: Inductor's failures come wrapped in dynamo's BackendCompilerFailed
    InductorError = None

log = logging.getLogger(__name__)

# Compact when at least this fraction of the rows in the batch has finished: at most 25% of a step
# wasted on dead rows, at most log_{4/3}(rows) copies of the cache (docs/rollouts.md, "When to compact").
_COMPACT_FRACTION = 0.25

# Decode steps between two host reads of the stop flags (the loop's only device -> host read, where
# refills and compactions are decided): every step on the CPU, where a read costs nothing; every 8
# elsewhere, so the host queues steps ahead of the device (docs/rollouts.md, "When the host reads").
_READ_EVERY = {"cpu": 1}
_READ_EVERY_ELSEWHERE = 8

# generate() settings that add a logits processor this module does not implement, with the test
# for "active" that generate() applies (a model's generation_config.json can set any of them).
_UNSUPPORTED = {
    "guidance_scale": lambda v: v is not None and v != 1,
    "sequence_bias": lambda v: v is not None,
    "no_repeat_ngram_size": lambda v: v is not None and v > 0,
    "bad_words_ids": lambda v: v is not None,
    "min_length": lambda v: v is not None and v > 0,
    "min_new_tokens": lambda v: v is not None and v > 0,
    "forced_bos_token_id": lambda v: v is not None,
    "forced_eos_token_id": lambda v: v is not None,
    "remove_invalid_values": lambda v: bool(v),
    "exponential_decay_length_penalty": lambda v: v is not None,
    "suppress_tokens": lambda v: v is not None,
    "begin_suppress_tokens": lambda v: v is not None,
    "watermarking_config": lambda v: v is not None,
    "renormalize_logits": lambda v: bool(v),
    "num_beams": lambda v: v is not None and v > 1,
    "num_return_sequences": lambda v: v is not None and v > 1,
}
_UNSUPPORTED_WHEN_SAMPLING = {
    "top_h": lambda v: v is not None,
    "typical_p": lambda v: v is not None and v < 1.0,
    "epsilon_cutoff": lambda v: v is not None and 0.0 < v < 1.0,
    "eta_cutoff": lambda v: v is not None and 0.0 < v < 1.0,
}


@dataclass
class SamplingStats:
    """What a `sample` call did (for tests, logs and benchmarks); counts add up over calls."""

    micro_batches: int = 0  # batches started with every slot empty
    prefill_rows: int = 0  # distinct prompts prefilled
    decode_steps: int = 0  # decode forwards
    decode_row_steps: int = 0  # rows summed over decode forwards: the decode compute
    refills: int = 0  # rows started in the slot of a finished row while others decode
    decode_steps_queued: int = 0  # decode_steps taken while samples were still waiting for a slot
    decode_row_steps_queued: int = 0  # decode_row_steps of those steps
    compactions: int = 0  # times finished rows were dropped from the batch
    host_reads: int = 0  # device -> host reads of the stop flags
    generated_tokens: int = 0  # completion tokens kept (up to and including EOS)

    @property
    def mean_rows_per_step(self) -> float:
        return self.decode_row_steps / max(self.decode_steps, 1)

    @property
    def mean_rows_per_step_queued(self) -> float:
        """Rows per decode step while samples waited: the micro-batch, if every finished slot is refilled."""
        return self.decode_row_steps_queued / max(self.decode_steps_queued, 1)


def sampling_kwargs(cfg: GenerationConfig, greedy: bool = False) -> dict:
    """The sampling arguments of transformers' generate() for these settings (all of them explicit)."""
    if greedy:
        return dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    # Every knob is set explicitly: generate() fills values left as None from the model's own
    # generation_config.json (Qwen2.5-Instruct's sets top_k, top_p and a repetition penalty), which
    # would silently change the sampling distribution from the one configured. 0 means "off".
    return dict(do_sample=True, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                min_p=0.0 if cfg.min_p is None else cfg.min_p, repetition_penalty=cfg.repetition_penalty)


@dataclass(frozen=True)
class _Settings:
    """The effective generation settings, resolved as generate() resolves them."""

    greedy: bool
    temperature: Optional[float]
    top_k: Optional[int]
    top_p: Optional[float]
    min_p: Optional[float]
    repetition_penalty: Optional[float]


def _resolve(model: nn.Module, cfg: GenerationConfig, greedy: bool) -> tuple[_Settings, Optional[str]]:
    """generate()'s precedence: explicit values (sampling_kwargs) > model.generation_config >
    transformers' defaults (all "off" for processors). Returns (settings, why unsupported or None)."""
    explicit = sampling_kwargs(cfg, greedy)
    model_gc = getattr(model, "generation_config", None)

    def value(name: str):
        v = explicit.get(name)
        return getattr(model_gc, name, None) if v is None else v

    problem = None
    if getattr(model.config, "is_encoder_decoder", False):
        problem = "encoder-decoder model"
    checks = dict(_UNSUPPORTED, **({} if greedy else _UNSUPPORTED_WHEN_SAMPLING))
    for name, active in checks.items():
        if problem is None and active(value(name)):
            problem = f"generation setting {name}={value(name)!r} (from the model's generation_config)"
    settings = _Settings(greedy=greedy, temperature=value("temperature"), top_k=value("top_k"),
                         top_p=value("top_p"), min_p=value("min_p"),
                         repetition_penalty=value("repetition_penalty"))
    return settings, problem


def _cache_problem(model: nn.Module) -> Optional[str]:
    try:
        cache = new_cache(model)
    except Exception as e:  # noqa: BLE001 - any failure means "not this path"; the reason is logged
        return f"cannot build a DynamicCache for it ({e})"
    for layer in cache.layers:  # (built from the config; some releases add layers only at the first update)
        if type(layer).__name__ != "DynamicLayer":
            return f"its cache layers ({type(layer).__name__}) are not plain growing key/value layers"
    return None


def repetition_penalty_problem() -> Optional[str]:
    """None where transformers' repetition penalty takes per-row prompt padding lengths (as its own
    generate() passes them); older releases (e.g. 5.17) take one int, and generate() there treats
    padding differently, so the fast path does not try to match it."""
    try:
        RepetitionPenaltyLogitsProcessor(1.1, prompt_ignore_length=torch.zeros(1, dtype=torch.long))
    except (TypeError, ValueError):
        return "this transformers' repetition penalty takes no per-row prompt lengths"
    return None


def fast_sampling_problem(model: nn.Module, cfg: GenerationConfig, greedy: bool = False) -> Optional[str]:
    """Why `sample` cannot reproduce generate() for this model and these settings, or None if it can."""
    settings, problem = _resolve(model, cfg, greedy)
    problem = problem or _cache_problem(model)
    if problem is None and settings.repetition_penalty not in (None, 1.0):
        problem = repetition_penalty_problem()
    return problem


def _processors(s: _Settings, pad_lengths: Tensor):
    """generate()'s processor list for these settings (same classes, same order, same conditions), less
    min-p at 0, which generate() runs and which returns its scores unchanged (a softmax and a top-k over the
    vocabulary per step: ~8% of a 64-row CPU decode step of SmolLM2-135M)."""
    procs = LogitsProcessorList()
    if s.repetition_penalty is not None and s.repetition_penalty != 1.0:
        # generate() passes the prompt's left-padding lengths, so pad ids are not penalised
        procs.append(RepetitionPenaltyLogitsProcessor(s.repetition_penalty, prompt_ignore_length=pad_lengths))
    if not s.greedy:
        if s.temperature is not None and s.temperature != 1.0:
            procs.append(TemperatureLogitsWarper(s.temperature))
        if s.top_k is not None and s.top_k != 0:
            procs.append(TopKLogitsWarper(top_k=s.top_k, min_tokens_to_keep=1))
        if s.top_p is not None and s.top_p < 1.0:
            procs.append(TopPLogitsWarper(top_p=s.top_p, min_tokens_to_keep=1))
        if s.min_p is not None and s.min_p > 0:  # at 0 it removes nothing (probs < 0 never holds): skipped
            procs.append(MinPLogitsWarper(min_p=s.min_p, min_tokens_to_keep=1))
    return procs


# Tokens per block of the CPU draw: a block is chosen from the running sums of the blocks' probabilities,
# then a token inside it (see draw).
DRAW_BLOCK = 256


def draw(scores: Tensor) -> Tensor:
    """One token per row from softmax(scores): (S, V) fp32 -> (S,) long.

    On a GPU: torch.multinomial, as generate() draws. On the CPU: the inverse of each row's cumulative
    distribution at one float64 uniform u per row, in two levels: the block of DRAW_BLOCK tokens whose
    running float64 sum of block totals first exceeds u x the row's total, then the token inside it whose
    running float64 sum of probabilities first exceeds what is left of u. A token is drawn with its
    probability up to the rounding of its block's fp32 total (a relative ~1e-6); tokens of probability
    0 never are, nor those under ~1e-16 of their block's total. It reads the probabilities once and draws
    one number per row: at (64, 49152) an exponential race over every token took 8x its time, torch's CPU
    multinomial 25x (docs/rollouts.md)."""
    probs = nn.functional.softmax(scores, dim=-1)  # (S, V)
    if probs.device.type != "cpu":
        return torch.multinomial(probs, num_samples=1).squeeze(1)
    S, V = probs.shape
    whole = V // DRAW_BLOCK
    sums = probs[:, :whole * DRAW_BLOCK].view(S, whole, DRAW_BLOCK).sum(-1)  # (S, whole) fp32: fast
    if whole * DRAW_BLOCK < V:  # the last, shorter block
        sums = torch.cat([sums, probs[:, whole * DRAW_BLOCK:].sum(-1, keepdim=True)], 1)
    ends = sums.double().cumsum_(-1)  # (S, blocks): where each block's share of [0, total) ends
    # float64 uniforms are at most 1 - 2**-53, and (1 - 2**-53) x total rounds below total: u < total
    u = torch.rand((S, 1), dtype=torch.float64).mul_(ends[:, -1:])  # (S, 1)
    block = torch.searchsorted(ends, u, right=True)  # (S, 1): the first block ending above u
    u -= torch.where(block > 0, ends.gather(1, (block - 1).clamp_(min=0)), 0.0)  # u within the block
    columns = block * DRAW_BLOCK + torch.arange(DRAW_BLOCK, device=probs.device)  # (S, DRAW_BLOCK)
    inner = probs.gather(1, columns.clamp(max=V - 1)).masked_fill_(columns >= V, 0.0)
    inner_ends = inner.cumsum(-1, dtype=torch.float64)
    # the block's fp32 total and its float64 running sum differ in the last bits: u stays below the latter
    u = torch.minimum(u, torch.nextafter(inner_ends[:, -1:], torch.zeros_like(u)))
    return (block * DRAW_BLOCK + torch.searchsorted(inner_ends, u, right=True)).squeeze(1)


def group_runs(prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Consecutive identical prompts -> (distinct prompts, run lengths): callers repeat a prompt G times."""
    distinct: list[list[int]] = []
    counts: list[int] = []
    for p in prompts:
        if distinct and list(p) == distinct[-1]:
            counts[-1] += 1
        else:
            distinct.append(list(p))
            counts.append(1)
    return distinct, counts


def _forward(model: nn.Module, keep_logits: bool, **kwargs) -> tuple[Tensor, object]:
    """Last-position logits in fp32 (decode_slots.last_logits) and the cache: (B, V), Cache."""
    if keep_logits:
        kwargs["logits_to_keep"] = 1
    out = model(**kwargs, use_cache=True, return_dict=True)
    return last_logits(out), returned_cache(out)


@dataclass
class _Waiting:
    """A prompt whose samples have not all started; the next one becomes output row `out_row`."""

    prompt: list[int]
    out_row: int
    count: int
    prefill: Optional[Prefill] = None  # where its K/V are, once prefilled
    index: int = 0  # its row in prefill


class _Queue:
    """The samples still to start, in output-row order (prompt 0's samples, then prompt 1's, ...)."""

    def __init__(self, prompts: list[list[int]], counts: list[int]):
        self.waiting: deque[_Waiting] = deque()
        self.rows = 0
        for p, c in zip(prompts, counts):
            if c:
                self.waiting.append(_Waiting(list(p), self.rows, c))
                self.rows += c

    def __bool__(self) -> bool:
        return bool(self.waiting)

    def take(self, n: int, prefill) -> list[Entry]:
        """Up to n rows to start. Prompts are prefilled when their first sample starts, together with the
        following prompts this take also reaches; the rest of a prompt's samples wait with its prefill."""
        entries: list[Entry] = []
        while len(entries) < n and self.waiting:
            if self.waiting[0].prefill is None:  # prefilled prompts are always a prefix of the queue
                need, batch = n - len(entries), []
                for w in self.waiting:
                    if need <= 0:
                        break
                    batch.append(w)
                    need -= w.count
                prefill(batch)
            w = self.waiting[0]
            m = min(w.count, n - len(entries))
            entries += [Entry(w.prefill, w.index, w.prompt[-1], len(w.prompt), w.out_row + i) for i in range(m)]
            w.out_row, w.count = w.out_row + m, w.count - m
            if w.count == 0:
                self.waiting.popleft()
        return entries


def _prefill(model: nn.Module, waiting: list[_Waiting], *, pad_id: int, device: torch.device, keep_logits: bool,
             stats: SamplingStats) -> None:
    """Run these prompts once, as one left-padded batch: (k, W) tokens, last-position logits only."""
    stats.prefill_rows += len(waiting)
    ids, mask = left_pad([w.prompt for w in waiting], pad_id)  # (k, W) each
    # generate() drops an all-ones mask (no padding): same attention path, same numbers
    attention = None if bool(mask.all()) else mask.long().to(device)
    ids, mask = ids.to(device), mask.to(device)
    logits, cache = _forward(model, keep_logits, input_ids=ids, attention_mask=attention,
                             position_ids=position_ids_for(mask), **{cache_argument(model): new_cache(model)})  # (k, V)
    problem = cache_layers_problem(cache)
    if problem:
        raise RuntimeError(f"fast sampling: {problem}")
    prefill = Prefill(keys=[layer.keys for layer in cache.layers], values=[layer.values for layer in cache.layers],
                      ids=ids, mask=mask, logits=logits)
    for j, w in enumerate(waiting):
        w.prefill, w.index = prefill, j


class _Rollout:
    """One `sample` call: the queue of samples, the slots decoding, the output rows."""

    def __init__(self, model: nn.Module, queue: _Queue, s: _Settings, *, eos: Tensor, pad_id: int,
                 device: torch.device, max_new: int, micro_batch: int, refill: bool, read_every: int,
                 keep_logits: bool, stats: SamplingStats, decode: str = "dynamic", static_length: int = 0):
        self.model, self.queue, self.s, self.eos, self.pad_id, self.device = model, queue, s, eos, pad_id, device
        self.max_new, self.micro_batch, self.refill, self.read_every = max_new, micro_batch, refill, read_every
        self.keep_logits, self.stats, self.decode_mode, self.static_length = keep_logits, stats, decode, static_length
        self.cache_arg = cache_argument(model)
        self.static: Optional[StaticKV] = None  # decode "static"/"compiled": the rollout's preallocated cache
        # (N + 1, max_new + 1): the last column takes the tokens that finished rows draw until the next read,
        # the last row those of empty slots (a static bucket larger than its rows)
        self.out = torch.full((queue.rows + 1, max_new + 1), pad_id, dtype=torch.long, device=device)
        self.lengths = torch.zeros(queue.rows + 1, dtype=torch.long, device=device)  # (N + 1,) tokens kept per row
        self.slots: Optional[Slots] = None
        self.first_logits: Optional[Tensor] = None  # (S, V): a new batch's first tokens come from its prefills

    def _start(self, n: int) -> list[Entry]:
        return self.queue.take(n, lambda waiting: _prefill(self.model, waiting, pad_id=self.pad_id, device=self.device,
                                                             keep_logits=self.keep_logits, stats=self.stats))

    def schedule(self) -> bool:
        """A host read: rows that have finished leave their slots, refilled from the queue (`refill`), or
        compacted away once the queue is empty; a new batch when every row has finished. False: all done."""
        slots, stats = self.slots, self.stats
        done = [] if slots is None else slots.done.tolist()  # the one device -> host read
        stats.host_reads += slots is not None
        free = [i for i, d in enumerate(done) if d]
        if len(free) == len(done):  # every row finished (or nothing started yet)
            if not self.queue:
                return False
            entries = self._start(self.micro_batch)
            self.slots = self._new_slots(entries)
            self.slots.place(list(range(len(entries))), entries, whole_prompt=True)
            first = torch.stack([e.prefill.logits[e.index] for e in entries])  # (n, V)
            self.first_logits = nn.functional.pad(first, (0, 0, 0, len(self.slots) - len(entries)))  # (S, V)
            stats.micro_batches += 1
            return True
        if self.refill and self.queue and free:
            entries = self._start(len(free))
            slots.place(free[:len(entries)], entries, whole_prompt=False)
            stats.refills += len(entries)
            free = free[len(entries):]
        if (not self.refill or not self.queue) and free:
            gone = set(free)
            keep = slots.compaction([i for i in range(len(done)) if i not in gone], free, _COMPACT_FRACTION)
            if keep is not None:
                slots.select(keep)
                stats.compactions += 1
        slots.trim()
        return True

    def _new_slots(self, entries: list[Entry]) -> Slots:
        """Slots for a new batch: as many as entries (dynamic), or the smallest bucket that holds them (static)."""
        if self.decode_mode == "dynamic":
            return Slots(self.model, len(entries), self.pad_id, self.device, columns=self.static_length)
        if self.static is None:  # the first batch: its prefill gives the K/V shapes and dtype
            # rows: the micro-batch, or the bucket that holds every row of this call if fewer (memory/plan.py)
            rows = bucket_for(min(self.micro_batch, len(self.out) - 1), self.micro_batch)
            self.static = StaticKV(self.model, self.micro_batch, rows, self.static_length, entries[0].prefill,
                                   compiled=self.decode_mode == "compiled", keep_logits=self.keep_logits)
        return StaticSlots(self.static, bucket_for(len(entries), self.micro_batch), self.pad_id, self.device,
                           empty_row=len(self.out) - 1)

    def decode(self, steps: int) -> None:
        """`steps` decode steps of every slot, with no device -> host read: stop flags stay on the device."""
        slots, s = self.slots, self.s
        procs = _processors(s, torch.tensor(slots.left_pad, device=self.device))  # the padding changes only at reads
        queued = bool(self.queue)  # likewise
        for _ in range(steps):
            if self.first_logits is not None:  # a new batch: its prompts' logits are known
                logits, self.first_logits = self.first_logits, None
            else:
                slots.append_input()  # history, mask: (S, L + 1)
                logits = slots.forward(self.model, self.keep_logits, self.cache_arg)  # (S, V) fp32
                slots.pos += 1
                self.stats.decode_steps += 1
                self.stats.decode_row_steps += len(slots)
                if queued:
                    self.stats.decode_steps_queued += 1
                    self.stats.decode_row_steps_queued += len(slots)
            scores = procs(slots.history, logits)  # (S, V) fp32
            nxt = torch.argmax(scores, dim=-1) if s.greedy else draw(scores)  # (S,)
            self.out[slots.out_row, torch.where(slots.done, self.max_new, slots.ngen)] = nxt
            slots.ngen += (~slots.done).long()
            self.lengths[slots.out_row] = slots.ngen
            slots.done |= torch.isin(nxt, self.eos) | (slots.ngen >= self.max_new)
            slots.inp = nxt

    def run(self) -> Tensor:
        """Completions (N, C) right-padded with pad_id, C <= max_new."""
        while self.schedule():
            self.decode(self.read_every)
        lengths = self.lengths[:-1]  # (N,): the last row is the empty slots'
        self.stats.generated_tokens += int(lengths.sum())
        width = max(int(lengths.max()), 1) if len(lengths) else 1
        return self.out[:-1, :width]


@torch.no_grad()
def sample(model: nn.Module, prompts: list[list[int]], num_samples: Union[int, list[int]], cfg: GenerationConfig, *,
           eos_ids: list[int], pad_id: int, device: torch.device, greedy: bool = False,
           micro_batch: Optional[int] = None, autocast_bf16: bool = False, max_new_tokens: Optional[int] = None,
           stats: Optional[SamplingStats] = None, refill: bool = True, read_every: Optional[int] = None,
           decode: str = "dynamic", packed: Union[bool, str] = False) -> Tensor:
    """Completions of each prompt: (sum of samples, C) long on the CPU, right-padded with pad_id.

    Rows are prompt 0's samples, then prompt 1's, ... `num_samples` is one count for all prompts or one
    per prompt. A row holds its tokens up to and including its first EOS (any of eos_ids), then pad_id;
    C is the longest row (<= max_new_tokens, default cfg.max_completion_length). At most `micro_batch`
    rows (default cfg.generation_micro_batch_size) decode at once, which bounds the KV cache. `refill`:
    a finished row's slot goes to the next waiting sample (False: a new batch starts only when every
    row of the last one has finished). `read_every`: decode steps between
    host reads of the stop flags (default `_READ_EVERY`). `decode`: "dynamic" (a growing DynamicCache),
    "static" (policy/static_decode.py: a cache preallocated for micro_batch rows x (max(max_prompt_length,
    longest prompt) + max_new_tokens) columns, the step at batch-size buckets) or "compiled" (that step
    under torch.compile; CUDA graphs on a GPU); the same tokens (greedy) and distribution. `packed` (CPU,
    not with "compiled"): True, the Linear layers run on copies of their weights packed once for this call;
    "head", the output head alone (policy/packed_linear.py; bf16 computes the same numbers where the CPU
    has oneDNN's bf16 GEMM; fp32, and bf16 widened to fp32 where it has none, differ by GEMM rounding). Raises
    ValueError where `fast_sampling_problem` finds a reason this would not match generate().
    """
    counts = [num_samples] * len(prompts) if isinstance(num_samples, int) else list(num_samples)
    if len(counts) != len(prompts) or any(c < 0 for c in counts):
        raise ValueError(f"num_samples: need one count >= 0 per prompt, got {num_samples!r} for {len(prompts)} prompts")
    if any(len(p) == 0 for p, c in zip(prompts, counts) if c):
        raise ValueError("sample() needs non-empty prompts")
    if read_every is not None and read_every < 1:
        raise ValueError(f"read_every must be >= 1 decode step, got {read_every}")
    if decode not in DECODE_MODES:
        raise ValueError(f"decode must be one of {', '.join(DECODE_MODES)}, got {decode!r}")
    settings, problem = _resolve(model, cfg, greedy)
    problem = problem or _cache_problem(model)
    if problem:
        raise ValueError(f"fast sampling cannot reproduce generate() here: {problem}")
    if packed and decode == "compiled":
        raise ValueError(f"packed={packed!r} packs the eager step's Linear weights; the compiled step "
                         "(decode='compiled') does not run them: use decode='dynamic' or 'static' with it")
    if decode != "dynamic" and static_decode_problem(model):
        raise ValueError(f"decode={decode!r}: {static_decode_problem(model)}; use decode='dynamic'")
    queue = _Queue(prompts, counts)
    if not queue.rows:
        return torch.empty((0, 1), dtype=torch.long)
    stats = stats if stats is not None else SamplingStats()
    max_new = max_new_tokens or cfg.max_completion_length
    static_length = max(cfg.max_prompt_length, max(len(p) for p, c in zip(prompts, counts) if c)) + max_new
    rollout = _Rollout(model, queue, settings, eos=torch.tensor(eos_ids, dtype=torch.long, device=device),
                       pad_id=pad_id, device=device, max_new=max_new, decode=decode, static_length=static_length,
                       micro_batch=micro_batch or cfg.generation_micro_batch_size, refill=refill,
                       read_every=read_every or _READ_EVERY.get(device.type, _READ_EVERY_ELSEWHERE),
                       keep_logits="logits_to_keep" in inspect.signature(model.forward).parameters, stats=stats)
    was_training = model.training
    model.eval()  # checkpointing only acts in training mode, so the KV cache is used here
    try:
        # The compiled step decodes from bf16 copies of the fp32 weights (static_decode.bf16_weight_copies):
        # autocast's cache would hold a second set, so the eager prefills cast theirs per call.
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast_bf16,
                            cache_enabled=decode != "compiled"), \
                (packed_linears(model, rollout.micro_batch, autocast_bf16, head_only=packed == "head") if packed
                 else contextlib.nullcontext()):
            completions = rollout.run().cpu()
        if decode == "compiled":
            global _compiled_rollouts
            _compiled_rollouts += 1
        return completions
    finally:
        model.train(was_training)
        if rollout.static is not None:
            rollout.static.release()


_fallbacks_logged: set[str] = set()


def use_fast_sampling(model: nn.Module, cfg: GenerationConfig, greedy: bool = False) -> bool:
    """generation.fast_rollout's switch: False where `sample` cannot match generate() (logged once per reason)."""
    problem = fast_sampling_problem(model, cfg, greedy)
    if problem and problem not in _fallbacks_logged:
        _fallbacks_logged.add(problem)
        log.warning("generation.fast_rollout: using transformers' generate() instead: %s", problem)
    return problem is None


_compile_failures: list[str] = []  # why the compiled step failed in this process (then: the dynamic step)
_compiled_rollouts = 0  # compiled rollouts that ran to the end in this process


def compile_errors() -> tuple[type, ...]:
    """The exceptions of a failed torch.compile (dynamo's, and Inductor's where it raises its own) and of a
    failed CUDA graph capture of the step (decode_graphs.py)."""
    if InductorError is None:
        return (torch._dynamo.exc.TorchDynamoException, GraphCaptureError)
    return (torch._dynamo.exc.TorchDynamoException, InductorError, GraphCaptureError)


def falls_back(error: Exception) -> bool:
    """Whether a compiled rollout that raised `error` is sampled again with the dynamic step: any exception
    in the process's first compiled rollout (compiling, capturing and the first replays all happen there;
    none of them may stop a run that the dynamic step would finish), and afterwards those of compiling and
    capturing (a bucket first met in a later rollout is compiled or captured then)."""
    return not _compiled_rollouts or isinstance(error, compile_errors())


def compile_failed(error: Exception) -> None:
    """The compiled step failed: this process decodes with the dynamic step from now on (logged once)."""
    _compile_failures.append(f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
    log.warning("generation.compile_decode: the compiled decode step failed (%s); this rollout and the next "
                "ones use the dynamic step. Set generation.compile_decode=false to skip the attempt.",
                _compile_failures[-1])


def decode_mode(model: nn.Module, cfg: GenerationConfig, device: torch.device) -> str:
    """generation.compile_decode as `sample`'s decode: "compiled" when true, or auto on CUDA (the compiled
    step did not pay on the CPU: benchmarks/RESULTS.md); else "dynamic". A model the static step cannot
    run keeps the dynamic step (logged once per reason), as does a process where compiling it failed."""
    on = cfg.compile_decode is True or (cfg.compile_decode == "auto" and device.type == "cuda")
    on = on and not _compile_failures
    problem = static_decode_problem(model) if on else None
    if problem and problem not in _fallbacks_logged:
        _fallbacks_logged.add(problem)
        log.warning("generation.compile_decode: decoding without the compiled static step: %s", problem)
    return "compiled" if on and problem is None else "dynamic"
