"""A drop-in for TRL users: `from lowmem_grpo.integrations.trl import GRPOTrainer` is TRL's GRPOTrainer
(same constructor, same GRPOConfig) whose LM head is lowmem-grpo's fused head and rollouts its native engine.

TRL 1.16's GRPOTrainer gets every per-token log-prob (policy pass with gradient, old-policy and reference passes
without) from `model(..., labels=..., fused_lm_head=True)`, a forward that `trl.trainer.utils.add_fused_lm_head`
patches in. This trainer re-patches the policy and reference models, after TRL's constructor, with the same forward
whose head is `lowmem_grpo.kernels.linear_token_logprobs` (log-probs and entropy, differentiable). Everything else,
including each `loss_type`'s per-token loss on the (B, T) log-probs, is TRL's own code; only the (B, T, V)-sized
head and generate() (trl_generation.py) change. MoE models: as in TRL's head, router logits are requested only where
the config's output_router_logits (or the caller) asks for them; then aux_loss is the family's own transformers
`load_balancing_loss_func` (Mixtral's, as TRL uses, where the family has none) and `loss` adds router_aux_loss_coef
* aux_loss. final_logit_softcapping (Gemma 2) is applied in the fused head, before the temperature.
cast_lm_head_to_fp32=True: the head runs in fp32 (hidden states and weight) with autocast off, as TRL's does.
Refused at construction, with the reason: a logit scale (Granite, Cohere, ...); FSDP-sharded (DTensor) heads are
refused on the first fused call."""

from __future__ import annotations

import contextlib
import functools
import sys
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
from .trl_generation import log_fallback, native_completions, native_generation_problem

__all__ = ["GRPOTrainer", "add_fused_lm_head"]


def _unsupported(model) -> list[str]:
    """Why our head cannot replace TRL's on this model (empty: it can)."""
    config = model.config.get_text_config()
    why = []
    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling"):
        value = getattr(config, name, None)
        if value is not None and value != 1.0:
            why.append(f"{name}={value}")
    return why


def _router_loss(model):
    """The MoE family's own load-balancing loss function, from the model's transformers module; Mixtral's
    (the one TRL's head uses for every family) where the family defines none."""
    own = getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)
    if own is not None:
        return own
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    return load_balancing_loss_func


def _experts(model, config) -> tuple[int, int]:
    """(num_experts, num_experts_per_tok), read as the model's own forward reads them."""
    num_experts = getattr(model, "num_experts", None)
    if num_experts is None:
        num_experts = getattr(config, "num_experts", None) or config.num_local_experts
    return num_experts, getattr(model, "num_experts_per_tok", None) or config.num_experts_per_tok


def add_fused_lm_head(model, temperature: float = 1.0, cast_lm_head_to_fp32: bool = False) -> None:
    """`trl.trainer.utils.add_fused_lm_head(model, temperature, cast_lm_head_to_fp32, ("log_probs", "entropy"))`
    with our head: `model(..., labels=labels, fused_lm_head=True)` returns TRL's FusedCausalLMOutput (log_probs
    and entropy, 0 where labels are -100; aux_loss when router logits are requested) without (B, T, V) logits;
    without the flag, the model's own forward. cast_lm_head_to_fp32: the head runs in fp32, autocast off."""
    why = _unsupported(model)
    if why:
        raise ValueError(f"{type(model).__name__} has {', '.join(why)}, which lowmem-grpo's fused head does not "
                         "apply; use trl.GRPOTrainer for this model")
    original_forward = types.MethodType(type(model).forward, model)  # not TRL's patched instance forward
    text_config = model.config.get_text_config()
    softcap = getattr(text_config, "final_logit_softcapping", None)  # Gemma 2: c tanh(logits / c)

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
        if getattr(text_config, "output_router_logits", False):  # as the model's own forward does
            kwargs.setdefault("output_router_logits", True)
        backbone = self.base_model(*args, **kwargs)
        if shift_labels is None:  # position t predicts token t + 1
            hidden, labels = backbone.last_hidden_state[:, :-1], labels[:, 1:]
        else:
            hidden, labels = backbone.last_hidden_state, shift_labels
        lm_head = self.get_output_embeddings()
        if not isinstance(lm_head.weight, torch.Tensor) or type(lm_head.weight).__name__ == "DTensor":
            raise ValueError("the LM head is sharded (FSDP DTensor); lowmem-grpo's head needs the full weight")
        hidden, labels = hidden.to(lm_head.weight.device), labels.to(lm_head.weight.device)
        weight, bias = lm_head.weight, lm_head.bias
        autocast = contextlib.nullcontext()
        if cast_lm_head_to_fp32:  # TRL's trainer has cast the head's parameters already: then no copies
            hidden, weight = hidden.float(), weight.float()
            bias = None if bias is None else bias.float()
            autocast = torch.autocast(hidden.device.type, enabled=False)
        mask = labels != -100  # (B, T): only these rows go through the head
        with autocast:
            logp, entropy = linear_token_logprobs(hidden[mask], weight, labels[mask], bias=bias,
                                                  temperature=temperature, return_entropy=True,
                                                  softcap=softcap)  # (n_kept,) each
        log_probs = logp.new_zeros(mask.shape).masked_scatter(mask, logp)  # keeps the graph when none is kept
        entropy = entropy.new_zeros(mask.shape).masked_scatter(mask, entropy)
        loss = -log_probs.sum() / (mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch)
        aux_loss = None
        if kwargs.get("output_router_logits"):
            aux_loss = _router_loss(self)(backbone.router_logits, *_experts(self, text_config),
                                          kwargs.get("attention_mask"))  # None when padding-free: all tokens
            loss = loss + getattr(text_config, "router_aux_loss_coef", 0.0) * aux_loss
        return FusedCausalLMOutput(loss=loss, log_probs=log_probs, entropy=entropy, label_mask=mask,
                                   aux_loss=aux_loss)

    model.forward = types.MethodType(_fused_forward, model)


class GRPOTrainer(trl.GRPOTrainer):
    """TRL's GRPOTrainer, same arguments; the policy and reference models' heads are lowmem-grpo's, and its
    rollouts run on lowmem-grpo's native engine where TRL would call generate() (`native_generation=False`:
    TRL's generate() always; trl_generation.py says where TRL's own path runs regardless)."""

    def __init__(self, *args, native_generation: bool = True, **kwargs):
        self.native_generation = native_generation
        super().__init__(*args, **kwargs)  # builds the models, casts the heads if asked, patches TRL's head in
        cast = bool(getattr(self.args, "cast_lm_head_to_fp32", False))
        model = self.model.get_base_model() if is_peft_model(self.model) else self.model
        add_fused_lm_head(model, temperature=self.temperature, cast_lm_head_to_fp32=cast)
        if self.ref_model is not None:
            add_fused_lm_head(self.ref_model, temperature=self.temperature, cast_lm_head_to_fp32=cast)

    def _generate_single_turn(self, prompt_ids, images=None, multimodal_fields=None, *args, **kwargs):
        """TRL's: (completion_ids, logprobs); on the native engine where it can sample this call (logprobs
        None, as TRL's generate() path returns), else TRL's own path."""
        problem = native_generation_problem(self, images, multimodal_fields)
        if problem is not None:
            log_fallback(problem)
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, *args, **kwargs)
        return native_completions(self, prompt_ids), None
