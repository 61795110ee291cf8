"""A generation batch: prompts -> G completions each -> rewards -> advantages -> the log-probs the
loss needs before the policy moves (old, when the batch gets more than one optimizer step; reference,
when beta > 0). Each step is a short function with a typed result (`Rollout`, `Rewards`, then the
`Batch` with its advantages and log-probs), chained by `make_generation_batch`. The trainer takes
`steps_per_generation x num_iterations` optimizer steps on one batch; `GenerationBatch` records how
many are done and is saved with checkpoints, so a run that stops inside a batch resumes on the same
completions.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

from ..config import BatchPlan, Config, importance_sampling_correction, rollout_sampler
from ..phases import phase
from ..policy.batch import Batch
from ..policy.logprobs import completion_logprobs
from ..policy.rollout import Decoded, decode_completions, generate
from ..rewards import RewardError, RewardLogs, compute_rewards, nan_std, reward_metrics, scorable_totals
from ..rewards.model import uses_reward_model
from .context import RolloutContext
from .loss import importance_sampling_metrics, importance_sampling_ratio
from .micro_batch import trained_rows
from .stopping import stoppable_wait


@dataclass
class GenerationBatch:
    """A generation batch in use: its completions and how many of its optimizer steps are done."""

    batch: Batch
    steps_done: int
    info: dict  # reward / length metrics, logged with every step taken on this batch
    generation_time: float
    samples: list = field(default_factory=list)  # completions to log, with rewards

    def next_micro_batches(self, plan: BatchPlan, batch_size: int, accumulation: int) -> list[Batch]:
        """The micro-batches of the next optimizer step (visited in generation order on every pass)."""
        groups_per_pass = plan.micro_batches_per_generation // accumulation
        first = (self.steps_done % groups_per_pass) * accumulation
        return [self.batch.rows(i * batch_size, (i + 1) * batch_size) for i in range(first, first + accumulation)]

    def state_dict(self) -> dict:
        return {"batch": self.batch.state_dict(), "steps_done": self.steps_done, "info": self.info,
                "generation_time": self.generation_time, "samples": self.samples}

    @classmethod
    def from_state(cls, state: dict) -> "GenerationBatch":
        return cls(Batch(**state["batch"]), state["steps_done"], state["info"], state["generation_time"],
                   state["samples"])


def compute_advantages(rewards: torch.Tensor, group_size: int, scale: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages (N,), per-group std (N/G,)). A = (r - group mean) / (std + 1e-4), TRL's formula.

    NaN rewards (completions no reward function scored: rewards.scorable_totals) are left out of the
    group's mean and std (nan-mean, nan-std, as TRL >= 1.6) and get advantage exactly 0. A group's std
    is NaN when fewer than 2 of its rewards are scored (TRL's nanstd).

    A group whose scored rewards are all equal (or that has fewer than 2) gets advantages of exactly 0.
    The formula gives that too, except for rounding: the float mean of equal values can miss them by
    an ulp, which the division by (std + 1e-4) would turn into advantages of ~1e-3 that are pure
    noise. Exact zeros are what lets the trainer skip those completions (train.skip_zero_advantage)
    without changing the update.
    """
    grouped = rewards.view(-1, group_size)  # (prompts, G)
    scored = ~torch.isnan(grouped)
    std_group = nan_std(grouped, dim=1)  # unbiased, as TRL
    adv = grouped - grouped.nanmean(1, keepdim=True)  # (prompts, G)
    if scale == "group":
        adv = adv / (std_group.repeat_interleave(group_size).view_as(adv) + 1e-4)
    elif scale == "batch":
        adv = adv / (nan_std(rewards) + 1e-4)
    lowest = grouped.masked_fill(~scored, math.inf).amin(1, keepdim=True)
    highest = grouped.masked_fill(~scored, -math.inf).amax(1, keepdim=True)
    equal = (lowest == highest) | (scored.sum(1, keepdim=True) < 2)
    # masked_fill last: it also replaces the NaNs of unscored rows and of groups whose std is NaN
    return adv.masked_fill(equal | ~scored, 0.0).view(-1), std_group


def make_trainer_state(cfg: Config, plan: BatchPlan, *, global_step: int, epoch: float, num_input_tokens_seen: int):
    """transformers' TrainerState, filled as TRL's GRPOTrainer fills it, for the reward functions'
    `trainer_state` argument: TRL reward functions read `global_step` (optimizer steps done),
    `epoch` (fractional: epochs of prompts drawn before this batch), `max_steps`, ..."""
    from transformers import TrainerState

    return TrainerState(epoch=float(epoch), global_step=int(global_step), max_steps=cfg.train.max_steps,
                        logging_steps=cfg.output.logging_steps, save_steps=cfg.output.save_steps,
                        train_batch_size=cfg.train.per_device_train_batch_size,
                        num_input_tokens_seen=int(num_input_tokens_seen))


