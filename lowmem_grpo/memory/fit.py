"""Whether a run fits the card it is about to run on: read before any weight is loaded.

`check_run` (called by `lowmem-grpo train` on a CUDA device, and `lowmem-grpo plan` on a GPU machine)
reads what the card has free (`torch.cuda.mem_get_info`) and refuses a run whose predicted peak plus the
margin exceeds it, naming the cheapest change that fits; only the model's config is read, so the refusal
comes before any download. `train.memory_check=false` starts anyway; the Python API does not check.
`use_expandable_segments` sets PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before CUDA starts.

Design notes: docs/planner.md ("Fit")
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Optional

import torch

from ..config import Config, ConfigError
from .plan import GiB, Arch, margin_bytes, plan
from .reward_plan import reward_archs
from .suggest import suggestions

logger = logging.getLogger(__name__)

EXPANDABLE_SEGMENTS = "expandable_segments:True"
# The allocator's settings: PYTORCH_ALLOC_CONF is the newer, device-generic name (torch >= 2.9); a user
# who set either chose the allocator's settings, and we leave them as they are.
ALLOC_CONF_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def use_expandable_segments(environ=None) -> bool:
    """Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True unless the user set the allocator's settings
    (either variable) or CUDA already started in this process (too late: the allocator read them).
    Nothing on a machine without CUDA. Returns whether it set it."""
    environ = os.environ if environ is None else environ
    if any(name in environ for name in ALLOC_CONF_VARIABLES) or not torch.cuda.is_available():
        return False  # (is_available counts devices; it does not start CUDA)
    if torch.cuda.is_initialized():
        logger.info("CUDA started before lowmem-grpo could set PYTORCH_CUDA_ALLOC_CONF=%s; the allocator keeps "
                    "its fixed segments (set the variable before starting Python to get growing ones)",
                    EXPANDABLE_SEGMENTS)
        return False
    environ["PYTORCH_CUDA_ALLOC_CONF"] = EXPANDABLE_SEGMENTS
    return True


def device_free_bytes(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of a CUDA device, as the driver counts them now."""
    free, total = torch.cuda.mem_get_info(device)
    return int(free), int(total)


def run_architecture(cfg: Config, model=None) -> Arch:
    """The shapes of the model a run trains, without its weights: a model object's config, the recipe's
    model.config, or the config.json of model.name_or_path (a folder, a hub id: the one small file)."""
    if model is not None:
        return Arch.from_config(model.config)
    m = cfg.model
    if m.config is not None:
        return Arch.from_config(dict(m.config))
    from transformers import AutoConfig

    from ..policy.model import materialize_model_source
    return Arch.from_config(AutoConfig.from_pretrained(materialize_model_source(m),
                                                       trust_remote_code=m.trust_remote_code))


@dataclass
class Fit:
    """A run's predicted need against a card's free memory."""

    peak_bytes: int  # the allocator's peak (plan.py)
    margin_bytes: int  # CUDA context, workspaces and fragmentation (plan.margin_bytes)
    free_bytes: int  # what the card has free now
    total_bytes: int  # the card's memory
    peak_phase: str
    vllm_problem: Optional[str] = None  # why vLLM would not start in its share (vllm_plan.share_problem)

    @property
    def needed_bytes(self) -> int:
        return self.peak_bytes + self.margin_bytes

    @property
    def fits(self) -> bool:
        return self.needed_bytes <= self.free_bytes


def predicted_fit(cfg: Config, arch: Arch, device: torch.device, autocast: Optional[bool] = None, nproc: int = 1,
                  nnodes: int = 1) -> Fit:
    """The run's predicted peak (one rank's, under torchrun) against what `device` has free; vLLM's share
    (generation.engine=vllm) is taken of the card's whole memory, as vLLM takes it."""
    from .parallel_plan import per_rank
    free, total = device_free_bytes(device)
    result = per_rank(plan(cfg, arch, autocast=autocast, card_bytes=total), cfg, arch, nproc, cfg.train.strategy,
                      nnodes)
    return Fit(result.peak_bytes, margin_bytes(result.peak_bytes), free, total, result.peak_phase,
               (result.vllm or {}).get("problem"))


