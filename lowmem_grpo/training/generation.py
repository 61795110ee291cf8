"""A generation batch: prompts -> G completions each -> rewards -> advantages -> the log-probs the
loss needs before the policy moves (old, when the batch gets more than one optimizer step; reference,
when beta > 0). The trainer takes `steps_per_generation x num_iterations` optimizer steps on one
batch; `GenerationBatch` records how many are done and is saved with checkpoints, so a run that
stops inside a batch resumes on the same completions.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..config import BatchPlan, Config, importance_sampling_correction, rollout_engine
from ..phases import phase
from ..policy.batch import Batch
from ..policy.logprobs import completion_logprobs
from ..policy.rollout import decode_completions, generate
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


def make_generation_batch(cfg: Config, plan: BatchPlan, prompts, ctx: RolloutContext, *, epoch: int,
                          trainer_state: Optional[Any] = None) -> GenerationBatch:
    """Generate, score and prepare one generation batch for `prompts` (a PromptSet selection) with the
    policy, head, reference and reward functions of `ctx`. `trainer_state` (make_trainer_state) reaches
    the reward functions; its num_input_tokens_seen grows by this batch's prompt + completion tokens
    (TRL's `num_tokens`), over every rank.

    Under torchrun (`ctx.world`), `prompts` are this rank's; rewards, lengths and logged completions are
    gathered from every rank, so advantages (scale_rewards=batch: the global std) and metrics are
    those of the whole generation batch, and this rank keeps its own rows."""
    policy, head, reference, reward_funcs = ctx.policy, ctx.head, ctx.reference, ctx.reward_funcs
    eos_ids, device, autocast, pack, world = ctx.eos_ids, ctx.device, ctx.autocast, ctx.pack, ctx.world
    G, t0 = cfg.generation.num_generations, time.perf_counter()
    logs = RewardLogs()
    with phase("rollout"):
        repeated = [ids for ids in prompts.prompt_ids for _ in range(G)]
        if ctx.engine is not None:  # vLLM: its sampled tokens' log-probs come with them
            batch, batch.sampling_logp = ctx.engine.generate(repeated, eos_ids=eos_ids, pad_id=ctx.pad_id)
        else:
            batch = generate(policy, repeated, cfg.generation, eos_ids=eos_ids, pad_id=ctx.pad_id, device=device,
                             autocast_bf16=autocast)
        # TRL's lengths count the EOS token; taken before mask_truncated_completions edits the mask
        lengths = batch.completion_mask.sum(1).float()
        tokens = int(world.sum([int(batch.prompt_mask.sum()) + int(lengths.sum())])[0])
        if trainer_state is not None:
            trainer_state.num_input_tokens_seen += tokens
        prompt_list = [p for p in prompts.prompts for _ in range(G)]
        decoded = decode_completions(batch, prompt_list, eos_ids, ctx.tokenizer)
    columns = {k: [v for v in vals for _ in range(G)] for k, vals in prompts.columns.items()}
    with (phase("rewards") if uses_reward_model(reward_funcs) else contextlib.nullcontext(),
          stoppable_wait("the reward functions")):
        per_func, total = compute_rewards(reward_funcs, prompt_list, decoded.completions, decoded.ids, columns,
                                          trainer_state=trainer_state, logs=logs)
    with phase("rollout"):
        # Every rank's rewards (identity with one process): the whole generation batch, in rank order
        per_func, total = world.gather_rows(per_func), world.gather_rows(total)
        scored = scorable_totals(per_func, total)  # NaN: no function scored it
        advantages, std_group = compute_advantages(scored, G, cfg.train.scale_rewards)
        batch.advantages = world.rows_of_rank(advantages)
        lengths, truncated = world.gather_rows(lengths), world.gather_rows(batch.is_truncated)
        if cfg.train.mask_truncated_completions:
            batch.completion_mask &= ~batch.is_truncated[:, None]
    micro = cfg.train.logprob_micro_batch_size or cfg.train.per_device_train_batch_size
    temperature = cfg.generation.temperature
    engine = rollout_engine(cfg.generation)
    correct = batch.sampling_logp is not None and importance_sampling_correction(cfg.train, engine)
    if plan.needs_old_logprobs or correct:  # (the correction's ratio is the trained policy's over the sampler's)
        was_training = policy.training
        policy.eval()
        with phase("old log-probs"):
            # Completions the loss will skip (zero advantage, beta == 0) need no old log-probs: left at 0.
            keep = trained_rows(batch, cfg.train)
            batch.old_logp = torch.zeros(batch.completion_ids.shape, dtype=torch.float32)
            if keep.any():
                old = completion_logprobs(head, batch.select(keep), temperature=temperature, micro_batch=micro,
                                          device=device, autocast_bf16=autocast, pack=pack)  # (kept, <= C)
                batch.old_logp[keep, :old.shape[1]] = old
        policy.train(was_training)
    is_metrics = {}
    if correct:
        t = cfg.train
        weight = importance_sampling_ratio(batch.old_logp, batch.sampling_logp, batch.completion_mask,
                                           t.vllm_importance_sampling_mode, t.vllm_importance_sampling_clip_min,
                                           t.vllm_importance_sampling_clip_max)
        # over the rows the loss trains (the ones it skips have no old log-probs)
        is_metrics = {k: v.item() for k, v in importance_sampling_metrics(weight[keep],
                                                                         batch.completion_mask[keep]).items()}
        batch.is_weight = weight.expand_as(batch.old_logp).masked_fill(~keep[:, None], 1.0).contiguous()  # (N, C)
    if reference is not None:
        with phase("reference log-probs"):
            batch.ref_logp = reference.logprobs(batch, temperature=temperature, micro_batch=micro, pack=pack,
                                                autocast_bf16=autocast and reference.device.type != "cpu")
    terminated = lengths[~truncated]
    if not len(terminated):  # TRL's convention when every completion was cut off
        terminated = torch.zeros(1)
    info = {
        **reward_metrics(reward_funcs, per_func, total),  # reward, reward_std, rewards/<name>/mean and /std
        "frac_reward_zero_std": (std_group < 1e-6).float().mean().item(),
        "completions/mean_length": lengths.mean().item(),
        "completions/min_length": lengths.min().item(),
        "completions/max_length": lengths.max().item(),
        "completions/clipped_ratio": truncated.float().mean().item(),
        "completions/mean_terminated_length": terminated.mean().item(),
        "completions/min_terminated_length": terminated.min().item(),
        "completions/max_terminated_length": terminated.max().item(),
        "frac_zero_advantage_skipped": world.sum([len(batch) - int(trained_rows(batch, cfg.train).sum())])[0]
                                       / len(advantages),
        "epoch": epoch,
        **is_metrics,  # sampling/importance_sampling_ratio/min, /mean, /max (TRL's names), with engine=vllm
    }
    logged = _merged(world.gather_objects(logs.metrics))  # what reward functions logged with log_metric
    clash = sorted(set(logged) & set(info))
    if clash:
        raise RewardError(f"a reward function logged the metric(s) {clash} with log_metric; those names are the "
                          f"trainer's own: choose other names")
    info.update(logged)
    if trainer_state is not None:
        info["num_tokens"] = trainer_state.num_input_tokens_seen
    n_log = min(cfg.output.num_completions_to_log, len(decoded.texts))
    first = world.rank * len(batch)  # this rank's rows in the gathered tensors
    samples = [{"prompt": prompt_list[i], "completion": decoded.texts[i], "reward": scored[first + i].item(),
                "advantage": batch.advantages[i].item(),
                "rewards": {f.name: per_func[first + i, j].item() for j, f in enumerate(reward_funcs)},
                **({"extra": {k: v[i] for k, v in logs.extra.items()}} if logs.extra else {})}
               for i in range(n_log)]
    if world.distributed:  # rank 0 logs the first num_completions_to_log of the whole batch
        samples = [s for part in world.gather_objects(samples) for s in part][:cfg.output.num_completions_to_log]
    return GenerationBatch(batch, 0, info, time.perf_counter() - t0, samples)


def _merged(logged: list[dict[str, list[float]]]) -> dict[str, float]:
    """log_metric values from every rank -> one mean per name (over all values, not a mean of means)."""
    values: dict[str, list[float]] = {}
    for part in logged:
        for name, vs in part.items():
            values.setdefault(name, []).extend(vs)
    return {k: sum(v) / len(v) for k, v in values.items() if v}