class Rollout(NamedTuple):
    """This rank's sampled completions, before any scoring."""

    batch: Batch  # prompts and completions (and the vLLM sampler's log-probs), no advantages yet
    prompts: list  # (N,) each row's prompt, G rows per prompt
    decoded: Decoded  # the completions without padding and EOS, as ids and as text
    lengths: Tensor  # (N,) fp32 completion lengths counting EOS (TRL's), before truncated rows are masked


class Rewards(NamedTuple):
    """The reward functions' scores of the whole generation batch: every rank's rows, in rank order."""

    per_func: Tensor  # (N_all, F) each function's reward, NaN where it did not score
    total: Tensor  # (N_all,) the weighted sum
    scored: Tensor  # (N_all,) `total`, NaN where no function scored the row (rewards.scorable_totals)
    advantages: Tensor  # (N_all,) fp32 (compute_advantages)
    group_std: Tensor  # (N_all / G,) each group's reward std
    lengths: Tensor  # (N_all,) Rollout.lengths
    truncated: Tensor  # (N_all,) bool: hit max_completion_length without EOS


def roll_out(cfg: Config, prompts, ctx: RolloutContext, trainer_state: Optional[Any]) -> Rollout:
    """G completions of each prompt, by vLLM or the native rollout; counts the tokens in `trainer_state`."""
    group = cfg.generation.num_generations
    with phase("rollout"):
        repeated = [ids for ids in prompts.prompt_ids for _ in range(group)]
        if ctx.engine is not None:  # vLLM: its sampled tokens' log-probs come with them
            batch, sampling_logp = ctx.engine.generate(repeated, eos_ids=ctx.eos_ids, pad_id=ctx.pad_id)
            batch = replace(batch, sampling_logp=sampling_logp)
        elif ctx.compact is not None:  # the compact copy samples; its log-probs of what it sampled go along
            batch = generate(ctx.compact.model, repeated, cfg.generation, eos_ids=ctx.eos_ids, pad_id=ctx.pad_id,
                             device=ctx.device, autocast_bf16=ctx.autocast)
            micro = cfg.train.logprob_rows
            sampling_logp = completion_logprobs(ctx.compact.head, batch, temperature=cfg.generation.temperature,
                                                micro_batch=micro, device=ctx.device, autocast_bf16=ctx.autocast)
            batch = replace(batch, sampling_logp=sampling_logp)
            if ctx.streamer is not None:  # model.offload_weights: made again from the host copy for the next one
                ctx.compact.release()
        else:
            batch = generate(ctx.policy, repeated, cfg.generation, eos_ids=ctx.eos_ids, pad_id=ctx.pad_id,
                             device=ctx.device, autocast_bf16=ctx.autocast)
        # TRL's lengths count the EOS token; taken before mask_truncated_completions edits the mask
        lengths = batch.completion_mask.sum(1).float()
        tokens = int(ctx.world.sum([int(batch.prompt_mask.sum()) + int(lengths.sum())])[0])
        if trainer_state is not None:
            trainer_state.num_input_tokens_seen += tokens
        prompt_list = [p for p in prompts.prompts for _ in range(group)]
        decoded = decode_completions(batch, prompt_list, ctx.eos_ids, ctx.tokenizer)
    return Rollout(batch, prompt_list, decoded, lengths)


def score(cfg: Config, prompts, rollout: Rollout, ctx: RolloutContext, trainer_state: Optional[Any],
          logs: RewardLogs) -> Rewards:
    """The reward functions on this rank's completions, gathered from every rank, and the advantages."""
    group = cfg.generation.num_generations
    columns = {k: [v for v in vals for _ in range(group)] for k, vals in prompts.columns.items()}
    with (phase("rewards") if uses_reward_model(ctx.reward_funcs) else contextlib.nullcontext(),
          stoppable_wait("the reward functions")):
        per_func, total = compute_rewards(ctx.reward_funcs, rollout.prompts, rollout.decoded.completions,
                                          rollout.decoded.ids, columns, trainer_state=trainer_state, logs=logs)
    with phase("rollout"):
        world = ctx.world  # every rank's rewards (identity with one process), in rank order
        per_func, total = world.gather_rows(per_func), world.gather_rows(total)
        scored = scorable_totals(per_func, total)  # NaN: no function scored it
        advantages, group_std = compute_advantages(scored, group, cfg.train.scale_rewards)
        return Rewards(per_func, total, scored, advantages, group_std, world.gather_rows(rollout.lengths),
                       world.gather_rows(rollout.batch.is_truncated))


