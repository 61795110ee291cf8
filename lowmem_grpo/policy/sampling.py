"""Fast rollout sampling: one prefill per prompt, and rows that have finished leave the batch.

`generate()` as rollout.generate used it pays twice for things GRPO does not need:

* each prompt is repeated G times, so its prefill (the longest forward of a rollout) runs G times;
* a row that has produced EOS keeps decoding (its tokens are replaced by padding) until the last
  row of its micro-batch finishes, so with spread-out lengths most late steps compute dead rows.

`sample` prefills each distinct prompt once (left-padded batch of the distinct prompts, last-position
logits only, so no (B, L, V) tensor), copies the KV cache to the prompt's samples with the Cache's own
batch methods, and decodes step by step. Finished rows are dropped from the cache with
`batch_select_indices` once a quarter of the batch is dead (see `_COMPACT_FRACTION`).

The sampling distribution is generate()'s: the settings are resolved as generate() resolves them
(rollout.sampling_kwargs, with values left None taken from the model's own generation_config), the
logits go to fp32 and through transformers' own processors in generate()'s order (repetition penalty,
then temperature, top-k, top-p, min-p), then softmax + multinomial (argmax when greedy). Position ids
skip left padding and the 2D attention mask grows by one per step, as in generate(). The random
stream is generate()'s until the first row finishes (then finished rows draw no numbers here), so
samples match in distribution, greedy exactly (up to floating-point differences from batch shapes).

Not supported, checked up front by `fast_sampling_problem`: generation settings whose processors are
not implemented here (n-gram bans, bad words, min length, typical-p, ...; a model's
generation_config can set them), encoder-decoder models, and caches whose layers cannot select batch
rows (linear-attention / recurrent layers). rollout.generate then falls back to generate() and logs why.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import Tensor, nn

from ..config import GenerationConfig
from .model import position_ids_for
from .rollout import left_pad, sampling_kwargs  # rollout.generate imports this module when called

log = logging.getLogger(__name__)

# Compact when at least this fraction of the rows in the batch has finished. A compaction copies the
# whole KV cache (live rows x length x layers), about what one decode step's attention reads, while a
# dead row costs its share of every later step (all the linear layers, the attention, the logits).
# Waiting for a quarter bounds the wasted compute at 25% of a step and the number of copies at
# log_{4/3}(rows) (about 15 for 64 rows) however the lengths are spread.
_COMPACT_FRACTION = 0.25

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

    micro_batches: int = 0
    prefill_rows: int = 0  # distinct prompts prefilled
    decode_row_steps: int = 0  # rows summed over decode forwards: the decode compute
    compactions: int = 0  # batch_select_indices calls that dropped finished rows
    generated_tokens: int = 0  # completion tokens kept (up to and including EOS)


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
    """generate()'s precedence: explicit values (rollout.sampling_kwargs) > model.generation_config >
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


def _new_cache(model: nn.Module):
    from transformers import DynamicCache
    return DynamicCache(config=model.config.get_text_config(decoder=True))  # as generate() builds it


def _cache_problem(model: nn.Module) -> Optional[str]:
    try:
        cache = _new_cache(model)
    except Exception as e:  # noqa: BLE001 - any failure means "not this path"; the reason is logged
        return f"cannot build a DynamicCache for it ({e})"
    for layer in cache.layers:
        if not all(callable(getattr(layer, m, None)) for m in ("batch_select_indices", "batch_repeat_interleave")):
            return f"its cache layers ({type(layer).__name__}) cannot select batch rows"
    return None


def repetition_penalty_problem() -> Optional[str]:
    """None where transformers' repetition penalty takes per-row prompt padding lengths (as its own
    generate() passes them); older releases (e.g. 5.17) take one int, and generate() there treats
    padding differently, so the fast path does not try to match it."""
    from transformers.generation import RepetitionPenaltyLogitsProcessor
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
    """generate()'s processor list for these settings (same classes, same order, same conditions)."""
    from transformers.generation import (LogitsProcessorList, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                         TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)
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
        if s.min_p is not None:
            procs.append(MinPLogitsWarper(min_p=s.min_p, min_tokens_to_keep=1))
    return procs


