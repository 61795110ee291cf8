"""Fused loss-head ops for GRPO: per-token log-probs and losses without vocab-size tensors.

    token_logprobs         logits (..., V)           -> logp (...)
    grpo_token_terms       logp (B, T)               -> per-token loss terms  (on log-probs already held)
    grpo_token_loss        logits (B, T, V)          -> per-token loss        (token_logprobs fused in)
    linear_token_logprobs  hidden (..., H), W (V, H) -> logp (...)            (the lm_head fused in)
    linear_grpo_loss       hidden (B, T, H), W       -> scalar loss, metrics  (linear_token_logprobs + loss)

CUDA tensors run Triton kernels; CPU tensors run a chunked torch path with the same memory bound.
`spec` holds the plain fp32 torch spec every op is tested against, under the ops' names.
`FusedLinearGRPOLoss` is linear_grpo_loss behind Liger-Kernel's `LigerFusedLinearGRPOLoss` interface
(fused_linear_grpo.py).

Design notes: docs/kernels.md
"""

from ._backend import HAS_TRITON, get_backend, set_backend, use_backend
from .fused_linear_grpo import FusedLinearGRPOLoss
from .grpo_loss import GRPOTokenLoss, grpo_token_loss, grpo_token_terms
from .linear import linear_token_logprobs
from .linear_loss import linear_grpo_loss
from .logprobs import token_logprobs
from .loss_settings import GRPOLossSettings, ISLevel, LossType

__all__ = [
    "token_logprobs", "grpo_token_loss", "linear_token_logprobs", "linear_grpo_loss",
    "grpo_token_terms", "GRPOTokenLoss", "FusedLinearGRPOLoss", "GRPOLossSettings", "LossType", "ISLevel",
    "HAS_TRITON", "get_backend", "set_backend", "use_backend",
]
