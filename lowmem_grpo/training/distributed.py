"""Several processes under torchrun: data-parallel GRPO on torch.distributed (NCCL on GPUs, gloo on CPUs).

`World` is who this process is (rank, world size, strategy) and the collectives the loop uses: `sum`,
`any`, `gather_rows`, `rows_of_rank`, `gather_objects`, `barrier`. With one process every collective
is the identity, so the trainer has one code path. `wrap` makes the loss module data-parallel (DDP or
FSDP2), `full_weights` gathers FSDP2's shards for rollouts and evaluation, `share_on_node` keeps one
reference copy per node.

Design notes: docs/distributed.md
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator, NoReturn, Optional

import torch
import torch.distributed as dist

from ..config import ConfigError

logger = logging.getLogger(__name__)

STRATEGIES = ("ddp", "fsdp")


class PeerFailure(RuntimeError):
    """A collective failed because another rank stopped (its own error was reported by that rank)."""


@contextlib.contextmanager
def _collective(what: str) -> Iterator[None]:
    try:
        yield
    except torch.OutOfMemoryError:  # this rank's own failure (a RuntimeError too): it saves and reports
        raise
    except (RuntimeError, dist.DistError) as e:
        raise PeerFailure(f"{what} failed: another rank stopped or did not answer within train.ddp_timeout "
                          f"(that rank's error is above). torch: {str(e).splitlines()[0][:200]}") from e


def peer_failed(error: Optional[BaseException]) -> bool:
    """True when `error` comes from another rank's failure, not from this rank's own work."""
    return isinstance(error, (PeerFailure, dist.DistError))


@dataclass(frozen=True)
class World:
    """This process's place among the training processes (one process: rank 0 of 1)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    strategy: str = "ddp"

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def fsdp(self) -> bool:
        return self.distributed and self.strategy == "fsdp"

    # ----- collectives (identity with one process) ------------------------------------------
    def _device(self) -> torch.device:
        """Where collective tensors live: NCCL reduces CUDA tensors, gloo CPU tensors."""
        if dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over ranks of a list of numbers (fp64, so counts stay exact)."""
        if not self.distributed:
            return [float(v) for v in values]
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self._device())
        with _collective("a sum over ranks"):
            dist.all_reduce(t)
        return t.tolist()

    def any(self, flag: bool) -> bool:
        return self.sum([float(bool(flag))])[0] > 0

    def gather_rows(self, t: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `t` along dim 0, in rank order, on every rank (equal shapes).
        Returned on the CPU; bool tensors travel as uint8 (NCCL and gloo reduce numbers)."""
        if not self.distributed:
            return t
        dtype = t.dtype
        src = (t.to(torch.uint8) if dtype == torch.bool else t).contiguous().to(self._device())
        parts = [torch.empty_like(src) for _ in range(self.size)]
        with _collective("gathering rows from every rank"):
            dist.all_gather(parts, src)
        return torch.cat(parts).cpu().to(dtype)

    def rows_of_rank(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a tensor built by gather_rows."""
        n = t.shape[0] // self.size
        return t[self.rank * n:(self.rank + 1) * n]

    def gather_objects(self, obj: Any) -> list:
        """Every rank's picklable `obj`, in rank order, on every rank."""
        if not self.distributed:
            return [obj]
        out = [None] * self.size
        with _collective("gathering objects from every rank"):
            dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.distributed:
            with _collective("a barrier"):
                dist.barrier()


def torchrun_env() -> Optional[tuple[int, int, int]]:
    """(rank, world size, local rank) when launched by torchrun with more than one process, else None."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return None
    return int(os.environ["RANK"]), size, int(os.environ.get("LOCAL_RANK", "0"))


def start(strategy: str, device: str, timeout_s: float) -> tuple[World, Optional[str]]:
    """Join the process group torchrun describes (or the one a caller already started).

    Returns the World and the device name this rank must use (cuda:LOCAL_RANK on GPUs), or (World(),
    None) for a single process. Collectives time out after `timeout_s` (train.ddp_timeout), so a rank
    that died or hangs ends the others' waits with an error instead of a hang."""
    env = torchrun_env()
    if env is None:
        return World(strategy=strategy), None
    rank, size, local_rank = env
    if strategy not in STRATEGIES:
        raise ConfigError(f"train.strategy={strategy!r}: choose one of {', '.join(STRATEGIES)}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"train.device={device} but this torch build sees no CUDA GPU; set train.device=cpu")
    cuda = device != "cpu" and torch.cuda.is_available()  # auto or cuda: this rank's GPU is LOCAL_RANK's
    name = "cpu"
    if cuda:
        index = local_rank % torch.cuda.device_count()
        if index != local_rank:
            logger.warning(f"rank {rank}: {torch.cuda.device_count()} GPU(s) for local rank {local_rank}; "
                           f"sharing cuda:{index} (fine for checking correctness, not for speed)")
        name = f"cuda:{index}"
        torch.cuda.set_device(index)
    if not dist.is_initialized():
        backend = "nccl" if cuda else "gloo"
        kwargs = {"device_id": torch.device(name)} if cuda else {}
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), **kwargs)
        # Ours to leave: at the latest when the interpreter exits (a script using the Python API may not
        # call stop()); a group still alive when C++ destructors run can abort the process ("terminate
        # called without an active exception"), failing a run that had finished.
        atexit.register(stop)
    if rank != 0:  # one copy of the run's progress messages: warnings and errors still show on every rank
        logging.getLogger("lowmem_grpo").setLevel(logging.WARNING)
    return World(rank=rank, size=size, local_rank=local_rank, strategy=strategy), name


