"""What a TRL user types: every field of TRL 1.16's GRPOConfig (and transformers' TrainingArguments under
it) that is not a lowmem-grpo key, and what it becomes here.

`TRL_NAMES` maps each such name to a `TrlName`: `translate(value, cfg)` returns the lowmem-grpo settings
{key: value} it stands for (empty: accepted, nothing to change), or raises a ConfigError that says what to
use instead. Four kinds: renamed (the same setting under our name), translated (a value that maps onto our
settings: optim, eval_strategy, save_strategy, model_init_kwargs, ...), ignored (only HF Trainer internals
or a setting that matters only with another one that is refused: nothing a user observes changes), and
accepted at TRL's default only (anything else is refused). `TRL_VALUES` translates TRL-only values of
keys we share (max_steps=-1, save_total_limit=None, a fractional warmup_steps, output_dir=None).
docs/trl.md has the table.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Any, Callable

from .errors import ConfigError

logger = logging.getLogger(__name__)

KEEP_ALL = 2**31 - 1  # save_total_limit for TRL's None (keep every checkpoint)


@dataclass(frozen=True)
class TrlName:
    kind: str  # renamed | translated | ignored | default_only
    translate: Callable[[Any, Any], dict]
    note: str  # what it becomes, for the docs and messages
    key: str = ""  # renamed: our name for it


def plain(value: Any) -> Any:
    """A transformers enum (SchedulerType, OptimizerNames, IntervalStrategy, ...) as its string."""
    return value.value if isinstance(value, enum.Enum) else value


def _refuse(name: str, value: Any, instead: str) -> ConfigError:
    return ConfigError(f"TRL's {name}={plain(value)!r} is not built in lowmem-grpo; instead: {instead}")


def _renamed(key: str, note: str = "") -> TrlName:
    return TrlName("renamed", lambda v, cfg: {} if v is None else {key: plain(v)}, f"= {key}{note}", key)


def _ignored(why: str) -> TrlName:
    return TrlName("ignored", lambda v, cfg: {}, f"accepted, ignored: {why}")


def _default_only(name: str, accepted: tuple, instead: str) -> TrlName:
    def translate(value, cfg):
        if plain(value) in accepted or (isinstance(value, (list, dict, str)) and not value and "" in accepted):
            return {}
        raise _refuse(name, value, instead)
    return TrlName("default_only", translate, f"only {' / '.join(repr(a) for a in accepted if a != '')}: {instead}")


def _optim(value, cfg) -> dict:
    value = plain(value)
    for ours, names in OPTIMIZERS.items():
        if value in names:
            return {"optimizer": ours}
    raise _refuse("optim", value, "optimizer=adamw (torch AdamW: adamw_torch, adamw_torch_fused), adamw_8bit "
                                  "(adamw_bnb_8bit, adamw_8bit) or paged_adamw_8bit")


OPTIMIZERS = {"adamw": ("adamw_torch", "adamw_torch_fused", "adamw_hf"),
              "adamw_8bit": ("adamw_8bit", "adamw_bnb_8bit"), "paged_adamw_8bit": ("paged_adamw_8bit",)}


def _eval_strategy(value, cfg) -> dict:
    value = plain(value)
    if value == "no":
        return {"eval_steps": None}
    if value == "steps":  # TRL: eval_steps defaults to logging_steps
        return {} if cfg.eval.eval_steps else {"eval_steps": cfg.output.logging_steps}
    raise _refuse("eval_strategy", value, "evaluation runs every eval_steps optimizer steps: set eval_strategy='steps' "
                                          "with eval_steps=N, or 'no'")


def _save_strategy(value, cfg) -> dict:
    value = plain(value)
    if value == "steps":
        return {}
    if value == "no":
        logger.warning("save_strategy='no': lowmem-grpo still writes the final checkpoint (save_steps=0)")
        return {"save_steps": 0}
    raise _refuse("save_strategy", value, "checkpoints are written every save_steps optimizer steps: set "
                                          "save_strategy='steps' with save_steps=N, or 'no' (the final one only)")


def _logging_strategy(value, cfg) -> dict:
    if plain(value) == "steps":
        return {}
    raise _refuse("logging_strategy", value, "metrics are written every logging_steps optimizer steps: set "
                                             "logging_strategy='steps' with logging_steps=N")


def _resume(value, cfg) -> dict:
    if value is None or value is False:
        return {}
    return {"resume_from": "latest" if value is True else str(value)}


def _disable_tqdm(value, cfg) -> dict:
    return {} if value is None else {"progress_bar": not value}


def _log_completions(value, cfg) -> dict:
    return {} if value else {"num_completions_to_log": 0}


def _num_completions_to_print(value, cfg) -> dict:
    return {} if value is None else {"num_completions_to_log": value}


def _use_cpu(value, cfg) -> dict:
    return {"device": "cpu"} if value else {}


def _checkpointing_kwargs(name: str) -> TrlName:
    def translate(value, cfg):
        if value is None or value == {"use_reentrant": False}:
            return {}
        raise _refuse(name, value, "lowmem-grpo checkpoints with use_reentrant=False and takes no other arguments; "
                                   "drop it (or give {'use_reentrant': False})")
    return TrlName("default_only", translate, "only None / {'use_reentrant': False} (what lowmem-grpo uses)")


MODEL_INIT_KEYS = {"attn_implementation": "attn_implementation", "trust_remote_code": "trust_remote_code"}
FLOAT32 = (None, "auto", "float32", "fp32")


def _model_init_kwargs(value, cfg) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"model_init_kwargs must be a dict, got {value!r}")
    out = {}
    for key, v in value.items():
        if key in MODEL_INIT_KEYS:
            out[MODEL_INIT_KEYS[key]] = v
        elif key in ("dtype", "torch_dtype"):
            name = str(v).replace("torch.", "") if v is not None else None
            if name not in FLOAT32:
                raise _refuse(f"model_init_kwargs[{key!r}]", v, "lowmem-grpo loads the weights in the dtype of "
                                                               "model.precision: precision=fp32 (float32) or bf16_sr "
                                                               "(bfloat16 weights, stochastically rounded updates)")
        else:
            raise _refuse(f"model_init_kwargs[{key!r}]", v, "only attn_implementation, trust_remote_code and dtype "
                                                           "(float32 / auto) are taken; the model loads on the CPU "
                                                           "and training moves it (no device_map, no quantisation)")
    return out


def _nothing(value, cfg) -> dict:
    return {}


TRL_NAMES: dict[str, TrlName] = {
    # renamed: the same setting
    "shuffle_dataset": _renamed("shuffle"),
    "per_device_eval_batch_size": _renamed("eval_batch_size", " (prompts per greedy generate() call in evaluation)"),
    "activation_checkpointing": _renamed("gradient_checkpointing"),
    "vllm_importance_sampling_cap": TrlName("renamed", lambda v, cfg: {} if v is None else
                                            {"vllm_importance_sampling_clip_max": v},
                                            "= vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_max"),
    # translated
    "optim": TrlName("translated", _optim, "adamw_torch(_fused) -> adamw, adamw_bnb_8bit / adamw_8bit -> adamw_8bit, "
                                           "paged_adamw_8bit; others refused"),
    "eval_strategy": TrlName("translated", _eval_strategy, "'steps' (eval_steps, default logging_steps) or 'no'"),
    "save_strategy": TrlName("translated", _save_strategy, "'steps' or 'no' (save_steps=0: the final checkpoint "
                                                           "only)"),
    "logging_strategy": TrlName("translated", _logging_strategy, "'steps' only"),
    "resume_from_checkpoint": TrlName("translated", _resume, "= resume_from (True: 'latest')"),
    "disable_tqdm": TrlName("translated", _disable_tqdm, "= not progress_bar"),
    "log_completions": TrlName("translated", _log_completions, "False: num_completions_to_log=0 (completions.jsonl)"),
    "num_completions_to_print": TrlName("translated", _num_completions_to_print, "= num_completions_to_log "
                                                                                 "(written to completions.jsonl)"),
    "use_cpu": TrlName("translated", _use_cpu, "True: device=cpu"),
    "model_init_kwargs": TrlName("translated", _model_init_kwargs, "attn_implementation, trust_remote_code; dtype "
                                                                   "float32 / auto only (see model.precision)"),
    "gradient_checkpointing_kwargs": _checkpointing_kwargs("gradient_checkpointing_kwargs"),
    "activation_checkpointing_kwargs": _checkpointing_kwargs("activation_checkpointing_kwargs"),
    "use_liger_kernel": TrlName("translated", _nothing, "accepted: the loss head is always fused (lowmem-grpo's own "
                                                        "kernels)"),
    "include_num_input_tokens_seen": TrlName("translated", _nothing, "accepted: num_tokens is always logged"),
    "log_on_each_node": TrlName("translated", _nothing, "accepted: rank 0 alone logs"),
    "log_multimodal": TrlName("translated", _nothing, "accepted: text models only, nothing multimodal to log"),
    # ignored: HF Trainer internals, or settings that only act with another one that is refused
    "do_train": _ignored("not read by HF's Trainer either"),
    "do_eval": _ignored("not read by HF's Trainer either"),
    "do_predict": _ignored("not read by HF's Trainer either"),
    "local_rank": _ignored("torchrun's LOCAL_RANK is read from the environment"),
    "dataloader_num_workers": _ignored("no DataLoader: prompts are drawn in the process"),
    "dataloader_pin_memory": _ignored("no DataLoader"),
    "dataloader_persistent_workers": _ignored("no DataLoader"),
    "dataloader_prefetch_factor": _ignored("no DataLoader"),
    "dataloader_multiprocessing_context": _ignored("no DataLoader"),
    "dataloader_in_order": _ignored("no DataLoader"),
    "skip_memory_metrics": _ignored("HF's memory tracker is not used"),
    "torch_empty_cache_steps": _ignored("an allocator hint: speed and fragmentation only"),
    "use_cache": _ignored("training forwards run without a KV cache, the rollout with one, as in TRL"),
    "cache_implementation": _ignored("the rollout has its own KV cache (fast_rollout, compile_decode)"),
    "pad_to_multiple_of": _ignored("padding only: no value changes a log-prob"),
    "ds3_gather_for_generation": _ignored("DeepSpeed ZeRO-3 only (deepspeed is refused)"),
    "ddp_find_unused_parameters": _ignored("DDP bookkeeping, speed only"),
    "ddp_bucket_cap_mb": _ignored("DDP bucket size, speed only"),
    "ddp_broadcast_buffers": _ignored("DDP buffer sync: the models trained have no buffers that change"),
    "ddp_static_graph": _ignored("DDP bookkeeping, speed only"),
    "eval_do_concat_batches": _ignored("prediction-loop internals: GRPO evaluation generates"),
    "eval_use_gather_object": _ignored("prediction-loop internals"),
    "length_column_name": _ignored("only with group_by_length, which GRPO does not use"),
    "liger_kernel_config": _ignored("only with use_liger_kernel"),
    "metric_for_best_model": _ignored("only with load_best_model_at_end=True (refused)"),
    "greater_is_better": _ignored("only with load_best_model_at_end=True (refused)"),
    "hub_token": _ignored("only with push_to_hub=True (refused)"),
    "hub_private_repo": _ignored("only with push_to_hub=True (refused)"),
    "hub_model_id": _ignored("only with push_to_hub=True (refused)"),
    "hub_strategy": _ignored("only with push_to_hub=True (refused)"),
    "hub_always_push": _ignored("only with push_to_hub=True (refused)"),
    "hub_revision": _ignored("only with push_to_hub=True (refused)"),
    "vllm_server_base_url": _ignored("only with vllm_mode=server (refused)"),
    "vllm_server_host": _ignored("only with vllm_mode=server (refused)"),
    "vllm_server_port": _ignored("only with vllm_mode=server (refused)"),
    "vllm_server_timeout": _ignored("only with vllm_mode=server (refused)"),
    "vllm_group_port": _ignored("only with vllm_mode=server (refused)"),
    "ref_model_mixup_alpha": _ignored("only with sync_ref_model=True (refused)"),
    "ref_model_sync_steps": _ignored("only with sync_ref_model=True (refused)"),
    "entropy_coef_min": _ignored("only with use_adaptive_entropy=True (refused)"),
    "entropy_coef_max": _ignored("only with use_adaptive_entropy=True (refused)"),
    "entropy_coef_delta": _ignored("only with use_adaptive_entropy=True (refused)"),
    "entropy_target": _ignored("only with use_adaptive_entropy=True (refused)"),
    "transformers_continuous_batching_config": _ignored("only with use_transformers_continuous_batching=True "
                                                        "(refused)"),
}

_DEFAULT_ONLY = {  # name: (the values accepted: TRL's default and its equivalents, what to use instead)
    "optim_args": (("", None), "optimizer settings are learning_rate, weight_decay, adam_beta1/2, adam_epsilon"),
    "optim_target_modules": (("", None), "every parameter is trained (full-parameter GRPO)"),
    "average_tokens_across_devices": ((True,), "loss denominators count every rank's tokens, as TRL's default"),
    "label_smoothing_factor": ((0, 0.0), "GRPO has no labels to smooth"),
    "fp16": ((False,), "fp16 autocast is not built: bf16=true (bf16 autocast) or precision=bf16_sr"),
    "bf16_full_eval": ((False,), "evaluation runs in the training precision (bf16 sets autocast for both)"),
    "fp16_full_eval": ((False,), "evaluation runs in the training precision"),
    "tf32": ((None, False), "TF32 matmuls are not switched on; bf16=true for faster matmuls"),
    "neftune_noise_alpha": ((None,), "no embedding noise is built"),
    "auto_find_batch_size": ((False,), "run `lowmem-grpo plan` (or `lowmem-grpo fit`) for the batch sizes that fit"),
    "logging_first_step": ((False,), "logging_steps=1 logs every step, the first included"),
    "logging_nan_inf_filter": ((True,), "a non-finite step is skipped and logged as such (max_nonfinite_steps)"),
    "log_level": (("passive",), "set logging.getLogger('lowmem_grpo').setLevel(...)"),
    "log_level_replica": (("warning", "passive"), "other ranks log nothing"),
    "trackio_space_id": ((None, ""), "trackio logs locally; deploy it yourself"),
    "trackio_bucket_id": ((None, ""), "trackio logs locally"),
    "trackio_static_space_id": ((None, False, ""), "trackio logs locally"),
    "eval_delay": ((0, 0.0), "eval_steps counts from the first step"),
    "prediction_loss_only": ((False,), "GRPO evaluation reports rewards of greedy completions, not a loss"),
    "eval_accumulation_steps": ((None,), "evaluation writes its results per batch"),
    "include_for_metrics": (("",), "evaluation reports rewards only"),
    "batch_eval_metrics": ((False,), "evaluation reports rewards only"),
    "num_generations_eval": ((None,), "evaluation is greedy: one completion per prompt"),
    "save_only_model": ((False,), "checkpoints hold the optimizer state for resume; trainer.save_model() writes the "
                                  "weights alone"),
    "save_on_each_node": ((False,), "rank 0 writes the checkpoints to output_dir (a shared file system)"),
    "enable_jit_checkpoint": ((False,), "a run stopped by SIGTERM / Ctrl-C saves a checkpoint already"),
    "push_to_hub": ((False,), "trainer.save_model(folder), then upload the folder with huggingface_hub"),
    "load_best_model_at_end": ((False,), "the final weights are kept; evaluations are in metrics.jsonl"),
    "ignore_data_skip": ((False,), "a resumed run continues the saved prompt order"),
    "restore_callback_states_from_checkpoint": ((False,), "callbacks are not saved"),
    "full_determinism": ((False,), "seed seeds data order, sampling and initial weights; no deterministic "
                                   "algorithms switch"),
    "data_seed": ((None,), "seed also seeds the data order"),
    "accelerator_config": ((None,), "there is no accelerate; torchrun with strategy=ddp|fsdp"),
    "parallelism_config": ((None,), "torchrun with strategy=ddp|fsdp"),
    "dataloader_drop_last": ((False,), "prompts are drawn by generation batches, every one used"),
    "remove_unused_columns": ((False, None), "every extra column reaches the reward functions, as TRL's GRPO"),
    "label_names": ((None,), "GRPO has no labels"),
    "train_sampling_strategy": (("random",), "shuffle=false keeps the file order"),
    "ddp_backend": ((None, ""), "nccl on CUDA, gloo on the CPU, picked by the device"),
    "fsdp": ((None, "", False), "strategy=fsdp under torchrun (FSDP2)"),
    "fsdp_config": ((None,), "strategy=fsdp under torchrun (FSDP2) takes no options"),
    "deepspeed": ((None,), "offload_optimizer=true (states in host RAM) or strategy=fsdp under torchrun"),
    "debug": (("",), "no debug modes"),
    "router_aux_loss_coef": ((None,), "the trainer adds no MoE router loss; lowmem_grpo.integrations.trl."
                                      "GRPOTrainer (TRL's trainer with the fused head) does"),
    "cast_lm_head_to_fp32": ((False,), "with precision=fp32 and bf16=false the head runs in fp32"),
    "generation_kwargs": ((None,), "temperature, top_p, top_k, min_p, repetition_penalty"),
    "chat_template_kwargs": ((None,), "system_prompt and chat_template"),
    "vllm_model_impl": (("vllm",), "vLLM's own model implementation is used"),
    "vllm_structured_outputs_regex": ((None,), "no structured outputs"),
    "vllm_tensor_parallel_size": ((1,), "vLLM runs in the trainer's process on its one device"),
    "multi_objective_aggregation": (("sum_then_normalize",), "rewards are weighted and summed, then normalised "
                                                              "(reward_weights, scale_rewards)"),
    "sync_ref_model": ((False,), "the reference stays the model as loaded; beta=0 drops it"),
    "entropy_coef": ((0, 0.0), "no entropy bonus; top_entropy_quantile keeps the high-entropy tokens"),
    "use_adaptive_entropy": ((False,), "no entropy bonus"),
    "max_tool_calling_iterations": ((None,), "no tool calling"),
    "off_policy_mask_threshold": ((None,), "vllm_importance_sampling_mode / _clip_min / _clip_max"),
    "log_unique_prompts": ((False,), "completions.jsonl has each logged completion with its prompt"),
    "log_completions_hub_repo": ((None,), "completions are written to completions.jsonl in output_dir"),
    "use_transformers_continuous_batching": ((False,), "fast_rollout (the default) refills finished rows"),
    "use_transformers_paged": ((False,), "fast_rollout (the default)"),
}
TRL_NAMES.update({name: _default_only(name, accepted, instead)
                  for name, (accepted, instead) in _DEFAULT_ONLY.items()})


def _max_steps(value, cfg) -> dict:
    if value == -1:  # TRL's default: train num_train_epochs epochs (default 3.0)
        return {"num_train_epochs": cfg.train.num_train_epochs or 3.0}
    return {"max_steps": value, "num_train_epochs": None}  # TRL: max_steps > 0 overrides num_train_epochs


def _save_total_limit(value, cfg) -> dict:
    return {"save_total_limit": KEEP_ALL if value is None else value}


def _warmup_steps(value, cfg) -> dict:
    if isinstance(value, float) and 0 < value < 1:  # transformers 5: a fraction of the steps
        return {"warmup_ratio": value, "warmup_steps": 0}
    return {"warmup_steps": value}


def _output_dir(value, cfg) -> dict:
    return {"output_dir": "trainer_output" if value is None else value}  # TRL's default folder for None


# TRL-only values of keys lowmem-grpo shares (key -> translate(value, cfg) -> settings).
TRL_VALUES: dict[str, Callable[[Any, Any], dict]] = {
    "max_steps": _max_steps, "save_total_limit": _save_total_limit, "warmup_steps": _warmup_steps,
    "output_dir": _output_dir,
}


def trl_settings(name: str, value: Any, cfg) -> dict:
    """The lowmem-grpo settings TRL's `name=value` stands for ({}: accepted, nothing to set); ConfigError (what
    to use instead) where it has no counterpart. `name` must be in TRL_NAMES or TRL_VALUES."""
    if name in TRL_VALUES:
        return TRL_VALUES[name](plain(value), cfg)
    return TRL_NAMES[name].translate(value, cfg)


def order(names) -> list:
    """Apply num_train_epochs before max_steps (a positive max_steps overrides it, TRL's rule) and TRL's names
    after lowmem-grpo's (eval_strategy='steps' reads eval_steps and logging_steps)."""
    rank = {"num_train_epochs": 0, "max_steps": 1}
    return sorted(names, key=lambda n: (str(n) in TRL_NAMES, rank.get(str(n), 1)))