def cheapest_fix(cfg: Config, arch: Arch, budget: int, nproc: int = 1, autocast: Optional[bool] = None,
                 card_bytes: Optional[int] = None) -> str:
    """The first change (cheapest first, suggest.SUGGESTIONS) that brings the run under `budget`, else the
    combination, else what is left to do."""
    if nproc > 1:
        return (f"`lowmem-grpo plan RECIPE --nproc {nproc}` shows each phase; lower per_device_train_batch_size, "
                "generation_micro_batch_size or eval_batch_size, or use strategy=fsdp")
    ideas = suggestions(cfg, arch, budget, autocast, card_bytes)
    fitting = [s for s in ideas if s.fits and not s.combined] or [s for s in ideas if s.fits]
    if not fitting:
        return "none of the planner's changes is enough: a card with more free memory (close what else uses it)"
    best = fitting[0]
    return f"{best.change} ({best.total_bytes / GiB:.2f} GiB with the margin)"


def check_run(cfg: Config) -> Optional[Fit]:
    """`lowmem-grpo train`'s check, before the trainer loads anything: the device the trainer will pick
    (train.device; cuda:LOCAL_RANK under torchrun), and this rank's share of the run. None where there is
    nothing to check (the CPU, no CUDA, train.memory_check=false); ConfigError where it does not fit."""
    from ..policy.model import bf16_autocast_wanted
    from ..training.distributed import torchrun_env
    name = cfg.train.device
    if not cfg.train.memory_check or name == "cpu" or not torch.cuda.is_available():
        return None  # (train.device=cuda without CUDA: the trainer says so)
    env = torchrun_env()
    if env is not None:
        rank, size, local_rank = env
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
    else:
        size = 1
        device = torch.device(name if name not in ("auto", "cuda") else "cuda")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.index >= torch.cuda.device_count():
            return None  # the trainer names the devices there are
    local = int(os.environ.get("LOCAL_WORLD_SIZE", size))  # torchrun: the ranks of one node
    autocast = bf16_autocast_wanted(cfg.model.bf16, device)
    arch = run_architecture(cfg)
    if size == 1:
        place_reward_models(cfg, arch, device, autocast)
    return check_device_memory(cfg, arch, device, autocast, nproc=size, nnodes=max(size // max(local, 1), 1))


def place_reward_models(cfg: Config, arch: Arch, device: torch.device, autocast: Optional[bool] = None) -> None:
    """rewards.model_placement=auto on a GPU, decided by the plan: gpu where the run fits what `device` has
    free with the reward models' weights on it, else stream. Writes the choice into `cfg` (logged)."""
    if cfg.rewards.model_placement != "auto" or not reward_archs(cfg):
        return
    on_device = plan(cfg, arch, autocast=autocast, reward_placement="gpu").peak_bytes
    free, _ = device_free_bytes(device)
    fits = on_device + margin_bytes(on_device) <= free
    cfg.rewards.model_placement = "gpu" if fits else "stream"
    logger.info(f"reward models: {cfg.rewards.model_placement} (on the GPU the run would need "
                f"{(on_device + margin_bytes(on_device)) / GiB:.2f} GiB with the margin; {free / GiB:.2f} GiB free)")


def check_device_memory(cfg: Config, arch: Arch, device: torch.device, autocast: Optional[bool] = None,
                        nproc: int = 1, nnodes: int = 1) -> Fit:
    """Raise ConfigError, naming the cheapest fix, when the run's predicted peak + margin exceeds what
    `device` has free; otherwise return the numbers (logged)."""
    fit = predicted_fit(cfg, arch, device, autocast, nproc, nnodes)
    where = f"{device} ({torch.cuda.get_device_name(device)})"
    if fit.vllm_problem:
        raise ConfigError(f"vLLM would not start on {where}: {fit.vllm_problem}")
    if not fit.fits:
        raise ConfigError(
            f"this run needs {fit.needed_bytes / GiB:.2f} GiB on the GPU (predicted peak {fit.peak_bytes / GiB:.2f} "
            f"GiB in {fit.peak_phase} + margin {fit.margin_bytes / GiB:.2f} GiB) but {where} has "
            f"{fit.free_bytes / GiB:.2f} of {fit.total_bytes / GiB:.2f} GiB free; cheapest fix: "
            f"{cheapest_fix(cfg, arch, fit.free_bytes, nproc, autocast, fit.total_bytes)}. "
            "`lowmem-grpo plan RECIPE` shows every phase; "
            "train.memory_check=false starts anyway")
    logger.info(f"memory check: predicted {fit.needed_bytes / GiB:.2f} GiB with the margin ({fit.peak_phase} peak); "
                f"{where} has {fit.free_bytes / GiB:.2f} of {fit.total_bytes / GiB:.2f} GiB free")
    return fit