def with_advantages(cfg: Config, batch: Batch, rewards: Rewards, ctx: RolloutContext) -> Batch:
    """`batch` with this rank's advantages, and its truncated completions masked out where
    train.mask_truncated_completions asks."""
    with phase("rollout"):
        mask = batch.completion_mask
        if cfg.train.mask_truncated_completions:
            mask = mask & ~batch.is_truncated[:, None]
        return replace(batch, advantages=ctx.world.rows_of_rank(rewards.advantages), completion_mask=mask)


def old_logprobs(cfg: Config, batch: Batch, keep: Tensor, ctx: RolloutContext) -> Tensor:
    """(N, C) fp32 log-probs of the completions under the policy as it is now, in eval mode; 0 on the rows
    outside `keep` (completions the loss skips: zero advantage, beta == 0)."""
    was_training = ctx.policy.training
    ctx.policy.eval()
    with phase("old log-probs"):
        found = torch.zeros(batch.completion_ids.shape, dtype=torch.float32)
        if keep.any():
            micro = cfg.train.logprob_rows
            kept = completion_logprobs(ctx.head, batch.select(keep), temperature=cfg.generation.temperature,
                                       micro_batch=micro, device=ctx.device, autocast_bf16=ctx.autocast,
                                       pack=ctx.pack, streamer=ctx.streamer,
                                       stream_rows=cfg.train.reference_stream_rows)  # (kept, <= C)
            found[keep, :kept.shape[1]] = kept
    ctx.policy.train(was_training)
    return found


def importance_weights(cfg: Config, batch: Batch, keep: Tensor) -> tuple[Tensor, dict[str, float]]:
    """(the correction's (N, C) token weights, 1 on the rows outside `keep`; its metrics over `keep`): the
    trained policy's probabilities (batch.old_logp) over the sampler's (batch.sampling_logp)."""
    train = cfg.train
    weight = importance_sampling_ratio(batch.old_logp, batch.sampling_logp, batch.completion_mask,
                                       train.vllm_importance_sampling_mode, train.vllm_importance_sampling_clip_min,
                                       train.vllm_importance_sampling_clip_max)
    # over the rows the loss trains (the ones it skips have no old log-probs)
    metrics = {k: v.item() for k, v in importance_sampling_metrics(weight[keep], batch.completion_mask[keep]).items()}
    return weight.expand_as(batch.old_logp).masked_fill(~keep[:, None], 1.0).contiguous(), metrics


def with_logprobs(cfg: Config, plan: BatchPlan, batch: Batch, ctx: RolloutContext) -> tuple[Batch, dict]:
    """`batch` with the log-probs the loss needs before the policy moves: old (when the batch gets more than
    one optimizer step, or the sampler's probabilities are corrected), the correction's weights, and the
    reference's (beta > 0); and the correction's metrics."""
    correct = batch.sampling_logp is not None and importance_sampling_correction(cfg.train,
                                                                                 rollout_sampler(cfg.generation))
    metrics = {}
    if plan.needs_old_logprobs or correct:
        keep = trained_rows(batch, cfg.train)
        batch = replace(batch, old_logp=old_logprobs(cfg, batch, keep, ctx))
        if correct:
            weight, metrics = importance_weights(cfg, batch, keep)
            batch = replace(batch, is_weight=weight)
    reference = ctx.reference
    if reference is not None:
        micro = cfg.train.logprob_rows
        with phase("reference log-probs"):
            autocast = ctx.autocast and reference.device.type != "cpu"
            ref_logp = reference.logprobs(batch, temperature=cfg.generation.temperature, micro_batch=micro,
                                          pack=ctx.pack, autocast_bf16=autocast,
                                          stream_rows=cfg.train.reference_stream_rows)
        batch = replace(batch, ref_logp=ref_logp)
    return batch, metrics


