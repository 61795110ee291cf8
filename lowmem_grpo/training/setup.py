"""The trainer's set-up, one function per concern, in the order `Trainer.__init__` calls them:

    setup_world -> setup_output -> pick_device, seed_everything -> setup_precision -> (tokenizer)
    -> setup_rewards -> setup_model -> special_ids -> setup_data            evaluation stops here
    -> setup_reference -> setup_training_model -> setup_loss -> setup_optimizer -> (step mode, resume)

Each takes its own config section and the live objects it needs (a loaded model, rows, reward callables
are arguments, never names in the config) and returns what it builds; a function's contract says which
earlier step it needs. Objects built once and shared: the policy's one `Head` (the loss, the old
log-prob pass and the step mode use the same object).

Design notes: docs/training.md
"""

from __future__ import annotations

import copy
import logging
import random
from pathlib import Path
from typing import Any, NamedTuple, Optional

import numpy as np
import torch

from ..config import Config, ConfigError
from ..config.batching import BatchPlan, steps_for_epochs
from ..config.schema import DataConfig, GenerationConfig, ModelConfig, OptimConfig, OutputConfig, RewardsConfig
from ..config.schema import TrainConfig
from ..optim.optimizers import build_optimizer, build_scheduler
from ..policy.layer_major import decoder_layers
from ..policy.limits import check_run_limits
from ..policy.model import Head, bf16_autocast_wanted, build_head, check_bf16_weights, enable_checkpointing
from ..policy.model import load_model
from ..policy.packing import Packing
from ..policy.reference import Reference
from ..policy.streaming import host_table, move_all_but
from ..rewards import ModelSettings, load_reward_functions
from ..rewards.timeout import with_timeout
from . import checkpoint as ckpt
from . import distributed, output_dir
from .data import PromptSampler, PromptSet, build_prompt_set, load_rows, split_eval
from .loss import PolicyLoss

logger = logging.getLogger(__name__)

# What rows given as objects are called in error messages (TRL's argument names).
TRAIN_ROWS_NAME, EVAL_ROWS_NAME = "train_dataset", "eval_dataset"


class OutputClaim(NamedTuple):
    lock: Optional[output_dir.OutputLock]  # output_dir locked for this run (rank 0 of a training run), else None
    resume: Optional[Path]  # the verified checkpoint to continue from (train.resume_from), else None


class Data(NamedTuple):
    train: PromptSet
    eval: Optional[PromptSet]  # held-out prompts (data.eval_file or data.eval_holdout), None: no evaluation
    sampler: PromptSampler  # the resumable order the training prompts are drawn in
    max_steps: int  # train.max_steps, or the steps num_train_epochs makes of these prompts


class TrainingModel(NamedTuple):
    head: Head  # the policy's one loss head (decoder + output embedding)
    pack: Packing  # shared-prompt packing in the loss and log-prob passes


class LossParts(NamedTuple):
    module: torch.nn.Module  # PolicyLoss, or its DDP/FSDP2 wrapper under torchrun
    shards: Optional[distributed.LocalShards]  # FSDP2: the local shards the optimizer steps, else None


class OptimizerParts(NamedTuple):
    optimizer: torch.optim.Optimizer
    scheduler: Any  # the learning-rate schedule over max_steps (torch LRScheduler)


def setup_world(cfg: Config, training: bool) -> tuple[distributed.World, Optional[str]]:
    """Under torchrun (training only) join the process group; the world and the device name this rank
    must use (None: the config's). Refuses memory modes the strategy cannot run. First of all steps."""
    t = cfg.train
    world, rank_device = (distributed.start(t.strategy, t.device, t.ddp_timeout) if training
                          else (distributed.World(), None))
    distributed.check_supported(cfg, world)
    return world, rank_device


def setup_output(out: OutputConfig, world: distributed.World, training: bool, check_previous: bool) -> OutputClaim:
    """Training only: check and lock output_dir (output_dir.py: OutputDirError for another run's folder, a
    live run's, or one it cannot write; `check_previous` False leaves another run's folder to a later
    check) and verify resume_from's checkpoint. Before anything loads; a failed verification releases
    the lock it took."""
    if not training:
        return OutputClaim(None, None)
    lock = output_dir.claim(out, world, check_previous)
    try:
        resume = ckpt.resolve_resume(out.resume_from, out.output_dir) if out.resume_from else None
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return OutputClaim(lock, resume)