def plan_micro_batches(counts: list[int], micro_batch: int) -> list[list[tuple[int, int]]]:
    """Split (prompt index, samples) into micro-batches of at most `micro_batch` rows.

    A prompt's samples stay together unless they do not fit in an empty micro-batch; then they fill
    the current one and continue in the next (each piece is prefilled once).
    """
    batches: list[list[tuple[int, int]]] = []
    cur: list[tuple[int, int]] = []
    room = micro_batch
    for i, c in enumerate(counts):
        if cur and room < c <= micro_batch:
            batches.append(cur)
            cur, room = [], micro_batch
        while c > 0:
            if room == 0:
                batches.append(cur)
                cur, room = [], micro_batch
            take = min(c, room)
            cur.append((i, take))
            c, room = c - take, room - take
    if cur:
        batches.append(cur)
    return batches


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
    """Last-position logits in fp32 (as generate() copies them) and the cache: (B, V), Cache."""
    if keep_logits:
        kwargs["logits_to_keep"] = 1
    out = model(**kwargs, use_cache=True, return_dict=True)
    return out.logits[:, -1].to(copy=True, dtype=torch.float32), out.past_key_values


def _decode(model: nn.Module, prompts: list[list[int]], counts: list[int], s: _Settings, *, eos: Tensor,
            pad_id: int, device: torch.device, max_new: int, keep_logits: bool, stats: SamplingStats) -> Tensor:
    """One micro-batch: completions (sum(counts), C) right-padded with pad_id, C <= max_new."""
    ids, mask = left_pad(prompts, pad_id)  # (k, P) each
    ids, mask = ids.to(device), mask.to(device)
    # generate() drops an all-ones mask (no padding): same attention path, same numbers
    attention = None if bool(mask.all()) else mask.long()  # (k, P)
    positions = position_ids_for(mask)  # (k, P), skips left padding
    logits, cache = _forward(model, keep_logits, input_ids=ids, attention_mask=attention, position_ids=positions,
                             past_key_values=_new_cache(model))  # (k, V)
    stats.prefill_rows += len(prompts)

    owner = torch.repeat_interleave(torch.arange(len(prompts), device=device),
                                    torch.tensor(counts, device=device))  # (n,) prompt of each row
    if len(set(counts)) == 1 and counts[0] > 1:
        cache.batch_repeat_interleave(counts[0])  # (k, ...) -> (k * G, ...)
    elif len(set(counts)) > 1:
        cache.batch_select_indices(owner)  # a gather: repeated indices copy a prompt's rows
    logits = logits[owner]  # (n, V)
    attention = None if attention is None else attention[owner]  # (n, P)
    next_pos = positions[owner, -1] + 1  # (n,)
    history = ids[owner]  # (n, P): the repetition penalty's view (prompt, then generated tokens)
    pad_lengths = (~mask).sum(1)[owner]  # (n,) generate(): (mask != 0).argmax(1), the same for left padding
    n = len(owner)
    rows = torch.arange(n, device=device)  # (live,) output row of each live row
    done = torch.zeros(n, dtype=torch.bool, device=device)  # (live,) produced EOS (still in the batch)
    out = torch.full((n, max_new), pad_id, dtype=torch.long, device=device)  # (n, max_new)
    lengths = torch.zeros(n, dtype=torch.long, device=device)  # (n,) tokens kept per row
    steps = 0
    for t in range(max_new):
        scores = _processors(s, pad_lengths)(history, logits)  # (live, V) fp32
        if s.greedy:
            nxt = torch.argmax(scores, dim=-1)  # (live,)
        else:
            probs = nn.functional.softmax(scores, dim=-1)
            nxt = torch.multinomial(probs, num_samples=1).squeeze(1)  # (live,)
        out[rows, t] = nxt.masked_fill(done, pad_id)  # no boolean indexing: no device sync here
        lengths.index_add_(0, rows, (~done).long())
        done = done | torch.isin(nxt, eos)
        steps = t + 1
        n_done = int(done.sum())
        if n_done == len(rows) or t == max_new - 1:
            break
        if n_done >= _COMPACT_FRACTION * len(rows):
            keep = (~done).nonzero().squeeze(1)  # (live',)
            cache.batch_select_indices(keep)
            rows, nxt, next_pos, history, pad_lengths = (x[keep] for x in (rows, nxt, next_pos, history, pad_lengths))
            attention = None if attention is None else attention[keep]
            done = done[keep]
            stats.compactions += 1
        if attention is not None:
            attention = torch.cat([attention, attention.new_ones((len(rows), 1))], 1)  # (live, P + t + 1)
        history = torch.cat([history, nxt[:, None]], 1)  # (live, P + t + 1)
        logits, cache = _forward(model, keep_logits, input_ids=nxt[:, None], attention_mask=attention,
                                 position_ids=next_pos[:, None], past_key_values=cache)  # (live, V)
        next_pos = next_pos + 1
        stats.decode_row_steps += len(rows)
    stats.generated_tokens += int(lengths.sum())
    return out[:, :steps]


