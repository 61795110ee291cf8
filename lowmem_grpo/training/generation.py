"""A generation batch: prompts -> G completions each -> rewards -> advantages -> the log-probs the
loss needs before the policy moves (old, when the batch gets more than one optimizer step; reference,
when beta > 0). The trainer takes `steps_per_generation x num_iterations` optimizer steps on one
batch; `GenerationBatch` records how many are done and is saved with checkpoints, so a run that
stops inside a batch resumes on the same completions.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Union

import torch

from ..config import BatchPlan, Config, TrainConfig
from ..phases import phase
from ..policy.rollout import Batch, decode_completions, generate, token_logprobs
from ..rewards import compute_rewards, reward_metrics


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

    A group whose G rewards are all equal gets advantages of exactly 0. The formula gives that too,
    except for rounding: the float mean of equal values can miss them by an ulp, which the division by
    (std + 1e-4) would turn into advantages of ~1e-3 that are pure noise. Exact zeros are what lets the
    trainer skip those completions (train.skip_zero_advantage) without changing the update.
    """
    grouped = rewards.view(-1, group_size)  # (prompts, G)
    std_group = grouped.std(1)  # unbiased, as TRL
    adv = grouped - grouped.mean(1, keepdim=True)  # (prompts, G)
    adv = adv.masked_fill((grouped == grouped[:, :1]).all(1, keepdim=True), 0.0).view(-1)
    if scale == "group":
        adv = adv / (std_group.repeat_interleave(group_size) + 1e-4)
    elif scale == "batch":
        adv = adv / (rewards.std() + 1e-4)
    return adv, std_group


def trained_rows(batch: Batch, train: TrainConfig) -> torch.Tensor:
    """(N,) bool: the completions whose gradient is not known in advance to be exactly zero.

    With beta == 0 the per-token loss is -min(rho * A, clip(rho) * A): a completion with A == 0 has
    loss 0 and gradient 0 for any rho, so train.skip_zero_advantage leaves it out of the forward and
    backward (and of the old log-prob pass). With beta > 0 its KL term still has a gradient."""
    if not train.skip_zero_advantage or train.beta != 0 or batch.advantages is None:
        return torch.ones(len(batch), dtype=torch.bool)
    return batch.advantages != 0


def skipped_rows_scale(mb: Batch, keep: torch.Tensor, loss_type: str) -> float:
    """Factor that gives the loss of the kept rows of micro-batch `mb` the denominator of the whole
    micro-batch. grpo and dr_grpo divide by the number of sequences, bnpo by the masked tokens; dapo's
    denominator (num_items_in_batch) is counted over every row already."""
    if keep.all() or loss_type == "dapo":
        return 1.0
    if loss_type == "bnpo":
        return int(mb.completion_mask[keep].sum()) / int(mb.completion_mask.sum())
    return int(keep.sum()) / len(keep)


def make_generation_batch(cfg: Config, plan: BatchPlan, prompts, *, policy, head, reference, tokenizer,
                          reward_funcs, eos_ids: list[int], pad_id: int, device: torch.device, autocast: bool,
                          epoch: int, pack: Union[bool, str] = False) -> GenerationBatch:
    """Generate, score and prepare one generation batch for `prompts` (a PromptSet selection). `pack`:
    shared-prompt packing in the log-prob passes (policy/packing.py)."""
    G, t0 = cfg.generation.num_generations, time.perf_counter()
    with phase("rollout"):
        batch = generate(policy, [ids for ids in prompts.prompt_ids for _ in range(G)], cfg.generation,
                         eos_ids=eos_ids, pad_id=pad_id, device=device, autocast_bf16=autocast)
        prompt_list = [p for p in prompts.prompts for _ in range(G)]
        decoded = decode_completions(batch, prompt_list, eos_ids, tokenizer)
        columns = {k: [v for v in vals for _ in range(G)] for k, vals in prompts.columns.items()}
        per_func, total = compute_rewards(reward_funcs, prompt_list, decoded.completions, decoded.ids, columns)
        batch.advantages, std_group = compute_advantages(total, G, cfg.train.scale_rewards)
        if cfg.train.mask_truncated_completions:
            batch.completion_mask &= ~batch.is_truncated[:, None]
    micro = cfg.train.logprob_micro_batch_size or cfg.train.per_device_train_batch_size
    temperature = cfg.generation.temperature
    if plan.needs_old_logprobs:
        was_training = policy.training
        policy.eval()
        with phase("old log-probs"):
            # Completions the loss will skip (zero advantage, beta == 0) need no old log-probs: left at 0.
            keep = trained_rows(batch, cfg.train)
            batch.old_logp = torch.zeros(batch.completion_ids.shape, dtype=torch.float32)
            if keep.any():
                old = token_logprobs(head, batch.select(keep), temperature=temperature, micro_batch=micro,
                                     device=device, autocast_bf16=autocast, pack=pack)  # (kept, <= C)
                batch.old_logp[keep, :old.shape[1]] = old
        policy.train(was_training)
    if reference is not None:
        with phase("reference log-probs"):
            batch.ref_logp = reference.logprobs(batch, temperature=temperature, micro_batch=micro, pack=pack,
                                                autocast_bf16=autocast and reference.device.type != "cpu")
    lengths = decoded.keep.sum(1).float()
    info = {
        "reward": total.mean().item(),
        "reward_std": std_group.mean().item(),
        "frac_reward_zero_std": (std_group < 1e-6).float().mean().item(),
        **reward_metrics(reward_funcs, per_func, total),
        "completions/mean_length": lengths.mean().item(),
        "completions/min_length": lengths.min().item(),
        "completions/max_length": lengths.max().item(),
        "completions/clipped_ratio": batch.is_truncated.float().mean().item(),
        "frac_zero_advantage_skipped": 1.0 - trained_rows(batch, cfg.train).float().mean().item(),
        "epoch": epoch,
    }
    n_log = min(cfg.output.num_completions_to_log, len(decoded.texts))
    samples = [{"prompt": prompt_list[i], "completion": decoded.texts[i], "reward": total[i].item(),
                "advantage": batch.advantages[i].item(),
                "rewards": {f.name: per_func[i, j].item() for j, f in enumerate(reward_funcs)}}
               for i in range(n_log)]
    return GenerationBatch(batch, 0, info, time.perf_counter() - t0, samples)
