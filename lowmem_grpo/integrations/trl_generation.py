"""The TRL drop-in's rollouts on lowmem-grpo's native engine (policy/rollout.py) instead of generate().

`native_generation_problem(trainer, images, multimodal_fields)`: why TRL's own generation path must run for
this call (None: the native engine can sample it with generate()'s settings and distribution).
`native_completions(trainer, prompt_ids)`: one completion per prompt, each a list of token ids up to and
including its first EOS, as TRL's generate() path returns them (its `_generate_single_turn`).
The settings are TRL's: temperature, top_p, top_k, min_p, repetition_penalty and max_completion_length from
GRPOConfig, the model's generation_config for the rest (overridden by TRL's as its generate() path does).
Sampled tokens follow the engine's own random stream, not generate()'s; greedy-equivalent settings
(top_k=1) give generate()'s tokens. Design notes: docs/trl.md ("The drop-in's rollouts").
"""

from __future__ import annotations

import logging
from typing import Optional

from accelerate.utils import is_peft_model
from trl.models import unwrap_model_for_generation

from ..config import GenerationConfig
from ..policy.rollout import generate
from ..policy.sampling import fast_sampling_problem

log = logging.getLogger(__name__)

_logged: set[str] = set()


def _settings(trainer, prompt_ids: list[list[int]]) -> GenerationConfig:
    """Our GenerationConfig with TRL's sampling settings, all rows decoding at once as generate() does; the eager
    decode step (TRL bounds no prompt length, so a compiled step's cache would change shape from call to call)."""
    return GenerationConfig(
        max_prompt_length=max(len(p) for p in prompt_ids), max_completion_length=trainer.max_completion_length,
        temperature=trainer.temperature, top_p=1.0 if trainer.top_p is None else trainer.top_p,
        top_k=trainer.top_k or 0, min_p=trainer.min_p,
        repetition_penalty=1.0 if trainer.repetition_penalty is None else trainer.repetition_penalty,
        generation_micro_batch_size=len(prompt_ids), compile_decode=False)


def native_generation_problem(trainer, images, multimodal_fields) -> Optional[str]:
    """Why this generation call goes to TRL's own path, or None where the native engine takes it."""
    args = trainer.args
    if not trainer.native_generation:
        return "native_generation=False"
    if trainer.use_vllm or getattr(trainer, "use_transformers_continuous_batching", False):
        return "use_vllm or use_transformers_continuous_batching"
    if images is not None or multimodal_fields:
        return "multimodal inputs"
    if args.generation_kwargs:
        return f"GRPOConfig.generation_kwargs={args.generation_kwargs!r}"
    if trainer.accelerator.mixed_precision == "fp16":
        return "fp16 mixed precision"
    if args.cache_implementation is not None:
        return f"GRPOConfig.cache_implementation={args.cache_implementation!r}"
    if getattr(trainer.generation_config, "suppress_tokens", None):
        return "suppressed tokens (a vision-language processor)"
    if trainer.accelerator.state.deepspeed_plugin is not None or getattr(trainer, "is_fsdp_enabled", False):
        return "DeepSpeed or FSDP (sharded parameters)"
    if is_peft_model(trainer.model):
        return "a PEFT model"
    if trainer._tokenizer.pad_token_id is None:
        return "the tokenizer has no pad token"
    return fast_sampling_problem(trainer.model, _settings(trainer, [[0]]))


def log_fallback(problem: str) -> None:
    """Say once per reason (and not for the switch itself) that TRL's generation path runs."""
    if problem != "native_generation=False" and problem not in _logged:
        _logged.add(problem)
        log.warning("lowmem-grpo's TRL drop-in: rollouts through TRL's generate() path: %s", problem)


def native_completions(trainer, prompt_ids: list[list[int]]) -> list[list[int]]:
    """Each prompt's sampled completion (token ids up to and including its first EOS), on the native engine,
    inside TRL's unwrap_model_for_generation (its generation_config override, gradient checkpointing off)."""
    cfg = _settings(trainer, prompt_ids)
    autocast_bf16 = trainer.accelerator.mixed_precision == "bf16"  # accelerate's autocast around forward
    with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator,
                                     generation_kwargs=trainer.generation_kwargs,
                                     gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs) as model:
        batch = generate(model, [list(p) for p in prompt_ids], cfg, eos_ids=list(trainer.eos_token_ids),
                         pad_id=trainer._tokenizer.pad_token_id, device=trainer.accelerator.device,
                         autocast_bf16=autocast_bf16)
    return [row[mask].tolist() for row, mask in zip(batch.completion_ids, batch.completion_mask)]
