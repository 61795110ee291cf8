"""A drop-in for Liger-Kernel users: `FusedLinearGRPOLoss` takes `LigerFusedLinearGRPOLoss`'s constructor and
`forward` arguments (liger-kernel 0.8.5, every one, by name, position and meaning) and returns what it returns,
computed by `linear_grpo_loss` and the shared per-token formula (grpo_loss.policy_terms), no (B, T, V) logits.

    loss_fn = FusedLinearGRPOLoss(beta=0.04, loss_type="dapo")   # was LigerFusedLinearGRPOLoss(...)
    loss, metrics = loss_fn(hidden (B, T, H), lm_head.weight (V, H), completion_ids (B, T), completion_mask (B, T),
                            advantages (B,), ref_per_token_logps=ref (B, T), old_per_token_logps=old (B, T))
    # metrics: (kl, clip_ratio) when beta != 0, else (clip_ratio,): 0-dim fp32 masked token means, as Liger's

Where Liger's module differs from TRL this follows Liger: use_ref_model=False means no KL term (kl metric 0)
whatever reference inputs are given; luspo sums over every position, padding included (those rows go through
the head, so their ids must be valid); dapo / cispo / vespo divide by Liger's normaliser (`dapo_normalizer`).
The loss is differentiable w.r.t. _input, lin_weight and bias (fp32 loss; gradients in the inputs' dtypes).
`compiled` and `chunk_size` are accepted and have no effect. Design notes: docs/kernels.md ("Liger-Kernel's interface")
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch
from torch import Tensor, nn

from ..ranges import BETA
from . import grpo_loss
from ._backend import debug_checks
from ._checks import _tracing, check_mask, check_shape
from .grpo_loss import _expand_advantages, per_token_weights
from .linear import linear_token_logprobs
from .linear_loss import linear_grpo_loss
from .loss_settings import GRPOLossSettings, ISLevel, LossType

SUPPORTED_LOSS_TYPES = tuple(t.value for t in LossType)
_NO_SEQUENCE_LEVEL = ("cispo", "sapo", "vespo")  # Liger refuses these with importance_sampling_level="sequence"
_DAPO_NORMALISED = ("dapo", "cispo", "vespo")


class FusedLinearGRPOLoss(nn.Module):
    """`liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss`'s interface on lowmem-grpo's fused head."""

    def __init__(self, beta: float = 0.04, compiled: bool = True, use_ref_model: bool = True, chunk_size: int = 1,
                 epsilon_low: float = 0.2, epsilon_high: float = 0.2, loss_type: str = "dapo",
                 max_completion_length: Optional[int] = None, importance_sampling_level: str = "token",
                 sapo_temperature_pos: float = 1.0, sapo_temperature_neg: float = 1.05, temperature: float = 1.0,
                 delta: Optional[float] = None, use_bias_correction_kl: bool = False, vespo_k_pos: float = 2.0,
                 vespo_lambda_pos: float = 3.0, vespo_k_neg: float = 3.0, vespo_lambda_neg: float = 2.0):
        """Arguments as LigerFusedLinearGRPOLoss's; they are checked and bound here, once, into `settings` (a
        GRPOLossSettings: a bad one fails before any forward; the sequence-level refusal of cispo / sapo / vespo
        comes at forward, as Liger's). use_ref_model=False binds beta 0 into it (no KL term)."""
        super().__init__()
        self.settings = GRPOLossSettings(
            loss_type=loss_type, importance_sampling_level=importance_sampling_level, epsilon_low=epsilon_low,
            epsilon_high=epsilon_high, beta=beta if use_ref_model else 0.0, temperature=temperature, delta=delta,
            use_bias_correction_kl=use_bias_correction_kl, sapo_temperature_pos=sapo_temperature_pos,
            sapo_temperature_neg=sapo_temperature_neg, vespo_k_pos=vespo_k_pos, vespo_lambda_pos=vespo_lambda_pos,
            vespo_k_neg=vespo_k_neg, vespo_lambda_neg=vespo_lambda_neg, max_completion_length=max_completion_length)
        BETA.check(beta, "beta")  # checked even when use_ref_model=False leaves it out of the loss
        if loss_type == "dr_grpo" and max_completion_length is None:
            raise ValueError("loss_type='dr_grpo' divides by max_completion_length: pass max_completion_length=...")
        self.beta, self.compiled, self.use_ref_model, self.chunk_size = beta, compiled, use_ref_model, chunk_size

    def forward(self, _input: Tensor, lin_weight: Tensor, selected_token_ids: Tensor, attention_mask: Tensor,
                advantages: Tensor, bias: Optional[Tensor] = None, ref_per_token_logps: Optional[Tensor] = None,
                old_per_token_logps: Optional[Tensor] = None, ref_input: Optional[Tensor] = None,
                ref_weight: Optional[Tensor] = None, ref_bias: Optional[Tensor] = None,
                vllm_is_ratio: Optional[Tensor] = None, num_items_in_batch=None) -> tuple[Tensor, tuple[Tensor, ...]]:
        """_input (B, T, H), lin_weight (V, H), selected_token_ids / attention_mask (B, T), advantages (B,);
        ref_per_token_logps / old_per_token_logps (B, T); ref_input (B, T, H) with ref_weight (V, H) and ref_bias
        (V,) give the reference log-probs instead (no gradient); vllm_is_ratio (B,), (B, 1) or (B, T) weighs the
        policy term (vespo: folded into phi); num_items_in_batch: dapo / cispo / vespo's token count.

        Returns (loss, metrics): metrics = (kl, clip_ratio) when beta != 0, else (clip_ratio,)."""
        settings = self.settings
        if settings.importance_sampling_level is ISLevel.SEQUENCE and settings.loss_type in _NO_SEQUENCE_LEVEL:
            raise ValueError(f"Sequence-level importance sampling is not supported for loss_type="
                             f"'{settings.loss_type.value}' (as in Liger): use importance_sampling_level='token'")
        if not isinstance(_input, Tensor) or _input.dim() != 3:
            raise ValueError(f"_input must have shape (B, T, H), got {tuple(getattr(_input, 'shape', ()))}")
        B, T = _input.shape[:2]
        mask = check_mask(attention_mask, (B, T), _input.device)
        if mask is None:
            mask = torch.ones(B, T, dtype=torch.bool, device=_input.device)
        is_ratio = _check_is_ratio(vllm_is_ratio, B, T, _input.device)
        if settings.loss_type is LossType.LUSPO:
            _check_padding_ids(selected_token_ids, mask, lin_weight.shape[0])
        ref = self._reference_logps(selected_token_ids, mask, ref_per_token_logps, ref_input, ref_weight, ref_bias)
        if settings.loss_type is LossType.LUSPO:
            loss, kl, clip_ratio = self._luspo(_input, lin_weight, selected_token_ids, mask, advantages, bias,
                                               old_per_token_logps, ref, is_ratio, settings)
        else:
            num_items = dapo_normalizer(mask, num_items_in_batch) if settings.loss_type in _DAPO_NORMALISED else None
            loss, metrics = linear_grpo_loss(
                _input, lin_weight, selected_token_ids, advantages, mask=mask, old_logp=old_per_token_logps,
                ref_logp=ref, bias=bias, num_items_in_batch=num_items, importance_sampling_ratio=is_ratio,
                settings=settings)
            kl, clip_ratio = metrics["kl"], metrics["clip_ratio"]
        return loss, ((kl,) if self.beta != 0.0 else ()) + (clip_ratio,)

    def _reference_logps(self, ids: Tensor, mask: Tensor, ref_per_token_logps: Optional[Tensor],
                         ref_input: Optional[Tensor], ref_weight: Optional[Tensor],
                         ref_bias: Optional[Tensor]) -> Optional[Tensor]:
        """The (B, T) reference log-probs the KL term uses, or None when there is no KL term."""
        if not self.use_ref_model:
            return None  # Liger: the reference is logp itself, whatever was passed
        if ref_per_token_logps is None and ref_input is None:
            raise ValueError("use_ref_model=True needs reference log-probs: pass ref_per_token_logps=..., or "
                             "ref_input=... with ref_weight=... (the reference model's hidden states and lm_head); "
                             "or construct with use_ref_model=False for no KL term")
        if ref_per_token_logps is not None and ref_input is not None:
            # Liger's own text, which tests read with pytest.warns(match=...), then the fix
            warnings.warn("Both ref_per_token_logps and ref_input are provided. Using ref_per_token_logps. "
                          "Pass only one of them.", stacklevel=3)
        if self.beta == 0.0:
            return None
        if ref_per_token_logps is not None:
            return ref_per_token_logps
        if ref_weight is None:
            raise ValueError("ref_input needs ref_weight (the reference model's lm_head weight, (V, H)); "
                             "or pass ref_per_token_logps instead")
        settings = self.settings
        if settings.loss_type is not LossType.LUSPO:  # luspo reads every position; the others drop the padding's ids
            ids = ids.masked_fill(~mask, 0)
        with torch.no_grad():  # as Liger: the reference head has no gradient
            return linear_token_logprobs(ref_input, ref_weight, ids, bias=ref_bias, temperature=settings.temperature)

    def _luspo(self, hidden: Tensor, weight: Tensor, ids: Tensor, mask: Tensor, advantages: Tensor,
               bias: Optional[Tensor], old: Optional[Tensor], ref: Optional[Tensor], is_ratio: Optional[Tensor],
               settings: GRPOLossSettings) -> tuple[Tensor, Tensor, Tensor]:
        """Liger's luspo: sum over all B x T positions, padding included, of each token's loss times its
        sequence's length, / (B T). The head runs on every row; the per-token loss is policy_terms'."""
        B, T = mask.shape
        logp = linear_token_logprobs(hidden, weight, ids, bias=bias, temperature=settings.temperature)  # (B, T)
        maskf = mask.to(torch.float32)
        for name, t in (("old_per_token_logps", old), ("ref_per_token_logps", ref)):
            check_shape(t, (B, T), name, logp.device)
        log_ratio = logp - (logp.detach() if old is None else old.to(torch.float32))
        if settings.importance_sampling_level is ISLevel.SEQUENCE:
            log_ratio = ((log_ratio * maskf).sum(-1) / maskf.sum(-1).clamp(min=1.0))[:, None]  # (B, 1)
        p = settings.terms
        adv = _expand_advantages(advantages, B, T, logp.device)
        pg_weight = per_token_weights((B, T), logp.device, is_ratio, None, p.variant)
        per_token, kl, low, high, _, _ = grpo_loss.policy_terms(
            log_ratio, adv, logp, None if ref is None else ref.to(torch.float32), pg_weight, None, p)
        loss = (per_token.expand(B, T) * maskf.sum(-1, keepdim=True)).mean()
        tokens = maskf.sum().clamp(min=1.0)
        kl_mean = (kl.detach().expand(B, T) * maskf).sum() / tokens
        clip_ratio = ((low | high).expand(B, T).float() * maskf).sum() / tokens
        return loss, kl_mean, clip_ratio


