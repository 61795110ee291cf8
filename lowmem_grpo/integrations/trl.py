"""A drop-in for TRL users: `from lowmem_grpo.integrations.trl import GRPOTrainer` is TRL's GRPOTrainer
(same constructor, same GRPOConfig) whose LM head runs through lowmem-grpo's fused head.

TRL 1.16's GRPOTrainer computes every per-token log-prob it needs (the policy pass with its gradient, the
old-policy and reference passes without) through `model(..., labels=..., fused_lm_head=True)`, a forward
that `trl.trainer.utils.add_fused_lm_head` patches into the policy and reference models. This trainer
patches them again, after TRL's constructor, with the same forward whose head is
`lowmem_grpo.kernels.linear_token_logprobs` (log-probs and entropy, both differentiable). Everything else
is TRL's own code: generation, rewards, advantages and the per-token loss of every `loss_type`, which
works on (B, T) log-prob vectors, so each loss type keeps its TRL definition exactly; only the
(B, T, V)-sized part, the head, changes.

Refused at construction, with the reason (TRL's head handles them, ours does not yet): final-logit
softcapping or a logit scale (Gemma 2, Granite, ...), cast_lm_head_to_fp32=True, MoE router losses,
FSDP-sharded (DTensor) heads.
"""

from __future__ import annotations

import functools
import types

import torch

try:
    import trl
    from accelerate.utils import is_peft_model
    from trl.trainer.utils import FusedCausalLMOutput
except ImportError as err:  # TRL is not a dependency of lowmem-grpo
    raise ImportError(f"lowmem_grpo.integrations.trl needs TRL >= 1.16 ({err}); pip install 'trl>=1.16' "
                      "(or lowmem-grpo's bench extra)") from err

from ..kernels import linear_token_logprobs

__all__ = ["GRPOTrainer", "add_fused_lm_head"]


def _unsupported(model) -> list[str]:
    """Why our head cannot replace TRL's on this model (empty: it can)."""
    config = model.config.get_text_config()
    why = []
    if getattr(config, "final_logit_softcapping", None) is not None:
        why.append(f"final_logit_softcapping={config.final_logit_softcapping}")
    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling"):
        value = getattr(config, name, None)
        if value is not None and value != 1.0:
            why.append(f"{name}={value}")
    if getattr(config, "output_router_logits", False):
        why.append("output_router_logits=True (an MoE load-balancing loss)")
    return why


def add_fused_lm_head(model, temperature: float = 1.0) -> None:
    """`trl.trainer.utils.add_fused_lm_head(model, temperature, outputs=("log_probs", "entropy"))` with our
    head: `model(..., labels=labels, fused_lm_head=True)` returns TRL's FusedCausalLMOutput (log_probs and
    entropy, 0 where labels are -100) without (B, T, V) logits; without the flag, the model's own forward."""
    why = _unsupported(model)
    if why:
        raise ValueError(f"{type(model).__name__} has {', '.join(why)}, which lowmem-grpo's fused head does not "
                         "apply; use trl.GRPOTrainer for this model")
    original_forward = types.MethodType(type(model).forward, model)  # not TRL's patched instance forward

    @functools.wraps(type(model).forward)  # generate() validates its kwargs against this signature
    def _fused_forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None,
                       **kwargs):
        if not fused_lm_head:
            for name, value in (("labels", labels), ("shift_labels", shift_labels),
                                ("num_items_in_batch", num_items_in_batch)):
                if value is not None:
                    kwargs[name] = value
            return original_forward(*args, **kwargs)
        kwargs["use_cache"] = False
        backbone = self.base_model(*args, **kwargs)
        if shift_labels is None:  # position t predicts token t + 1
            hidden, labels = backbone.last_hidden_state[:, :-1], labels[:, 1:]
        else:
            hidden, labels = backbone.last_hidden_state, shift_labels
        lm_head = self.get_output_embeddings()
        if not isinstance(lm_head.weight, torch.Tensor) or type(lm_head.weight).__name__ == "DTensor":
            raise ValueError("the LM head is sharded (FSDP DTensor); lowmem-grpo's head needs the full weight")
        hidden, labels = hidden.to(lm_head.weight.device), labels.to(lm_head.weight.device)
        mask = labels != -100  # (B, T): only these rows go through the head
        logp, entropy = linear_token_logprobs(hidden[mask], lm_head.weight, labels[mask], bias=lm_head.bias,
                                              temperature=temperature, return_entropy=True)  # (n_kept,) each
        log_probs = logp.new_zeros(mask.shape).masked_scatter(mask, logp)  # keeps the graph when none is kept
        entropy = entropy.new_zeros(mask.shape).masked_scatter(mask, entropy)
        loss = -log_probs.sum() / (mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch)
        return FusedCausalLMOutput(loss=loss, log_probs=log_probs, entropy=entropy, label_mask=mask)

    model.forward = types.MethodType(_fused_forward, model)


class GRPOTrainer(trl.GRPOTrainer):
    """TRL's GRPOTrainer, same arguments; the policy and reference models' heads are lowmem-grpo's."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)  # builds the models and patches TRL's head into them
        if getattr(self.args, "cast_lm_head_to_fp32", False):
            raise ValueError("cast_lm_head_to_fp32=True is not supported by lowmem-grpo's head (it accumulates "
                             "in fp32 already); set it False, or use trl.GRPOTrainer")
        model = self.model.get_base_model() if is_peft_model(self.model) else self.model
        add_fused_lm_head(model, temperature=self.temperature)
        if self.ref_model is not None:
            add_fused_lm_head(self.ref_model, temperature=self.temperature)