def batch_metrics(cfg: Config, batch: Batch, rewards: Rewards, ctx: RolloutContext, epoch: int) -> dict:
    """Reward, completion-length and zero-advantage metrics of the whole generation batch (TRL's names)."""
    lengths, truncated = rewards.lengths, rewards.truncated
    terminated = lengths[~truncated]
    if not len(terminated):  # TRL's convention when every completion was cut off
        terminated = torch.zeros(1)
    skipped = ctx.world.sum([len(batch) - int(trained_rows(batch, cfg.train).sum())])[0]
    return {
        **reward_metrics(ctx.reward_funcs, rewards.per_func, rewards.total),  # reward, reward_std, rewards/<name>/..
        "frac_reward_zero_std": (rewards.group_std < 1e-6).float().mean().item(),
        "completions/mean_length": lengths.mean().item(),
        "completions/min_length": lengths.min().item(),
        "completions/max_length": lengths.max().item(),
        "completions/clipped_ratio": truncated.float().mean().item(),
        "completions/mean_terminated_length": terminated.mean().item(),
        "completions/min_terminated_length": terminated.min().item(),
        "completions/max_terminated_length": terminated.max().item(),
        "frac_zero_advantage_skipped": skipped / len(rewards.advantages),
        "epoch": epoch,
    }


def with_logged_metrics(info: dict, logs: RewardLogs, ctx: RolloutContext) -> dict:
    """`info` and what the reward functions logged with log_metric (every rank's, one mean per name)."""
    logged = _merged(ctx.world.gather_objects(logs.metrics))
    clash = sorted(set(logged) & set(info))
    if clash:
        raise RewardError(f"a reward function logged the metric(s) {clash} with log_metric; those names are the "
                          f"trainer's own: choose other names")
    return {**info, **logged}


def completion_samples(cfg: Config, rollout: Rollout, batch: Batch, rewards: Rewards, logs: RewardLogs,
                       ctx: RolloutContext) -> list[dict]:
    """The first output.num_completions_to_log completions of the whole batch, with their rewards (rank 0 logs)."""
    world, texts = ctx.world, rollout.decoded.texts
    first = world.rank * len(batch)  # this rank's rows in the gathered tensors
    samples = [{"prompt": rollout.prompts[i], "completion": texts[i], "reward": rewards.scored[first + i].item(),
                "advantage": batch.advantages[i].item(),
                "rewards": {f.name: rewards.per_func[first + i, j].item() for j, f in enumerate(ctx.reward_funcs)},
                **({"extra": {k: v[i] for k, v in logs.extra.items()}} if logs.extra else {})}
               for i in range(min(cfg.output.num_completions_to_log, len(texts)))]
    if world.distributed:
        samples = [s for part in world.gather_objects(samples) for s in part][:cfg.output.num_completions_to_log]
    return samples


def make_generation_batch(cfg: Config, plan: BatchPlan, prompts, ctx: RolloutContext, *, epoch: int,
                          trainer_state: Optional[Any] = None) -> GenerationBatch:
    """Generate, score and prepare one generation batch for `prompts` (a PromptSet selection) with the
    policy, head, reference and reward functions of `ctx`: roll_out -> score -> with_advantages ->
    with_logprobs. `trainer_state` (make_trainer_state) reaches the reward functions; its
    num_input_tokens_seen grows by this batch's prompt + completion tokens (TRL's `num_tokens`), over every rank.

    Under torchrun (`ctx.world`), `prompts` are this rank's; rewards, lengths and logged completions are
    gathered from every rank, so advantages (scale_rewards=batch: the global std) and metrics are
    those of the whole generation batch, and this rank keeps its own rows."""
    start, logs = time.perf_counter(), RewardLogs()
    rollout = roll_out(cfg, prompts, ctx, trainer_state)
    rewards = score(cfg, prompts, rollout, ctx, trainer_state, logs)
    batch = with_advantages(cfg, rollout.batch, rewards, ctx)
    batch, correction_metrics = with_logprobs(cfg, plan, batch, ctx)
    # the correction's: sampling/importance_sampling_ratio/min, /mean, /max (TRL's names), with engine=vllm
    info = with_logged_metrics({**batch_metrics(cfg, batch, rewards, ctx, epoch), **correction_metrics}, logs, ctx)
    if trainer_state is not None:
        info["num_tokens"] = trainer_state.num_input_tokens_seen
    samples = completion_samples(cfg, rollout, batch, rewards, logs, ctx)
    return GenerationBatch(batch, 0, info, time.perf_counter() - start, samples)


def _merged(logged: list[dict[str, list[float]]]) -> dict[str, float]:
    """log_metric values from every rank -> one mean per name (over all values, not a mean of means)."""
    values: dict[str, list[float]] = {}
    for part in logged:
        for name, vs in part.items():
            values.setdefault(name, []).extend(vs)
    return {k: sum(v) / len(v) for k, v in values.items() if v}