def _check_is_ratio(ratio: Optional[Tensor], B: int, T: int, device) -> Optional[Tensor]:
    if ratio is None:
        return None
    shape = tuple(ratio.shape)
    if shape not in ((B,), (B, 1), (B, T)):
        raise ValueError(f"vllm_is_ratio must have shape ({B},), ({B}, 1) or ({B}, {T}), got {shape}")
    if ratio.device != device:
        raise ValueError(f"vllm_is_ratio is on {ratio.device}, _input on {device}: move it there")
    return ratio


def _check_padding_ids(ids: Tensor, mask: Tensor, vocab: int) -> None:
    """luspo computes log-probs at the padding positions too (Liger's reduction counts them)."""
    if (ids.device.type == "cpu" or debug_checks()) and not _tracing(ids) and ids.numel():
        bad = ((ids < 0) | (ids >= vocab)) & ~mask
        if bool(bad.any()):
            raise ValueError(f"loss_type='luspo' (Liger's reduction) includes the padding positions, so their "
                             f"selected_token_ids must be valid ids in [0, {vocab}), found "
                             f"{int(ids[bad][0])}: replace the padding ids by a valid id such as 0")


def dapo_normalizer(attention_mask: Tensor, num_items_in_batch=None):
    """Liger's per-process dapo / cispo / vespo denominator: num_items_in_batch / world_size, or without it the
    mask's tokens summed over processes / world_size, at least 1; None (this micro-batch's tokens) on one process."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    world_size = torch.distributed.get_world_size() if distributed else 1
    if num_items_in_batch is not None:
        return max(float(num_items_in_batch) / world_size, 1.0)
    if not distributed:
        return None
    total = attention_mask.to(torch.float32).sum()
    torch.distributed.all_reduce(total)
    return (total / world_size).clamp(min=1.0)
