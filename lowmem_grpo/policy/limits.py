"""The model's limits against the run's settings, checked at start-up from the model config (before any
weights load): the longest sequence, max_prompt_length + max_completion_length, against the positions
the model has, and the tokenizer's ids against the model's embedding rows.

- Learned absolute positions (GPT-2's wpe, OPT, GPT-Neo: a table of max_position_embeddings rows): a
  longer sequence indexes past the table, so it is refused (ModelLimitError) with the numbers.
- RoPE: positions past the trained length compute, but quality there is not guaranteed: one warning
  (logging) per model and length. rope_scaling (linear, dynamic, yarn, llama3, longrope) that extends the
  trained length raises the limit to original_max_position_embeddings x factor.
- ALiBi or no stated limit: nothing to check.
- Tokenizer ids >= the embedding rows (vocab_size) would index past the embedding: refused.
"""

from __future__ import annotations

import logging
from typing import Optional

from transformers import AutoConfig

from ..config import ModelConfig
from .model import ModelError, materialize_model_source

logger = logging.getLogger(__name__)

_warned: set[tuple] = set()  # (model, length): the RoPE warning is said once per process


class ModelLimitError(ModelError):
    """The run's settings ask for more than the model has (positions, vocabulary)."""


def _text_config(config):
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _rope_parameters(config) -> Optional[dict]:
    """The RoPE parameters (transformers 5: rope_parameters; 4.x: rope_scaling + rope_theta), or None where
    the model has no rotary positions."""
    for name in ("rope_parameters", "rope_scaling"):
        value = getattr(config, name, None)
        if isinstance(value, dict):
            return value
    if getattr(config, "rope_theta", None) is not None or getattr(config, "rotary_dim", None) is not None:
        return {}
    return None


def position_limit(config) -> tuple[str, Optional[int]]:
    """(kind, limit): kind is 'learned' (absolute position table), 'rope' or 'none' (ALiBi, or no stated
    limit); limit is the longest sequence in tokens the model was built or trained for (None: no limit).
    For RoPE with rope_scaling that extends the context, max(max_position_embeddings,
    original_max_position_embeddings x factor)."""
    config = _text_config(config)
    if getattr(config, "alibi", False) or getattr(config, "position_embedding_type", None) == "alibi":
        return "none", None
    limit = getattr(config, "max_position_embeddings", None)
    if limit is None:
        limit = getattr(config, "n_positions", None)
    if not isinstance(limit, int) or limit <= 0:
        return "none", None
    rope = _rope_parameters(config)
    if rope is None:
        return "learned", limit
    factor = rope.get("factor")
    if rope.get("rope_type", rope.get("type", "default")) != "default" and isinstance(factor, (int, float)):
        original = rope.get("original_max_position_embeddings") or limit
        limit = max(limit, int(original * factor))
    return "rope", limit


def embedding_rows(config, model=None) -> Optional[int]:
    """Rows of the input embedding: the loaded model's, else the config's vocab_size."""
    if model is not None and hasattr(model, "get_input_embeddings"):
        embedding = model.get_input_embeddings()
        rows = getattr(embedding, "num_embeddings", None)
        if isinstance(rows, int):
            return rows
    rows = getattr(_text_config(config), "vocab_size", None)
    return rows if isinstance(rows, int) else None


def check_positions(config, max_prompt_length: int, max_completion_length: int, name: str = "the model") -> None:
    """Refuse (learned positions) or warn once (RoPE) when max_prompt_length + max_completion_length is longer
    than the model's positions, naming the numbers and the settings to change."""
    length = max_prompt_length + max_completion_length
    kind, limit = position_limit(config)
    if limit is None or length <= limit:
        return
    numbers = (f"max_prompt_length + max_completion_length = {max_prompt_length} + {max_completion_length} = "
               f"{length} tokens, but {name} has {limit} positions")
    if kind == "learned":
        raise ModelLimitError(f"{numbers} (a learned position table: max_position_embeddings / n_positions); lower "
                              f"max_prompt_length or max_completion_length so that they sum to at most {limit}")
    key = (name, limit, length)
    if key not in _warned:
        _warned.add(key)
        logger.warning(f"{numbers} (RoPE, trained up to that length): positions past {limit} compute, but the "
                       "quality of what the model reads and writes there is not guaranteed; lower "
                       f"max_prompt_length or max_completion_length to sum to at most {limit}, or use a config with "
                       "rope_scaling that extends the context")


def check_vocabulary(config, tokenizer, model=None, name: str = "the model") -> None:
    """Refuse a tokenizer whose ids reach past the model's embedding rows (the embedding lookup would fail)."""
    if tokenizer is None:
        return
    rows = embedding_rows(config, model)
    if rows is None:
        return
    ids = len(tokenizer)
    if ids > rows:
        raise ModelLimitError(f"the tokenizer has ids up to {ids - 1} ({ids} tokens) but {name} has {rows} embedding "
                              f"rows (vocab_size {rows}): ids >= {rows} cannot be embedded; use the model's own "
                              "tokenizer (model.tokenizer, or processing_class=), or a model whose vocabulary covers "
                              "this tokenizer")


def check_model_limits(config, tokenizer, max_prompt_length: int, max_completion_length: int, model=None,
                       name: str = "the model") -> None:
    """check_vocabulary, then check_positions: what start-up checks once the model config is known."""
    check_vocabulary(config, tokenizer, model, name)
    check_positions(config, max_prompt_length, max_completion_length, name)


def source_config(cfg: ModelConfig):
    """The transformers config of the model `cfg` names (its config dict, or the folder / hub id's
    config.json), without loading any weights."""
    if cfg.config is not None:
        conf = dict(cfg.config)
        return AutoConfig.for_model(conf.pop("model_type"), **conf)
    path = materialize_model_source(cfg)
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
    except OSError as e:
        raise ModelError(f"could not load the config of model {path!r}: {e}") from e


def check_run_limits(cfg: ModelConfig, generation, tokenizer, model=None) -> None:
    """The start-up check of a run (training or evaluation): `model` (a loaded one) or the config `cfg`
    names against the tokenizer and generation's max_prompt_length + max_completion_length."""
    config = model.config if model is not None else source_config(cfg)
    name = cfg.name_or_path or f"the model ({getattr(config, 'model_type', None) or type(config).__name__})"
    check_model_limits(config, tokenizer, generation.max_prompt_length, generation.max_completion_length,
                       model=model, name=name)
