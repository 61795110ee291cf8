"""micro_batch.py's arithmetic for every loss type: the loss of the kept rows (zero-advantage rows skipped),
times loss_factor, summed over the accumulated micro-batches, equals TRL's step loss written out from
GRPOTrainer._compute_loss's normalisers (per-token losses of the skipped rows are 0, as with A == 0)."""

import pytest
import torch

from lowmem_grpo.config import Config
from lowmem_grpo.kernels.linear_loss import reduce_loss, LossType
from lowmem_grpo.policy.batch import Batch
from lowmem_grpo.training.micro_batch import loss_denominator, loss_factor, plan_micro_batch

B, C, GA, MAXLEN = 4, 6, 2, 6


def _micro_batch(seed: int) -> tuple[Batch, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, C + 1, (B,), generator=g)
    mask = torch.arange(C)[None, :] < lengths[:, None]
    adv = torch.tensor([0.5, 0.0, -1.0, 0.0]) * (seed + 1)
    per_token = torch.randn(B, C, generator=g) * adv[:, None] * mask  # 0 on rows with A == 0
    mb = Batch(torch.ones(B, 1, dtype=torch.long), torch.ones(B, 1, dtype=torch.bool),
               torch.ones(B, C, dtype=torch.long), mask, torch.zeros(B, dtype=torch.bool), adv)
    return mb, per_token


def _trl_step_loss(parts, loss_type: str) -> float:
    """Sum over the accumulation window of TRL's micro-batch losses (one process, steps_per_generation = GA)."""
    n_items = sum(float(mb.completion_mask.sum()) for mb, _ in parts)
    total = 0.0
    for mb, pt in parts:
        m = mb.completion_mask.float()
        if loss_type in ("grpo", "sapo"):
            loss = ((pt * m).sum(-1) / m.sum(-1).clamp(min=1)).mean() / GA
        elif loss_type == "bnpo":
            loss = (pt * m).sum() / m.sum().clamp(min=1) / GA
        elif loss_type == "dr_grpo":
            loss = (pt * m).sum() / (B * MAXLEN) / GA
        elif loss_type == "luspo":
            loss = (pt * m).sum(-1).mean() / GA
        else:  # dapo, cispo, vespo: num_items_in_batch of the generation batch, rescaled by GA / spg = 1
            loss = (pt * m).sum() / n_items
        total += float(loss)
    return total


@pytest.mark.parametrize("loss_type", [t.value for t in LossType])
def test_kept_rows_times_factor_give_trls_step_loss(loss_type):
    train = Config().train
    train.loss_type, train.gradient_accumulation_steps = loss_type, GA
    parts = [_micro_batch(0), _micro_batch(1)]
    num_items = sum(int(mb.completion_mask.sum()) for mb, _ in parts)
    ours = 0.0
    for mb, per_token in parts:
        work = plan_micro_batch(mb, train, distributed=False)
        assert len(work.rows) == 2  # the zero-advantage rows are skipped
        keep = mb.advantages != 0
        kept = per_token[keep][:, :work.rows.completion_mask.shape[1]]  # select() trims trailing padding
        loss = reduce_loss(kept, work.rows.completion_mask.float(), LossType(loss_type),
                           max_completion_length=MAXLEN, num_items_in_batch=loss_denominator(loss_type, num_items))
        ours += float(loss) * loss_factor(work.scale, train, world_size=1)
    assert ours == pytest.approx(_trl_step_loss(parts, loss_type), rel=1e-6)


def test_the_entropy_quantile_keeps_every_row():
    """Skipping rows would change the token set the entropy quantile is taken over."""
    train = Config().train
    mb, _ = _micro_batch(0)
    assert len(plan_micro_batch(mb, train, distributed=False).rows) == 2
    train.top_entropy_quantile = 0.2
    work = plan_micro_batch(mb, train, distributed=False)
    assert len(work.rows) == B and work.scale == 1.0


@pytest.mark.parametrize("overrides, present, absent", [
    (["loss_type=cispo"], ["cispo_clip_ratio"], ["clip_ratio/region_mean"]),
    (["loss_type=vespo", "top_entropy_quantile=0.5"], ["vespo/phi_seq_mean", "entropy/mask_ratio"],
     ["cispo_clip_ratio"]),
    (["loss_type=luspo", "importance_sampling_level=sequence", "delta=1.5"], ["clip_ratio/region_mean"],
     ["vespo/phi_seq_mean"]),
])
def test_a_run_logs_each_loss_types_metrics_under_trls_names(toy_config, overrides, present, absent):
    from lowmem_grpo.training.metrics import read_metrics
    from lowmem_grpo.training.trainer import Trainer
    cfg = toy_config(*overrides, "max_steps=1")
    Trainer(cfg).train()
    row = read_metrics(cfg.output.output_dir)[-1]
    assert all(k in row for k in present), sorted(row)
    assert not any(k in row for k in absent), sorted(row)
    if "entropy/mask_ratio" in row:
        assert 0 < row["entropy/mask_ratio"] < 1
