"""Every loss type and option of the trainer's loss (plan_micro_batch + PolicyLoss) against TRL 1.16's
GRPOTrainer._compute_loss on the same tiny fp32 Qwen2 and the same batch, over two steps: step 1 on-policy,
one identical plain SGD update of both models, step 2 with step 1's log-probs as the old log-probs (ratios
away from 1, clip regions reached). Losses and every parameter's gradient agree to 1e-5 relative."""

import copy
import importlib.util
from collections import defaultdict
from contextlib import nullcontext

import pytest
import torch

from lowmem_grpo.config import Config
from lowmem_grpo.policy.batch import Batch
from lowmem_grpo.policy.packing import Packing
from lowmem_grpo.training.loss import PolicyLoss
from lowmem_grpo.training.micro_batch import plan_micro_batch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="needs trl (pip install '.[bench]')")

B, P, C, V = 6, 5, 8, 48
LR = 2.0  # large: step 2's ratios leave [0.8, 1.2] on some tokens


class _Accelerator:
    """One process: what _compute_loss and its helpers call on TRL's accelerator."""

    num_processes = 1
    sync_gradients = True
    is_main_process = True

    def pad_across_processes(self, x, **kwargs):
        return x

    def gather(self, x):
        return x

    def reduce(self, x, reduction="sum"):
        return x

    def autocast(self):
        return nullcontext()


def _trl_self(settings: dict, model):
    """A GRPOTrainer without __init__, holding the attributes _compute_loss reads."""
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir="unused", report_to="none", bf16=False, use_cpu=True, steps_per_generation=1,
                      gradient_accumulation_steps=1, max_completion_length=C, **settings)
    t = GRPOTrainer.__new__(GRPOTrainer)
    t.__dict__.update(
        args=args, model=model, accelerator=_Accelerator(), loss_type=args.loss_type, beta=args.beta,
        epsilon_low=args.epsilon, epsilon_high=args.epsilon_high if args.epsilon_high is not None else args.epsilon,
        importance_sampling_level=args.importance_sampling_level, top_entropy_quantile=args.top_entropy_quantile,
        off_policy_mask_threshold=None, use_vllm=False, vllm_importance_sampling_correction=False,
        current_gradient_accumulation_steps=1, max_completion_length=C, aux_loss_enabled=False,
        _entropy_bonus_enabled=False, _metrics={"train": defaultdict(list), "eval": defaultdict(list)})
    return t


def _models():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    torch.manual_seed(0)
    ours = Qwen2ForCausalLM(Qwen2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                        pad_token_id=0, eos_token_id=1, attn_implementation="eager")).float()
    theirs = copy.deepcopy(ours)
    add_fused_lm_head(theirs, temperature=1.0, outputs=("log_probs", "entropy"))
    return ours.train(), theirs.train()


def _batch() -> Batch:
    g = torch.Generator().manual_seed(1)
    prompt_len = torch.tensor([5, 3, 4, 5, 2, 5])
    prompt_mask = torch.arange(P)[None, :] >= (P - prompt_len)[:, None]  # left-padded
    prompt_ids = torch.randint(2, V, (B, P), generator=g) * prompt_mask
    comp_len = torch.tensor([8, 5, 3, 8, 6, 1])
    completion_mask = torch.arange(C)[None, :] < comp_len[:, None]
    completion_ids = torch.randint(2, V, (B, C), generator=g) * completion_mask
    advantages = torch.tensor([1.3, -0.7, 0.0, -1.1, 0.6, 0.9])  # a zero row: skip_zero_advantage's path
    return Batch(prompt_ids, prompt_mask, completion_ids, completion_mask, torch.zeros(B, dtype=torch.bool),
                 advantages)


def _ours(model, mb: Batch, settings: dict):
    cfg = Config()
    cfg.generation.max_completion_length, cfg.generation.temperature = C, 1.0
    cfg.train.gradient_accumulation_steps = 1
    for k, v in settings.items():
        setattr(cfg.train, k, v)
    work = plan_micro_batch(mb, cfg.train, distributed=False)
    loss, metrics = PolicyLoss(model, cfg, autocast=False, pack=Packing.OFF)(
        work.rows, int(mb.completion_mask.sum()), work.scale, work.tokens)
    return loss, metrics


def _theirs(t, model, mb: Batch):
    inputs = {"prompt_ids": mb.prompt_ids, "prompt_mask": mb.prompt_mask.long(), "completion_ids": mb.completion_ids,
              "completion_mask": mb.completion_mask.long(), "advantages": mb.advantages,
              "num_items_in_batch": mb.completion_mask.sum().float()}
    if mb.old_logp is not None:
        inputs["old_per_token_logps"] = mb.old_logp
    if mb.ref_logp is not None:
        inputs["ref_per_token_logps"] = mb.ref_logp
    return t._compute_loss(model, inputs)


