"""The arithmetic of one loss micro-batch: which rows are trained, what the loss is multiplied by and
divided by, and the token counts the step reports. Pure functions of the micro-batch and the settings.

    trained_rows(mb, train)         (b,) bool: completions whose gradient is not known to be zero
    plan_micro_batch(mb, train, d)  MicroBatchWork: the rows to run, their scale and completion tokens
    loss_denominator(loss_type, n)  dapo, cispo, vespo: n, the step's completion tokens over every rank
    loss_factor(scale, train, ws)   what the fused head's loss is multiplied by before backward
                                    (step_loss_factor: the same from the two settings it reads)
    computed_tokens(mb, pack, dec)  decoder positions the micro-batch computes (tokens_per_second)

The fused head normalises grpo, sapo, luspo, bnpo and dr_grpo per micro-batch, and dapo, cispo and
vespo by `loss_denominator` (global). The factor then restores the denominator of skipped rows
(`skipped_rows_scale`) and makes the step a mean over the accumulated micro-batches (divide by
gradient_accumulation_steps), or, for the global-count types, a sum over ranks (multiply by the world size).
Design notes: docs/training.md (loss scaling)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..config import TrainConfig
from ..policy.batch import Batch
from ..policy.packing import Packing, prompt_groups, should_pack


# The loss types whose denominator is the optimizer step's completion tokens over every rank (TRL's
# num_items_in_batch); the others normalise within each micro-batch.
GLOBAL_TOKEN_COUNT = ("dapo", "cispo", "vespo")


def trained_rows(batch: Batch, train: TrainConfig) -> torch.Tensor:
    """(N,) bool: the completions whose gradient is not known in advance to be exactly zero.

    With beta == 0 a completion with A == 0 has loss 0 and gradient 0 for any ratio, so
    train.skip_zero_advantage leaves it out of the forward and backward (and of the old log-prob pass).
    With beta > 0 its KL term still has a gradient, and with top_entropy_quantile < 1 every token moves the
    entropy threshold: every row is trained."""
    if (not train.skip_zero_advantage or train.beta != 0 or train.top_entropy_quantile < 1.0
            or batch.advantages is None):
        return torch.ones(len(batch), dtype=torch.bool)
    return batch.advantages != 0


def skipped_rows_scale(mb: Batch, keep: torch.Tensor, loss_type: str) -> float:
    """Factor that gives the loss of the kept rows of micro-batch `mb` the denominator of the whole
    micro-batch. grpo, sapo, luspo and dr_grpo divide by the number of sequences, bnpo by the masked
    tokens; the denominator of dapo, cispo and vespo (num_items_in_batch) is counted over every row already."""
    if keep.all() or loss_type in GLOBAL_TOKEN_COUNT:
        return 1.0
    if loss_type == "bnpo":
        return int(mb.completion_mask[keep].sum()) / int(mb.completion_mask.sum())
    return int(keep.sum()) / len(keep)


@dataclass(frozen=True)
class MicroBatchWork:
    """What the step does with one micro-batch.

    rows:    the rows that run forward and backward (on the host), or None: nothing runs
    scale:   skipped_rows_scale of the kept rows; 0.0 for a rank that runs only for the collectives
    tokens:  completion tokens of `rows` (the head's mask count, counted on the host; 0 if None)
    learns:  False when nothing is learned (every token masked or every completion skipped): the loss
             is not a metric and the backward not counted
    skipped: every completion skipped on one process (the step mode is told: no backward at all)"""

    rows: Optional[Batch]
    scale: float
    tokens: int
    learns: bool
    skipped: bool = False


def plan_micro_batch(mb: Batch, train: TrainConfig, distributed: bool) -> MicroBatchWork:
    """The rows of `mb` to train and their loss scale. With nothing to learn one process skips the
    micro-batch; under torchrun every rank runs the same forwards and backwards (their collectives must
    match), so it runs one row with its loss weighted 0."""
    keep = trained_rows(mb, train)
    empty = int(mb.completion_mask.sum()) == 0  # all masked (mask_truncated_completions)
    learns = not (empty or not keep.any())
    if not learns:
        if not distributed:
            return MicroBatchWork(None, 0.0, 0, learns=False, skipped=not empty)
        keep, scale = torch.arange(len(keep)) == 0, 0.0
    else:
        scale = skipped_rows_scale(mb, keep, train.loss_type)
    rows = mb if keep.all() else mb.select(keep)
    return MicroBatchWork(rows, scale, int(rows.completion_mask.sum()), learns=learns)


def step_completion_tokens(micro_batches: list[Batch]) -> int:
    """Completion tokens of one optimizer step's micro-batches on this rank (summed over ranks, dapo's
    num_items_in_batch and the metrics' token weight)."""
    return sum(int(r.completion_mask.sum()) for r in micro_batches)


def loss_denominator(loss_type: str, num_items: int) -> Optional[int]:
    """The fused head's num_items_in_batch: the global token count for dapo, cispo and vespo; None (a
    per-micro-batch normaliser) for the others."""
    return num_items if loss_type in GLOBAL_TOKEN_COUNT else None


def loss_factor(scale: float, train: TrainConfig, world_size: int) -> float:
    """What the fused head's loss is multiplied by: `step_loss_factor` of train's loss_type and
    gradient_accumulation_steps."""
    return step_loss_factor(scale, train.loss_type, train.gradient_accumulation_steps, world_size)


def step_loss_factor(scale: float, loss_type: str, gradient_accumulation_steps: int, world_size: int) -> float:
    """What the fused head's loss is multiplied by. dapo, cispo, vespo: each rank's sum over its tokens /
    the global count; data parallelism averages the ranks' gradients, so multiply by the number of ranks to get the
    sum (as TRL). Otherwise a per-micro-batch mean, averaged over the accumulation (and over ranks by
    the averaging)."""
    if loss_type in GLOBAL_TOKEN_COUNT:
        return scale * world_size
    return scale / gradient_accumulation_steps


def computed_tokens(mb: Batch, pack: Packing, decoder) -> int:
    """Decoder positions a loss micro-batch actually computes (padding excluded): each row's prompt and
    completion tokens, or, when the micro-batch runs packed (policy/packing.py), each prompt once."""
    prompt = mb.prompt_mask.sum(1)
    if should_pack(pack, mb, decoder):
        groups = prompt_groups(mb.prompt_ids, mb.prompt_mask)
        first = torch.ones_like(groups, dtype=torch.bool)
        first[1:] = groups[1:] != groups[:-1]
        prompt = prompt[first]
    return int(prompt.sum()) + int(mb.completion_mask.sum())
