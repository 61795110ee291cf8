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
    # Activation bytes: bf16 with bf16 weights or autocast; bf16=None means autocast on an Ampere+ GPU.
    ab = 2 if (m.precision == "bf16_sr" or m.bf16 is not False) else 4
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
        kept = 0 if m.offload_activations else arch.layers * tokens * arch.hidden * ab  # layer inputs
        activations = kept + layer_recompute
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
    if t.beta > 0 and t.reference_compute != "cpu":
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


# What the allocator does not show, added to the allocator-view peak before comparing with a card:
# the CUDA context (~0.3-0.5 GiB with lazy module loading on CUDA 12), cuBLAS/cuDNN workspaces and
# allocator fragmentation. A stated estimate, not yet fitted to GPU runs (the planner's accuracy
# table will do that): 0.5 GiB + 5% of the allocator peak.
CONTEXT_BYTES = GiB // 2
FRAGMENTATION = 0.05


def margin_bytes(peak: int) -> int:
    return int(CONTEXT_BYTES + FRAGMENTATION * peak)


# Changes the planner may suggest, cheapest first (cost to training quality/speed, not bytes):
# memory-only switches, then switches that cost time, then ones that change the algorithm's batch.
def suggestions(cfg: Config, arch: Arch, budget: int) -> list[dict]:
    """Single changes and a cumulative combination (cheapest first) with their predicted totals."""
    import copy
    g, t, m = cfg.generation, cfg.train, cfg.model

    def variant(desc: str, edit) -> tuple[str, Config]:
        new = copy.deepcopy(cfg)
        edit(new)
        return desc, new

    options = []
    if t.beta > 0 and t.reference_compute == "auto":
        options.append(variant("reference_compute=cpu", lambda c: setattr(c.train, "reference_compute", "cpu")))
    if not t.optimizer_in_backward:
        micro = t.steps_per_generation or t.gradient_accumulation_steps  # micro-batches per generation batch
        options.append(variant(f"optimizer_in_backward=true gradient_accumulation_steps=1 steps_per_generation={micro}",
                               lambda c: (setattr(c.train, "optimizer_in_backward", True),
                                          setattr(c.train, "steps_per_generation", micro),
                                          setattr(c.train, "gradient_accumulation_steps", 1))))
    if m.precision != "bf16_sr":
        options.append(variant("precision=bf16_sr (bf16 weights, stochastic rounding; GPU sm_80+)",
                               lambda c: setattr(c.model, "precision", "bf16_sr")))
    if not m.gradient_checkpointing:
        options.append(variant("gradient_checkpointing=true", lambda c: setattr(c.model, "gradient_checkpointing", True)))
    elif not m.offload_activations:
        options.append(variant("offload_activations=true", lambda c: setattr(c.model, "offload_activations", True)))
    if g.generation_micro_batch_size > 8:
        half = g.generation_micro_batch_size // 2
        options.append(variant(f"generation_micro_batch_size={half}",
                               lambda c: setattr(c.generation, "generation_micro_batch_size", half)))
    if t.per_device_train_batch_size > 1:
        b = t.per_device_train_batch_size // 2
        options.append(variant(f"per_device_train_batch_size={b} (double gradient_accumulation_steps or "
                               "steps_per_generation to keep the batch)",
                               lambda c: setattr(c.train, "per_device_train_batch_size", b)))
    if g.max_completion_length > 128:
        shorter = int(g.max_completion_length * 0.75)
        options.append(variant(f"max_completion_length={shorter}",
                               lambda c: setattr(c.generation, "max_completion_length", shorter)))
    out = []
    for desc, new in options:
        peak = plan(new, arch)["peak_bytes"]
        total = peak + margin_bytes(peak)
        out.append({"change": desc, "peak_bytes": peak, "total_bytes": total, "fits": total <= budget})
    combined, steps = copy.deepcopy(cfg), []
    for desc, new in options:  # apply cheapest-first until it fits
        diff_cfg = copy.deepcopy(combined)
        for section in ("model", "generation", "train"):
            base, changed = getattr(cfg, section), getattr(new, section)
            for f in base.__dataclass_fields__:
                if getattr(base, f) != getattr(changed, f):
                    setattr(getattr(diff_cfg, section), f, getattr(changed, f))
        combined = diff_cfg
        steps.append(desc)
        peak = plan(combined, arch)["peak_bytes"]
        if peak + margin_bytes(peak) <= budget:
            out.append({"change": " + ".join(steps), "peak_bytes": peak, "total_bytes": peak + margin_bytes(peak),
                        "fits": True, "combined": True})
            break
    return out