def stop() -> None:
    """Leave the process group (end of a torchrun run). A single process leaves alone a group someone
    else started in it (vLLM in-process starts one of its own and leaves it at exit)."""
    if dist.is_initialized() and torchrun_env() is not None:
        dist.destroy_process_group()


def end_rank(code: int) -> NoReturn:
    """End this torchrun rank with exit status `code` once its run is over, without finalizing the
    interpreter: the exit handlers run (ours leaves the process group; a tracker's flushes), the
    streams and log handlers are flushed, then os._exit.

    Why: gloo's worker threads outlive the process group. destroy_process_group() does not stop
    them, and DDP and FSDP2 keep the group's C++ object, and so its threads, alive until the process
    ends (checked with torch 2.13: after destroy_process_group() and the module's deletion the
    pt_gloo_runloop threads are still there). Such a thread lets go of a collective's tensors after
    the collective has returned, and letting go of a tensor Python also holds takes the GIL (torch's
    decref_pyobject, a noexcept function, checks Py_IsInitialized() and then waits for the GIL). If
    the interpreter starts finalizing during that wait, Python ends the thread with pthread_exit,
    whose unwinding through the noexcept frame calls std::terminate: "terminate called without an
    active exception", SIGABRT, and torchrun reports a finished job as failed. That is the path read
    in torch's and CPython's sources; the window is narrow (a thread descheduled at the wrong moment,
    as on a loaded CI machine), and it was not reproduced here. Without finalization no thread is
    ended that way, and no C++ static destructor runs either (the other way a process can abort at
    exit). Nothing of the run is lost: its files are written and closed, the exit handlers ran."""
    import atexit
    import sys
    atexit._run_exitfuncs()  # what a normal exit would have run (stop() included)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


# ----- what each strategy supports ----------------------------------------------------------------
def check_supported(cfg, world: World) -> None:
    """Refuse the memory modes a strategy cannot run, naming the working alternative."""
    if not world.distributed:
        return
    t, o = cfg.train, cfg.optim
    if t.optimizer_in_backward or o.offload_optimizer:
        raise ConfigError(
            f"train.optimizer_in_backward{' and optim.offload_optimizer' if o.offload_optimizer else ''} step each "
            f"parameter inside backward, before strategy={world.strategy} has averaged its gradient over the "
            f"{world.size} ranks: set train.optimizer_in_backward=false optim.offload_optimizer=false (under "
            "strategy=fsdp each rank holds only 1/N of the gradients and optimizer states anyway)")
    if world.fsdp and o.optimizer == "paged_adamw_8bit":
        raise ConfigError("optim.optimizer=paged_adamw_8bit is not supported with strategy=fsdp (each rank's "
                          "optimizer states are already 1/N of the model): set optim.optimizer=adamw_8bit")


def decoder_layers(policy: torch.nn.Module) -> list:
    """The decoder's layer list (model.model.layers for Llama/Qwen2-style models): FSDP2's sharding units."""
    from ..policy.model import decoder_of
    decoder = decoder_of(policy)
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        raise ConfigError(f"{type(policy).__name__} has no decoder layer list ({policy.base_model_prefix}.layers) "
                          "for strategy=fsdp to shard: use strategy=ddp")
    return list(layers)


def wrap(loss_module: torch.nn.Module, policy: torch.nn.Module, world: World,
         autocast: bool = False) -> torch.nn.Module:
    """The loss module made data-parallel: DDP (every rank holds the whole model; gradients averaged in
    buckets during backward) or FSDP2 (fully_shard on each decoder layer, then on the loss module for
    the rest: parameters, gradients and optimizer states are 1/N per rank). One process: unchanged.

    FSDP2 with fp32 weights under bf16 autocast gathers them in bf16 (MixedPrecisionPolicy), so no
    whole fp32 layer, and no whole fp32 output embedding, is ever on a device; gradients are still
    reduced and kept in fp32."""
    if not world.distributed:
        return loss_module
    if world.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        # device_ids=None: the module sits on one device (CPU or this rank's GPU) and batches are moved by us.
        # Construction broadcasts rank 0's parameters, so every rank starts from the same weights.
        # gradient_as_bucket_view: the gradients live in the all-reduce buckets, not in a second copy.
        return DistributedDataParallel(loss_module, device_ids=None, gradient_as_bucket_view=True)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    fp32 = next(policy.parameters()).dtype == torch.float32
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if autocast and fp32
          else MixedPrecisionPolicy())
    for layer in decoder_layers(policy):
        fully_shard(layer, mp_policy=mp)
    fully_shard(loss_module, mp_policy=mp)  # the root: embeddings, final norm and head (a tied head is one parameter)
    return loss_module


