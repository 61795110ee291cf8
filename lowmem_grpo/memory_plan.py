"""Device-memory accounting of a GRPO step from a model config and the run's settings (no weights).

This is the arithmetic the 8 GB recipes rest on, by category and by phase:

    weights             P x bytes(weight dtype)                       (tied embedding counted once)
    optimizer states    bitsandbytes 8-bit AdamW: 2 B/element + 2 fp32 absmax per 256-block for tensors
                        >= 4096 elements, 8 B/element (fp32 states) below; torch AdamW: 2 x bytes(dtype)
    gradients           all of them (bytes(dtype) x P) at the optimizer step; with the optimizer step in
                        backward only the tensors alive at once: the tied embedding (its gradient lives
                        from the head to the embedding lookup) + the largest other tensor
    activations         checkpointing: one (b, L, H) layer input per layer, plus one layer's recompute
                        (attention + MLP intermediates) and the last hidden states; without it every
                        layer's intermediates
    loss head           the fused head's fp32 [n, chunk] slice (<= 256 MiB) + fp32 [n, H] accumulator
    KV cache            generation micro-batch x (prompt + completion) x layers x 2 x kv_dim x bytes
    reference buffers   streamed reference: two decoder layers + one head slice (weights stay on the host)

Phases: rollout (weights + states + KV cache), reference log-probs, training step (weights + states
+ gradients + activations + loss head). Peak = the largest phase. The allocator's view only: CUDA
context, cuBLAS workspace and fragmentation come on top (the planner issue adds that margin).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .config import Config

GiB = 2**30
BNB_BLOCK, BNB_MIN_8BIT = 256, 4096


@dataclass
class Arch:
    """The shapes that memory depends on, read from a transformers config."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    tensor_sizes: list[int] = field(default_factory=list)  # numel of every parameter tensor (tied once)

    @classmethod
    def from_config(cls, conf) -> "Arch":
        """From a transformers PretrainedConfig (or a dict with model_type)."""
        if isinstance(conf, dict):
            from transformers import AutoConfig
            conf = dict(conf)
            conf = AutoConfig.for_model(conf.pop("model_type"), **conf)
        from transformers import AutoModelForCausalLM
        with torch.device("meta"):  # shapes only: no memory, no weights
            model = AutoModelForCausalLM.from_config(conf)
        sizes = [p.numel() for p in model.parameters()]  # parameters() yields a tied weight once
        head_dim = getattr(conf, "head_dim", None) or conf.hidden_size // conf.num_attention_heads
        return cls(conf.vocab_size, conf.hidden_size, conf.intermediate_size, conf.num_hidden_layers,
                   conf.num_attention_heads, getattr(conf, "num_key_value_heads", conf.num_attention_heads),
                   head_dim, bool(getattr(conf, "tie_word_embeddings", False)), sizes)

    @property
    def params(self) -> int:
        return sum(self.tensor_sizes)

    def layer_params(self) -> int:
        attn = self.hidden * (self.heads * self.head_dim) * 2 + self.hidden * (self.kv_heads * self.head_dim) * 2
        return attn + 3 * self.hidden * self.intermediate + 2 * self.hidden


def optimizer_state_bytes(sizes: list[int], optimizer: str, weight_bytes: int) -> int:
    if optimizer == "adamw":
        return 2 * weight_bytes * sum(sizes)
    total = 0
    for n in sizes:
        if n >= BNB_MIN_8BIT:
            total += 2 * n + 2 * 4 * -(-n // BNB_BLOCK)  # two uint8 states + two fp32 absmax per block
        else:
            total += 8 * n  # bitsandbytes keeps fp32 states for small tensors
    return total


def plan(cfg: Config, arch: Arch) -> dict:
    """Predicted device bytes per category and per phase for one step of `cfg` on `arch`."""
    g, t, m = cfg.generation, cfg.train, cfg.model
    wb = 2 if m.precision == "bf16_sr" else 4  # weight (and gradient) bytes
    ab = 2 if (m.precision == "bf16_sr" or m.bf16) else 4  # activation bytes (bf16 autocast or weights)
    b, L = t.per_device_train_batch_size, g.max_prompt_length + g.max_completion_length
    weights = wb * arch.params
    states = optimizer_state_bytes(arch.tensor_sizes, cfg.optim.optimizer, wb)
    embedding = arch.vocab * arch.hidden
    if t.optimizer_in_backward:
        others = sorted((n for n in arch.tensor_sizes if n != embedding), reverse=True)
        grads = wb * ((embedding if arch.tied else 0) + (others[0] if others else 0))
    else:
        grads = wb * arch.params
    tokens = b * L
    layer_recompute = tokens * (6 * arch.hidden + 3 * arch.intermediate + 2 * arch.heads * arch.head_dim) * ab
    if m.gradient_checkpointing:
        activations = arch.layers * tokens * arch.hidden * ab + layer_recompute
    else:
        activations = arch.layers * layer_recompute
    n_completion = b * g.max_completion_length
    chunk = min(arch.vocab, max(1, (256 * 2**20) // (4 * max(n_completion, 1))))
    loss_head = 4 * n_completion * chunk + 4 * n_completion * arch.hidden + tokens * arch.hidden * ab
    gen_b = min(g.generation_micro_batch_size, t.generation_batch_size or b * (t.steps_per_generation or
                                                                               t.gradient_accumulation_steps))
    kv_cache = gen_b * L * arch.layers * 2 * arch.kv_heads * arch.head_dim * ab
    gen_logits = 4 * gen_b * arch.vocab * 2  # last-position logits and their softmax, per decoding step
    ref = 0
    if t.beta > 0:
        ref = 2 * arch.layer_params() * wb + min(arch.vocab, chunk) * arch.hidden * wb
    categories = {"weights": weights, "optimizer states": states, "gradients": grads, "activations": activations,
                  "loss head": loss_head, "KV cache": kv_cache + gen_logits, "reference buffers": ref}
    phases = {
        "rollout": weights + states + kv_cache + gen_logits,
        "reference log-probs": weights + states + ref + tokens * arch.hidden * ab * 2 + loss_head,
        "training step": weights + states + grads + activations + loss_head,
    }
    return {"categories": categories, "phases": phases, "peak_bytes": max(phases.values()),
            "peak_phase": max(phases, key=phases.get)}


def format_plan(result: dict) -> str:
    lines = [f"{'category':<20} {'GiB':>8}"]
    lines += [f"{k:<20} {v / GiB:>8.3f}" for k, v in result["categories"].items()]
    lines += ["", f"{'phase':<20} {'GiB':>8}"]
    lines += [f"{k:<20} {v / GiB:>8.3f}" for k, v in result["phases"].items()]
    lines += ["", f"peak: {result['peak_bytes'] / GiB:.3f} GiB ({result['peak_phase']}), allocator view"]
    return "\n".join(lines)