@torch.no_grad()
def sample(model: nn.Module, prompts: list[list[int]], num_samples: Union[int, list[int]], cfg: GenerationConfig, *,
           eos_ids: list[int], pad_id: int, device: torch.device, greedy: bool = False,
           micro_batch: Optional[int] = None, autocast_bf16: bool = False, max_new_tokens: Optional[int] = None,
           stats: Optional[SamplingStats] = None) -> Tensor:
    """Completions of each prompt: (sum of samples, C) long on the CPU, right-padded with pad_id.

    Rows are prompt 0's samples, then prompt 1's, ... `num_samples` is one count for all prompts or one
    per prompt. A row holds its tokens up to and including its first EOS (any of eos_ids), then pad_id;
    C is the longest row (<= max_new_tokens, default cfg.max_completion_length). At most `micro_batch`
    rows (default cfg.generation_micro_batch_size) decode at once, which bounds the KV cache. Raises
    ValueError where `fast_sampling_problem` finds a reason this would not match generate().
    """
    counts = [num_samples] * len(prompts) if isinstance(num_samples, int) else list(num_samples)
    if len(counts) != len(prompts) or any(c < 0 for c in counts):
        raise ValueError(f"num_samples: need one count >= 0 per prompt, got {num_samples!r} for {len(prompts)} prompts")
    if any(len(p) == 0 for p, c in zip(prompts, counts) if c):
        raise ValueError("sample() needs non-empty prompts")
    settings, problem = _resolve(model, cfg, greedy)
    problem = problem or _cache_problem(model)
    if problem:
        raise ValueError(f"fast sampling cannot reproduce generate() here: {problem}")
    stats = stats if stats is not None else SamplingStats()
    micro_batch = micro_batch or cfg.generation_micro_batch_size
    max_new = max_new_tokens or cfg.max_completion_length
    keep_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
    eos = torch.tensor(eos_ids, dtype=torch.long, device=device)
    pieces: list[Tensor] = []
    was_training = model.training
    model.eval()  # checkpointing only acts in training mode, so the KV cache is used here
    try:
        for plan in plan_micro_batches(counts, micro_batch):
            stats.micro_batches += 1
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast_bf16):
                pieces.append(_decode(model, [prompts[i] for i, _ in plan], [c for _, c in plan], settings, eos=eos,
                                      pad_id=pad_id, device=device, max_new=max_new, keep_logits=keep_logits,
                                      stats=stats).cpu())
    finally:
        model.train(was_training)
    if not pieces:
        return torch.empty((0, 1), dtype=torch.long)
    width = max(max(p.shape[1] for p in pieces), 1)
    return torch.cat([nn.functional.pad(p, (0, width - p.shape[1]), value=pad_id) for p in pieces])


_fallbacks_logged: set[str] = set()


def use_fast_sampling(model: nn.Module, cfg: GenerationConfig, greedy: bool = False) -> bool:
    """generation.fast_rollout's switch: False where `sample` cannot match generate() (logged once per reason)."""
    problem = fast_sampling_problem(model, cfg, greedy)
    if problem and problem not in _fallbacks_logged:
        _fallbacks_logged.add(problem)
        log.warning("generation.fast_rollout: using transformers' generate() instead: %s", problem)
    return problem is None