def pick_device(name: str) -> torch.device:
    """The training device. A CUDA device also becomes the current one: Triton kernels, bitsandbytes
    and the side streams of the memory modes run on the current device, not on their tensors'."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"train.device={name} but this torch build sees no CUDA GPU; set train.device=cpu")
        index = torch.cuda.current_device() if device.index is None else device.index
        if index >= torch.cuda.device_count():
            raise RuntimeError(f"train.device={name} but this machine has {torch.cuda.device_count()} CUDA "
                               f"device(s); use cuda:0 .. cuda:{torch.cuda.device_count() - 1}")
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
    return device


def seed_everything(seed: int) -> None:
    """Python's, NumPy's and torch's global generators, from one seed."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def setup_precision(m: ModelConfig, device: torch.device) -> bool:
    """Whether the forwards run under bf16 autocast (model.bf16); refuses model.precision=bf16_sr on a
    device without native bf16."""
    autocast = bf16_autocast_wanted(m.bf16, device)
    if m.precision == "bf16_sr":
        check_bf16_weights(device)
    return autocast


def reward_model_placement(setting: str, device: torch.device) -> str:
    """Where reward models run: the setting, or for auto, cpu on a CPU run and stream on a GPU (`lowmem-grpo
    train` resolves auto before this, to gpu where the planner finds room: memory/fit.py)."""
    if setting != "auto":
        return setting
    return "cpu" if device.type == "cpu" else "stream"


def setup_rewards(r: RewardsConfig, device: torch.device, batch_size: int, *, funcs: Optional[list] = None,
                  processing_classes: Optional[list] = None, base_dir: Optional[str | Path] = None) -> list:
    """The reward functions, each with its weight and rewards.reward_timeout. `funcs` (callables, loaded
    reward models, or what a recipe names) and `processing_classes` replace the config's when given;
    `base_dir` (the recipe's folder) resolves file paths; `batch_size` is the reward models' batch when
    rewards.model_batch_size is unset. After the seed, so what loading draws from the generators is the
    same in every run."""
    models = ModelSettings(reward_model_placement(r.model_placement, device), device, r.model_batch_size or batch_size,
                           r.model_dtype, r.reward_processing_classes if processing_classes is None
                           else processing_classes)
    return with_timeout(load_reward_functions(r.reward_funcs if funcs is None else funcs, r.reward_weights,
                                              base_dir=base_dir, models=models), r.reward_timeout)


def setup_model(m: ModelConfig, g: GenerationConfig, tokenizer, seed: int, model: Optional[torch.nn.Module] = None
                ) -> torch.nn.Module:
    """The policy on the CPU in its weight dtype: `model` if given (as lowmem_grpo.api prepares it), else
    loaded as model.* says (`seed` makes a random-weights model's initial weights). The model's limits
    (positions, vocabulary) are checked against the tokenizer and generation's lengths before any
    weights load."""
    check_run_limits(m, g, tokenizer, model)
    return load_model(m, seed) if model is None else model


def special_ids(m: ModelConfig, tokenizer, policy: torch.nn.Module) -> tuple[list[int], int]:
    """(every token id that ends a completion, the pad id): model.eos_token_id / pad_token_id, else the
    tokenizer's, else the model's generation config's. ConfigError when there is no EOS id at all."""
    gen = policy.generation_config
    eos = m.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id if tokenizer is not None else gen.eos_token_id
    if eos is None:
        raise ConfigError("no EOS token id: set model.eos_token_id")
    eos_ids = list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]
    if tokenizer is not None and tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos_ids:
        eos_ids.append(tokenizer.eos_token_id)
    pad = m.pad_token_id
    if pad is None:
        pad = tokenizer.pad_token_id if tokenizer is not None else gen.pad_token_id
    return eos_ids, int(eos_ids[0] if pad is None else pad)


def setup_data(d: DataConfig, t: TrainConfig, max_prompt_length: int, plan: BatchPlan, tokenizer, vocab_size: int,
               *, train_rows=None, eval_rows=None, recipe_dir: Optional[Path] = None) -> Data:
    """The training and held-out prompts, tokenized, and the order they are drawn in. `train_rows` /
    `eval_rows` (a datasets.Dataset or a list of dicts) replace data.train_file / data.eval_file and are
    named train_dataset / eval_dataset in errors; a file path is found as given, else beside the recipe
    (`recipe_dir`). With train.num_train_epochs the step count follows from the prompts (TRL's epochs).
    After the model: prompt token ids are checked against its vocabulary."""
    if train_rows is None and not d.train_file:
        raise ConfigError("data.train_file is not set: point it at a .jsonl/.json/.csv/.parquet file or a "
                          "datasets folder with a prompt (or prompt_ids) column (from Python: train_data=)")
    train_name = d.train_file if train_rows is None else TRAIN_ROWS_NAME
    rows = load_rows(_find(d.train_file, recipe_dir)) if train_rows is None else load_rows(train_rows, train_name)
    eval_name = EVAL_ROWS_NAME if eval_rows is not None else d.eval_file
    held_out = (load_rows(eval_rows, eval_name) if eval_rows is not None else
                load_rows(_find(d.eval_file, recipe_dir)) if d.eval_file else [])
    if not eval_name and d.eval_holdout:
        rows, held_out = split_eval(rows, d.eval_holdout)
    build = lambda r, src: build_prompt_set(r, tokenizer, d, max_prompt_length, src, vocab_size=vocab_size)
    train = build(rows, train_name)
    if train.num_truncated:
        logger.info(f"left-truncated {train.num_truncated} prompts to {max_prompt_length} tokens")
    if len(train) < plan.prompts_per_generation:
        logger.info(f"note: {len(train)} training prompts, fewer than the "
                    f"{plan.prompts_per_generation} per generation batch; prompts repeat within a batch")
    held_out_set = build(held_out, eval_name or train_name) if held_out else None
    max_steps = (t.max_steps if t.num_train_epochs is None
                 else steps_for_epochs(t.num_train_epochs, plan, len(train)))
    return Data(train, held_out_set, PromptSampler(len(train), t.seed, d.shuffle), max_steps)