def as_float(norm: torch.Tensor) -> float:
    """A total gradient norm as a number: FSDP2's clip_grad_norm_ returns a DTensor (already global)."""
    full = getattr(norm, "full_tensor", None)
    return float(full() if full is not None else norm)


@contextlib.contextmanager
def full_weights(module: torch.nn.Module, world: World) -> Iterator[None]:
    """Inside, the policy's parameters are whole tensors on every rank (generation, evaluation,
    log-prob passes, which run outside the loss forward). Only FSDP2 has anything to do: it gathers
    every sharded unit once, keeps it gathered across however many forwards each rank runs (ranks
    generate different numbers of tokens, so per-forward gathers would not match up), and reshards
    on the way out."""
    if not world.fsdp:
        yield
        return
    units = [m for m in module.modules() if hasattr(m, "unshard") and hasattr(m, "reshard")]
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(True, recurse=False)


def full_state_dict(policy: torch.nn.Module, module: torch.nn.Module, world: World) -> dict:
    """The policy's state dict as whole CPU tensors; under FSDP2 gathered to rank 0 (a collective; the
    other ranks get {}), one tensor at a time, never the whole model on a GPU."""
    if not world.fsdp:
        return {k: v.detach().cpu().clone() for k, v in policy.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    prefix = "policy."  # the FSDP root is the loss module, which holds the policy
    return {k[len(prefix):]: v for k, v in state.items()} if world.is_main else {}


class LocalShards:
    """The optimizer's view of FSDP2's sharded parameters: each rank's local shard as a plain Parameter
    that shares the shard's storage, so an update lands in the shard.

    FSDP2's parameters and gradients are DTensors, and bitsandbytes' 8-bit kernels (also under the
    stochastic-rounding optimizer) take plain tensors. Every optimizer here is element-wise, so a
    shard's update is the whole tensor's update restricted to the shard; 8-bit states quantize in
    256-element blocks of the shard rather than of the whole tensor (not bit-identical to one
    process). Clipping runs on the DTensor gradients first (clip_grad_norm_ takes the global norm)."""

    def __init__(self, policy: torch.nn.Module):
        self.pairs = [(p, torch.nn.Parameter(p.to_local().detach())) for p in policy.parameters() if p.requires_grad]
        self.pairs = [(p, local) for p, local in self.pairs if local.numel()]  # a rank may hold no rows of a tensor
        self.module = torch.nn.ParameterList([local for _, local in self.pairs])  # what the optimizer is built on

    def link_grads(self) -> None:
        """Give each local Parameter its shard of the (reduce-scattered) gradient, before optimizer.step()."""
        for p, local in self.pairs:
            local.grad = None if p.grad is None else p.grad.to_local()


# ----- one reference model per node ------------------------------------------------------------------
SHARED_DIR = "/dev/shm"  # a RAM-backed file system on Linux: the one copy lives here, mapped by every rank


def share_on_node(model: torch.nn.Module, world: World) -> bool:
    """Make the ranks of a node share one copy of `model`'s (frozen) weights: its local rank 0 writes them
    to a file in /dev/shm, every rank maps that file (torch.load(mmap=True)) and points the parameters
    at it, dropping its own copy, and the file's name is removed (the pages live until the last rank
    unmaps them, so nothing is left behind). Returns False, keeping private copies, where /dev/shm is
    missing or too small (containers often give it 64 MiB) or the write fails."""
    if not world.distributed:
        return False
    path = None
    if world.local_rank == 0:
        path = _write_shared(model)
    # A node is torchrun's GROUP_RANK (--node-rank with static rendezvous), not a host name: two
    # launchers on one machine are two nodes, each with its own file (mkstemp names never collide,
    # and each leader removes only its own).
    node = int(os.environ.get("GROUP_RANK", world.rank - world.local_rank))
    leaders = {n: p for n, local_rank, p in world.gather_objects((node, world.local_rank, path)) if local_rank == 0}
    mine = leaders[node]
    if mine is not None:
        state = torch.load(mine, mmap=True, weights_only=True, map_location="cpu")
        with torch.no_grad():
            for name, p in model.named_parameters():  # a tied weight once
                p.data = state[name]
    world.barrier()  # every rank has mapped it
    if path is not None:
        os.unlink(path)
    if mine is None and world.is_main:
        logger.warning(f"the reference model is not shared between the ranks of a node ({SHARED_DIR} is missing "
                       "or too small): each rank keeps its own copy in CPU RAM")
    return mine is not None


def _write_shared(model: torch.nn.Module) -> Optional[str]:
    import shutil
    import tempfile
    need = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    if not os.path.isdir(SHARED_DIR) or shutil.disk_usage(SHARED_DIR).free < 1.1 * need + 2**26:
        return None
    fd, path = tempfile.mkstemp(prefix="lowmem-grpo-reference-", suffix=".pt", dir=SHARED_DIR)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(model.state_dict(), f)
        return path
    except OSError:
        os.unlink(path)
        return None