def _trl_logps(t, model, mb: Batch) -> torch.Tensor:
    with torch.no_grad():
        ids = torch.cat([mb.prompt_ids, mb.completion_ids], 1)
        attn = torch.cat([mb.prompt_mask, mb.completion_mask], 1).long()
        logp, _, _ = t._get_per_token_logps_and_entropies(model, ids, attn, C)
    return logp * mb.completion_mask


def _close(ours: torch.Tensor, theirs: torch.Tensor, what: str, rtol: float = 1e-5):
    err = (ours - theirs).norm() / theirs.norm().clamp(min=1e-12)
    assert err <= rtol, f"{what}: relative error {err:.2e} > {rtol:.0e} (|ours| {ours.norm():.3e}, " \
                        f"|TRL| {theirs.norm():.3e})"


CASES = [dict(loss_type=lt) for lt in ("grpo", "bnpo", "dapo", "dr_grpo", "cispo", "sapo", "luspo", "vespo")] + [
    dict(loss_type="luspo", importance_sampling_level="sequence"),
    dict(loss_type="grpo", importance_sampling_level="sequence"),
    dict(loss_type="dapo", delta=1.1),
    dict(loss_type="grpo", top_entropy_quantile=0.5),
    dict(loss_type="dapo", top_entropy_quantile=0.3),
    dict(loss_type="dapo", beta=0.05, use_bias_correction_kl=True),
    dict(loss_type="dapo", beta=0.05, use_bias_correction_kl=False),
    dict(loss_type="grpo", beta=0.05, use_bias_correction_kl=True),
    dict(loss_type="sapo", beta=0.05, use_bias_correction_kl=True),
]


@pytest.mark.parametrize("settings", CASES, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
def test_two_steps_match_trl(settings):
    ours, theirs = _models()
    t = _trl_self(settings, theirs)
    mb = _batch()
    if settings.get("beta", 0.0) > 0:
        noise = torch.randn(B, C, generator=torch.Generator().manual_seed(2)) * 0.3
        mb.ref_logp = (_trl_logps(t, theirs, mb) + noise) * mb.completion_mask
    clipped = 0.0
    for step in range(2):
        if step == 1:
            mb.old_logp = _trl_logps(t, theirs, mb)  # step 1's log-probs, before the update
            with torch.no_grad():
                for model in (ours, theirs):
                    for p in model.parameters():
                        p -= LR * p.grad
                    model.zero_grad(set_to_none=True)
        loss_ours, metrics = _ours(ours, mb, settings)
        loss_ours.backward()
        loss_theirs = _theirs(t, theirs, mb)
        loss_theirs.backward()
        _close(loss_ours.detach(), loss_theirs.detach(), f"step {step + 1} loss")
        grads = dict(theirs.named_parameters())
        for name, p in ours.named_parameters():
            _close(p.grad, grads[name].grad, f"step {step + 1} grad of {name}")
        if step == 1:
            clipped = sum(float(v) for k, v in metrics.items() if "clip_ratio" in k)
    if settings["loss_type"] in ("grpo", "dapo", "cispo") and "delta" not in settings:
        assert clipped > 0, "step 2 reached no clip region: the comparison does not cover it (raise LR)"


def _trl_is_ratio(old, sampling, mask, mode, clip_min, clip_max):
    """TRL 1.16's vLLM importance-sampling ratio (GRPOTrainer._generate_and_score_completions), written out."""
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    ratio = torch.exp(diff.sum(-1, keepdim=True) if mode.startswith("sequence") else diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    lo = -float("inf") if clip_min is None else clip_min
    hi = float("inf") if clip_max is None else clip_max
    return ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("bounds", [(None, 3.0), (0.5, 2.0), (0.9, None)])
def test_importance_sampling_ratio_is_trls(mode, bounds):
    from lowmem_grpo.training.loss import importance_sampling_metrics, importance_sampling_ratio
    g = torch.Generator().manual_seed(3)
    mask = torch.arange(C)[None, :] < torch.tensor([8, 5, 3, 8, 6, 1])[:, None]
    old = torch.randn(B, C, generator=g) - 2.0
    sampling = old + torch.randn(B, C, generator=g) * 0.6
    sampling[0, 2] = float("nan")  # unknown to the engine: ratio 1 there
    ours = importance_sampling_ratio(old, sampling, mask, mode, *bounds)
    torch.testing.assert_close(ours, _trl_is_ratio(old, sampling, mask.float(), mode, *bounds), rtol=0, atol=0)
    assert ours.shape == ((B, 1) if mode.startswith("sequence") else (B, C))
    m = importance_sampling_metrics(ours, mask)
    values = ours[:, 0] if mode.startswith("sequence") else ours[mask]
    assert float(m["sampling/importance_sampling_ratio/min"]) == float(values.min())
    assert float(m["sampling/importance_sampling_ratio/max"]) == float(values.max())
    with pytest.raises(ValueError, match="unknown importance-sampling mode 'token'"):
        importance_sampling_ratio(old, sampling, mask, "token", None, 3.0)