def _find(path: str, recipe_dir: Optional[Path]) -> str:
    """A data path as given (relative to the working directory), else relative to the recipe's folder."""
    if Path(path).exists() or recipe_dir is None or Path(path).is_absolute():
        return path
    beside = recipe_dir / path
    return str(beside) if beside.exists() else path


def setup_reference(t: TrainConfig, policy: torch.nn.Module, device: torch.device,
                    world: distributed.World) -> Optional[Reference]:
    """With train.beta > 0 the reference: a frozen copy of the policy as loaded, kept in CPU RAM in the
    weight dtype (under torchrun one copy per node) and run on the CPU or streamed to `device`; None
    without a KL term. Before the policy moves to the device and before resumed weights load."""
    if t.beta <= 0:
        return None
    mode = t.reference_compute if t.reference_compute != "auto" else ("stream" if device.type == "cuda" else "cpu")
    reference = copy.deepcopy(policy)
    distributed.share_on_node(reference, world)  # torchrun: one copy per node, not one per rank
    return Reference(reference, device, mode)


def setup_training_model(m: ModelConfig, t: TrainConfig, g: GenerationConfig, policy: torch.nn.Module,
                         device: torch.device, resume: Optional[Path] = None, *,
                         checkpoint_layers: Optional[bool] = None, offload_weights: bool = False) -> TrainingModel:
    """Move the policy to `device` and make it ready to train: gradient checkpointing (`checkpoint_layers`,
    default model.gradient_checkpointing; off where the step recomputes the layers itself), no KV cache in
    training forwards, its one loss head, the packing mode; then the resumed checkpoint's weights (whole,
    before FSDP2 shards them; the rest of its state loads after the optimizer exists). With `offload_weights`
    (model.offload_weights) the decoder layers' weights and an untied input embedding's table stay in host RAM
    (the optimizer takes them over)."""
    if offload_weights:
        table = host_table(policy)
        move_all_but(policy, [decoder_layers(build_head(policy).decoder).layers, *([table] if table else [])],
                     device)
    else:
        policy.to(device)
    if m.gradient_checkpointing if checkpoint_layers is None else checkpoint_layers:
        enable_checkpointing(policy)
    policy.config.use_cache = False  # training forwards never need the KV cache
    head = build_head(policy)
    pack = Packing.resolve(t.pack_prompts, policy, max_length=g.max_prompt_length + g.max_completion_length)
    if resume is not None:
        ckpt.load_weights(policy, resume)
    return TrainingModel(head, pack)


def setup_loss(cfg: Config, policy: torch.nn.Module, head: Head, pack: Packing, autocast: bool,
               world: distributed.World) -> LossParts:
    """The loss as a module on the policy's `head`, made data-parallel under torchrun: DDP, or FSDP2,
    which shards the weights here, so before the optimizer is built on them (it steps the local shards)."""
    loss = PolicyLoss(policy, cfg, autocast=autocast, pack=pack, world_size=world.size, head=head)
    module = distributed.wrap(loss, policy, world, autocast=autocast)
    return LossParts(module, distributed.LocalShards(policy) if world.fsdp else None)


def setup_optimizer(o: OptimConfig, model: torch.nn.Module, max_steps: int, *, stochastic_rounding: bool,
                    in_backward: bool) -> OptimizerParts:
    """The optimizer on `model`'s trainable parameters (under FSDP2 the LocalShards module: after
    setup_loss) and the learning-rate schedule over `max_steps` (after setup_data)."""
    optimizer = build_optimizer(model, o, stochastic_rounding=stochastic_rounding, in_backward=in_backward)
    return OptimizerParts(optimizer, build_scheduler(optimizer, o, max_steps))
