"""GRPOConfig's settings as dataclass fields. GENERATED from config/schema.py by
`make api-fields` (python -m lowmem_grpo.api.fields_source): do not edit; tests/test_api_config.py
checks that it is current.

`GRPOConfigFields` has one field per bare config key with the section's annotation and default (help
texts: config/schema.py, `help(GRPOConfig)`), TRL's renamed names as read-only properties, and, for
editors and type checkers, GRPOConfig's keyword signature. lowmem_grpo/api/config.py adds the
coercion, the checks and the conversions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Union


@dataclass(init=False, repr=False, eq=False)
class GRPOConfigFields:
    # [model]: config/schema.py, ModelConfig
    name_or_path: str = ''
    gguf_file: Optional[str] = None
    config: Optional[dict] = None
    tokenizer: Optional[str] = None
    eos_token_id: Optional[int] = None
    pad_token_id: Optional[int] = None
    gradient_checkpointing: bool = True
    precision: str = 'fp32'
    layers_per_checkpoint: int = 1
    offload_activations: bool = False
    offload_weights: bool = False
    bf16: Optional[bool] = None
    torch_compile: bool = False
    torch_compile_backend: Optional[str] = None
    torch_compile_mode: Optional[str] = None
    attn_implementation: str = 'sdpa'
    trust_remote_code: bool = False
    disable_dropout: bool = True
    cache_dir: str = '~/.cache/lowmem_grpo'
    # [data]: config/schema.py, DataConfig
    train_file: str = ''
    eval_file: Optional[str] = None
    eval_holdout: int = 0
    system_prompt: Optional[str] = None
    chat_template: bool = True
    prompt_truncation: str = 'error'
    shuffle: bool = True
    # [generation]: config/schema.py, GenerationConfig
    num_generations: int = 8
    max_prompt_length: int = 512
    max_completion_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: Optional[float] = None
    repetition_penalty: float = 1.0
    generation_micro_batch_size: int = 64
    fast_rollout: bool = True
    compile_decode: Union[bool, str] = 'auto'
    pack_decode_weights: Union[bool, str] = 'auto'
    rollout_quantization: str = 'none'
    engine: str = 'native'
    use_vllm: Optional[bool] = None
    vllm_mode: str = 'colocate'
    vllm_gpu_memory_utilization: float = 0.3
    vllm_max_model_length: Optional[int] = None
    vllm_enable_sleep_mode: bool = False
    vllm_cpu_kv_cache_gib: float = 1.0
    # [rewards]: config/schema.py, RewardsConfig
    reward_funcs: list = field(default_factory=list)
    reward_weights: Optional[list] = None
    reward_timeout: Optional[float] = None
    reward_processing_classes: Optional[list] = None
    model_placement: str = 'auto'
    model_batch_size: Optional[int] = None
    model_dtype: str = 'auto'
    # [train]: config/schema.py, TrainConfig
    max_steps: int = 100
    num_train_epochs: Optional[float] = None
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    layer_major_backward: Optional[bool] = None
    head_gradient_once_per_step: bool = False
    generation_batch_size: Optional[int] = None
    steps_per_generation: Optional[int] = None
    num_iterations: int = 1
    optimizer_in_backward: bool = False
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: Optional[float] = None
    loss_type: str = 'dapo'
    delta: Optional[float] = None
    top_entropy_quantile: float = 1.0
    use_bias_correction_kl: bool = True
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    vllm_importance_sampling_correction: Optional[bool] = None
    vllm_importance_sampling_mode: str = 'sequence_mask'
    vllm_importance_sampling_clip_max: Optional[float] = 3.0
    vllm_importance_sampling_clip_min: Optional[float] = None
    importance_sampling_level: str = 'token'
    scale_rewards: str = 'group'
    mask_truncated_completions: bool = False
    device: str = 'auto'
    strategy: str = 'ddp'
    ddp_timeout: int = 1800
    memory_check: bool = True
    seed: int = 42
    max_nonfinite_steps: int = 3
    reference_compute: str = 'auto'
    logprob_micro_batch_size: Optional[int] = None
    reference_stream_rows: Optional[int] = None
    pack_prompts: Optional[bool] = None
    skip_zero_advantage: bool = True
    # [optim]: config/schema.py, OptimConfig
    optimizer: str = 'adamw_8bit'
    learning_rate: float = 1e-06
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.99
    adam_epsilon: float = 1e-08
    max_grad_norm: Optional[float] = 1.0
    offload_optimizer: bool = False
    lr_scheduler_type: str = 'constant'
    lr_scheduler_kwargs: Optional[dict] = None
    warmup_steps: int = 0
    warmup_ratio: float = 0.0
    # [output]: config/schema.py, OutputConfig
    output_dir: str = 'runs/default'
    logging_steps: int = 1
    num_completions_to_log: int = 8
    save_steps: int = 50
    save_total_limit: int = 2
    resume_from: Optional[str] = None
    overwrite_output_dir: bool = False
    report_to: Optional[Union[str, list]] = 'none'
    run_name: Optional[str] = None
    project: Optional[str] = None
    progress_bar: bool = True
    # [eval]: config/schema.py, EvalConfig
    eval_on_start: bool = False
    eval_on_end: bool = False
    eval_max_samples: Optional[int] = None
    eval_batch_size: int = 64
    eval_steps: Optional[int] = None

    if TYPE_CHECKING:  # GRPOConfig(...) as editors see it; at run time it takes **settings
        def __init__(
            self,
            *,
            name_or_path: str = '',
            gguf_file: Optional[str] = None,
            config: Optional[dict] = None,
            tokenizer: Optional[str] = None,
            eos_token_id: Optional[int] = None,
            pad_token_id: Optional[int] = None,
            gradient_checkpointing: bool = True,
            precision: str = 'fp32',
            layers_per_checkpoint: int = 1,
            offload_activations: bool = False,
            offload_weights: bool = False,
            bf16: Optional[bool] = None,
            torch_compile: bool = False,
            torch_compile_backend: Optional[str] = None,
            torch_compile_mode: Optional[str] = None,
            attn_implementation: str = 'sdpa',
            trust_remote_code: bool = False,
            disable_dropout: bool = True,
            cache_dir: str = '~/.cache/lowmem_grpo',
            train_file: str = '',
            eval_file: Optional[str] = None,
            eval_holdout: int = 0,
            system_prompt: Optional[str] = None,
            chat_template: bool = True,
            prompt_truncation: str = 'error',
            shuffle: bool = True,
            num_generations: int = 8,
            max_prompt_length: int = 512,
            max_completion_length: int = 256,
            temperature: float = 1.0,
            top_p: float = 1.0,
            top_k: int = 0,
            min_p: Optional[float] = None,
            repetition_penalty: float = 1.0,
            generation_micro_batch_size: int = 64,
            fast_rollout: bool = True,
            compile_decode: Union[bool, str] = 'auto',
            pack_decode_weights: Union[bool, str] = 'auto',
            rollout_quantization: str = 'none',
            engine: str = 'native',
            use_vllm: Optional[bool] = None,
            vllm_mode: str = 'colocate',
            vllm_gpu_memory_utilization: float = 0.3,
            vllm_max_model_length: Optional[int] = None,
            vllm_enable_sleep_mode: bool = False,
            vllm_cpu_kv_cache_gib: float = 1.0,
            reward_funcs: list = [],
            reward_weights: Optional[list] = None,
            reward_timeout: Optional[float] = None,
            reward_processing_classes: Optional[list] = None,
            model_placement: str = 'auto',
            model_batch_size: Optional[int] = None,
            model_dtype: str = 'auto',
            max_steps: int = 100,
            num_train_epochs: Optional[float] = None,
            per_device_train_batch_size: int = 8,
            gradient_accumulation_steps: int = 1,
            layer_major_backward: Optional[bool] = None,
            head_gradient_once_per_step: bool = False,
            generation_batch_size: Optional[int] = None,
            steps_per_generation: Optional[int] = None,
            num_iterations: int = 1,
            optimizer_in_backward: bool = False,
            beta: float = 0.0,
            epsilon: float = 0.2,
            epsilon_high: Optional[float] = None,
            loss_type: str = 'dapo',
            delta: Optional[float] = None,
            top_entropy_quantile: float = 1.0,
            use_bias_correction_kl: bool = True,
            sapo_temperature_pos: float = 1.0,
            sapo_temperature_neg: float = 1.05,
            vespo_k_pos: float = 2.0,
            vespo_lambda_pos: float = 3.0,
            vespo_k_neg: float = 3.0,
            vespo_lambda_neg: float = 2.0,
            vllm_importance_sampling_correction: Optional[bool] = None,
            vllm_importance_sampling_mode: str = 'sequence_mask',
            vllm_importance_sampling_clip_max: Optional[float] = 3.0,
            vllm_importance_sampling_clip_min: Optional[float] = None,
            importance_sampling_level: str = 'token',
            scale_rewards: str = 'group',
            mask_truncated_completions: bool = False,
            device: str = 'auto',
            strategy: str = 'ddp',
            ddp_timeout: int = 1800,
            memory_check: bool = True,
            seed: int = 42,
            max_nonfinite_steps: int = 3,
            reference_compute: str = 'auto',
            logprob_micro_batch_size: Optional[int] = None,
            reference_stream_rows: Optional[int] = None,
            pack_prompts: Optional[bool] = None,
            skip_zero_advantage: bool = True,
            optimizer: str = 'adamw_8bit',
            learning_rate: float = 1e-06,
            weight_decay: float = 0.0,
            adam_beta1: float = 0.9,
            adam_beta2: float = 0.99,
            adam_epsilon: float = 1e-08,
            max_grad_norm: Optional[float] = 1.0,
            offload_optimizer: bool = False,
            lr_scheduler_type: str = 'constant',
            lr_scheduler_kwargs: Optional[dict] = None,
            warmup_steps: int = 0,
            warmup_ratio: float = 0.0,
            output_dir: str = 'runs/default',
            logging_steps: int = 1,
            num_completions_to_log: int = 8,
            save_steps: int = 50,
            save_total_limit: int = 2,
            resume_from: Optional[str] = None,
            overwrite_output_dir: bool = False,
            report_to: Optional[Union[str, list]] = 'none',
            run_name: Optional[str] = None,
            project: Optional[str] = None,
            progress_bar: bool = True,
            eval_on_start: bool = False,
            eval_on_end: bool = False,
            eval_max_samples: Optional[int] = None,
            eval_batch_size: int = 64,
            eval_steps: Optional[int] = None,
            **trl_names: Any,
        ) -> None: ...

    @property
    def shuffle_dataset(self) -> bool:
        """TRL's name for shuffle (setting it sets shuffle)."""
        return self.shuffle

    @property
    def per_device_eval_batch_size(self) -> int:
        """TRL's name for eval_batch_size (setting it sets eval_batch_size)."""
        return self.eval_batch_size

    @property
    def activation_checkpointing(self) -> bool:
        """TRL's name for gradient_checkpointing (setting it sets gradient_checkpointing)."""
        return self.gradient_checkpointing

    @property
    def vllm_importance_sampling_cap(self) -> Optional[float]:
        """TRL's name for vllm_importance_sampling_clip_max (setting it sets vllm_importance_sampling_clip_max)."""
        return self.vllm_importance_sampling_clip_max
