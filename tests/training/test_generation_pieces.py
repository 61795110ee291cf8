"""make_generation_batch's typed pieces: with_advantages builds a new Batch from a Rollout's and the
Rewards' tensors (the rollout's batch is left as it was), and the Rewards carry every field by name."""

from types import SimpleNamespace

import torch

from lowmem_grpo.config import load_config
from lowmem_grpo.policy.batch import Batch
from lowmem_grpo.training.distributed import World
from lowmem_grpo.training.generation import Rewards, compute_advantages, with_advantages


def _batch() -> Batch:
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    return Batch(prompt_ids=torch.ones(4, 2, dtype=torch.long), prompt_mask=torch.ones(4, 2, dtype=torch.bool),
                 completion_ids=torch.arange(12).view(4, 3), completion_mask=mask,
                 is_truncated=torch.tensor([True, False, True, False]))


def _rewards(batch: Batch) -> Rewards:
    total = torch.tensor([1.0, 0.0, 0.5, 0.5])  # group 1: unequal; group 2: equal (advantages exactly 0)
    advantages, std = compute_advantages(total, 2, "group")
    return Rewards(total[:, None], total, total, advantages, std, batch.completion_mask.sum(1).float(),
                   batch.is_truncated)


def test_with_advantages_masks_truncated_completions_in_a_new_batch():
    batch, ctx = _batch(), SimpleNamespace(world=World())
    before = batch.completion_mask.clone()
    rewards = _rewards(batch)
    cfg = load_config(None, ["mask_truncated_completions=true"], check=False)
    out = with_advantages(cfg, batch, rewards, ctx)
    assert out is not batch and batch.advantages is None and torch.equal(batch.completion_mask, before)
    assert torch.equal(out.advantages, rewards.advantages) and out.advantages[2:].eq(0).all()
    assert out.completion_mask.tolist() == [[False] * 3, [True, True, False], [False] * 3, [True, False, False]]
    assert out.completion_ids is batch.completion_ids  # the other tensors are the rollout's own
    kept = with_advantages(load_config(None, ["mask_truncated_completions=false"], check=False), batch, rewards, ctx)
    assert torch.equal(kept.completion_mask, before)


def test_rewards_name_their_fields():
    assert Rewards._fields == ("per_func", "total", "scored", "advantages", "group_std", "lengths", "truncated")
