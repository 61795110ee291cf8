"""`Arch`: the shapes a model's memory depends on, read from a transformers config (no weights).

The planner (plan.py), host RAM (host_plan.py) and the tools built on them take an `Arch`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config import ConfigError


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
    config: dict = field(default_factory=dict)  # the transformers config (for the layer probe)

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
        missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
                   if not isinstance(getattr(conf, k, None), int)]
        if missing:
            raise ConfigError(f"the planner reads decoder-only configs of the Llama/Qwen family; this "
                              f"{conf.model_type} config has no {', '.join(missing)}")
        head_dim = getattr(conf, "head_dim", None) or conf.hidden_size // conf.num_attention_heads
        return cls(conf.vocab_size, conf.hidden_size, conf.intermediate_size, conf.num_hidden_layers,
                   conf.num_attention_heads, getattr(conf, "num_key_value_heads", conf.num_attention_heads),
                   head_dim, bool(getattr(conf, "tie_word_embeddings", False)), sizes, conf.to_dict())

    @property
    def params(self) -> int:
        return sum(self.tensor_sizes)

    def layer_params(self) -> int:
        attn = self.hidden * (self.heads * self.head_dim) * 2 + self.hidden * (self.kv_heads * self.head_dim) * 2
        return attn + 3 * self.hidden * self.intermediate + 2 * self.hidden
