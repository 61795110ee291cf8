"""The cheapest changes that make a run fit a card: each tried on a copy of the config and re-planned.

`SUGGESTIONS` lists the changes cheapest first (cost to training quality or speed, not bytes); `suggestions`
tries each alone and then cumulatively until the run fits, and returns them as `Suggestion`s with the
totals plan() predicts for them.

Design notes: docs/planner.md
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional

from ..config import Config, ConfigError, batch_plan
from . import vllm_plan
from .plan import Arch, MemoryPlan, ReadsLikeADict, evaluation_rows, margin_bytes, plan


@dataclass(frozen=True)
class Suggestion(ReadsLikeADict):
    """A change (or a combination, cheapest first) and the run's predicted memory with it."""

    change: str  # the settings as key=value, joined by " + " in a combination
    peak_bytes: int  # plan()'s peak with the change (allocator view)
    total_bytes: int  # with the margin (plan.margin_bytes)
    fits: bool  # within the budget, and vLLM (if used) starts in its share
    host_bytes: int  # the host RAM the run keeps with the change
    combined: bool = False  # a cumulative combination rather than a single change

    def to_dict(self) -> dict:
        """As `lowmem-grpo plan --json` prints it ("combined" only on a combination)."""
        found = {"change": self.change, "peak_bytes": self.peak_bytes, "total_bytes": self.total_bytes,
                 "fits": self.fits, "host_bytes": self.host_bytes}
        return {**found, "combined": True} if self.combined else found


# Changes the planner may suggest, cheapest first (cost to training quality/speed, not bytes):
# evaluation's own batch (costs evaluation time only), memory-only switches, then switches that cost
# time, then ones that change the algorithm's batch.
# Each reads the config it is applied to (so they compose) and returns the changes as
# {(section, key): value}, or None where it does not apply.
def _smaller_eval_batch(c: Config):
    """Evaluation decodes eval_batch_size held-out prompts at once (TRL: per_device_eval_batch_size): down to
    the rollout's generation micro-batch, then by halves (to 8)."""
    rows, gen_b = evaluation_rows(c), min(c.generation.generation_micro_batch_size, batch_plan(c).generation_batch_size)
    if rows > gen_b:
        return {("eval", "eval_batch_size"): gen_b}
    return {("eval", "eval_batch_size"): rows // 2} if rows > 8 else None


def _reference_on_cpu(c: Config):
    return {("train", "reference_compute"): "cpu"} if c.train.beta > 0 and c.train.reference_compute == "auto" else None


def _optimizer_in_backward(c: Config):
    if c.train.optimizer_in_backward or c.optim.offload_optimizer:  # (offloaded: no full gradient on the device)
        return None
    micro = batch_plan(c).micro_batches_per_generation  # the same generation batch, one step per micro-batch
    return {("train", "optimizer_in_backward"): True, ("train", "gradient_accumulation_steps"): 1,
            ("train", "steps_per_generation"): micro, ("train", "generation_batch_size"): None}


def _bf16_sr(c: Config):
    return {("model", "precision"): "bf16_sr"} if c.model.precision != "bf16_sr" else None


def _checkpointing_or_offload(c: Config):
    if not c.model.gradient_checkpointing:
        return {("model", "gradient_checkpointing"): True}
    return {("model", "offload_activations"): True} if not c.model.offload_activations else None


def _offload_optimizer(c: Config):
    """Optimizer states to host RAM (gradients sent down from backward hooks and summed there, so gradient
    accumulation stays as it is)."""
    if c.optim.offload_optimizer:
        return None
    edits = {("optim", "offload_optimizer"): True}
    if c.optim.optimizer == "paged_adamw_8bit":
        edits[("optim", "optimizer")] = "adamw_8bit"
    return edits


def _native_engine(c: Config):
    """The native rollout on the trained weights: no second copy of them, no vLLM share."""
    if not vllm_plan.uses_vllm(c):
        return None
    return {("generation", "engine"): "native", ("generation", "use_vllm"): None}


def _smaller_generation_micro_batch(c: Config):
    gen_b = min(c.generation.generation_micro_batch_size, batch_plan(c).generation_batch_size)
    return {("generation", "generation_micro_batch_size"): gen_b // 2} if gen_b > 8 else None


def _half_micro_batch(c: Config):
    """Half the micro-batch, twice as many of them: the same generation batch and optimizer step."""
    t = c.train
    if t.per_device_train_batch_size < 2 or t.per_device_train_batch_size % 2:
        return None
    micro = batch_plan(c).micro_batches_per_generation * 2
    edits = {("train", "per_device_train_batch_size"): t.per_device_train_batch_size // 2}
    if t.generation_batch_size is None:
        edits[("train", "steps_per_generation")] = micro
    if not t.optimizer_in_backward or c.optim.offload_optimizer:  # (on-device in backward: a micro-batch is a step)
        edits[("train", "gradient_accumulation_steps")] = t.gradient_accumulation_steps * 2
    return edits


def _offload_weights(c: Config):
    """The decoder layers' weights to host RAM, streamed a layer at a time; rollouts from an int8 copy (with the
    importance-sampling correction): what lets a model whose bf16 weights alone fill the card train on it."""
    m, g = c.model, c.generation
    if m.offload_weights or not m.gradient_checkpointing or vllm_plan.uses_vllm(c):
        return None
    edits = {("model", "offload_weights"): True}
    if not c.optim.offload_optimizer:
        edits[("optim", "offload_optimizer")] = True
    if c.optim.optimizer == "paged_adamw_8bit" or (m.precision == "bf16_sr" and c.optim.optimizer == "adamw"):
        edits[("optim", "optimizer")] = "adamw_8bit"
    if c.train.layer_major_backward is False:
        edits[("train", "layer_major_backward")] = None
    if g.rollout_quantization == "none":
        edits[("generation", "rollout_quantization")] = "int8"
    return edits


def _four_bit_rollouts(c: Config):
    """The rollout copy in 4 bits (nf4) instead of 8, corrected for per token: a 4-bit copy's sequence-level
    ratios fall far from 1 (docs/rollouts.md, "Compact rollouts")."""
    if c.generation.rollout_quantization != "int8":
        return None
    edits = {("generation", "rollout_quantization"): "nf4"}
    if c.train.vllm_importance_sampling_mode.startswith("sequence"):
        edits[("train", "vllm_importance_sampling_mode")] = "token_truncate"
    return edits


def _shorter_completions(c: Config):
    length = c.generation.max_completion_length
    return {("generation", "max_completion_length"): int(length * 0.75)} if length > 128 else None


SUGGESTIONS = (_smaller_eval_batch, _reference_on_cpu, _optimizer_in_backward, _bf16_sr, _checkpointing_or_offload,
               _offload_optimizer, _native_engine, _smaller_generation_micro_batch, _half_micro_batch,
               _offload_weights, _four_bit_rollouts, _shorter_completions)


def _apply(cfg: Config, edits: dict) -> Config:
    new = copy.deepcopy(cfg)
    for (section, key), value in edits.items():
        setattr(getattr(new, section), key, value)
    return new


def _describe(edits: dict) -> str:
    text = " ".join(f"{key}={str(v).lower() if isinstance(v, bool) else v}" for (_, key), v in edits.items()
                    if v is not None)
    if ("model", "precision") in edits:
        text += " (bf16 weights, stochastic rounding; GPU sm_80+)"
    if ("model", "offload_weights") in edits:
        text += " (layers streamed from host RAM; rollouts from a quantized copy, corrected for)"
    return text


def suggestions(cfg: Config, arch: Arch, budget: int, autocast: Optional[bool] = None,
                card_bytes: Optional[int] = None) -> list[Suggestion]:
    """Single changes and a cumulative combination (cheapest first) with their predicted totals (and the
    host RAM each needs). `autocast` as for plan(); `card_bytes` (default `budget`): the card vLLM takes a
    share of, where generation.engine=vllm (first suggestion then: the share vLLM needs, where less)."""
    card_bytes = card_bytes or budget

    def predicted(c: Config) -> Optional[MemoryPlan]:
        try:
            return plan(c, arch, autocast=autocast, card_bytes=card_bytes)
        except ConfigError:  # a change this config cannot take
            return None

    def entry(change: str, result: MemoryPlan, combined: bool = False) -> Suggestion:
        total = result.peak_bytes + margin_bytes(result.peak_bytes)
        starts = not (result.vllm and result.vllm["problem"])
        return Suggestion(change, result.peak_bytes, total, total <= budget and starts, result.host_bytes, combined)

    def vllm_share(c: Config):
        """vLLM's share down to what it needs for a whole batch (or to start), where that is less."""
        found = predicted(c) if vllm_plan.uses_vllm(c) else None
        if not (found and found.vllm):
            return None
        current, need = c.generation.vllm_gpu_memory_utilization, found.vllm
        wanted = [u for u in (need["whole_batch_utilization"], need["least_utilization"]) if u < current]
        return {("generation", "vllm_gpu_memory_utilization"): wanted[0]} if wanted else None

    def lowers_a_phase_over(before: MemoryPlan, after: MemoryPlan) -> bool:
        """Whether `after` lowers a phase of `before` that does not fit (not, e.g., a smaller evaluation
        batch where evaluation already fits)."""
        over = {p: v for p, v in before.phases.items() if v + margin_bytes(v) > budget}
        return any(after.phases.get(p, 0) < v for p, v in over.items())

    out, current = [], plan(cfg, arch, autocast=autocast, card_bytes=card_bytes)
    options = (vllm_share,) + SUGGESTIONS
    for option in options:
        edits = option(cfg)
        result = predicted(_apply(cfg, edits)) if edits else None
        if result is not None and lowers_a_phase_over(current, result):
            out.append(entry(_describe(edits), result))
    combined, steps = cfg, []
    for option in options:  # apply cheapest-first until it fits
        edits = option(combined)
        result = predicted(_apply(combined, edits)) if edits else None
        if result is None or not lowers_a_phase_over(current, result):
            continue
        current = result
        combined = _apply(combined, edits)
        steps.append(_describe(edits))
        if entry("", result).fits:
            if len(steps) > 1:
                out.append(entry(" + ".join(steps), result, combined=True))
            break
    return out
