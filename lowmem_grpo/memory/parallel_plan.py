"""Per-rank device memory under torchrun (`lowmem-grpo plan ... --nproc N --strategy ddp|fsdp`).

The one-process plan (plan.py) of the rank's own micro-batches, changed where the strategy changes what a
rank holds (training/distributed.py): DDP keeps every gradient in its all-reduce buckets in every phase;
FSDP shards weights, gradients and optimizer states 1/N per rank and adds what it gathers whole. Host RAM
is per node (N / nnodes ranks); device memory is per rank. NCCL buffers are not counted.

Design notes: docs/planner.md ("Several GPUs")
"""

from __future__ import annotations

from .plan import Arch, MemoryPlan

STRATEGIES = ("ddp", "fsdp")
# The phases run inside distributed.full_weights, every FSDP unit gathered: the rollout and the reward scoring
# (one generation batch, Trainer.new_generation_batch), the log-prob passes outside the loss, evaluation.
GATHERED_PHASES = ("rollout", "rewards", "old log-probs", "reference log-probs", "evaluation")


def per_rank(result: MemoryPlan, cfg, arch: Arch, nproc: int, strategy: str, nnodes: int = 1) -> MemoryPlan:
    """`result` (plan() of the rank's settings) as one rank's prediction under `strategy` with `nproc` ranks
    in all, spread evenly over `nnodes` nodes (host RAM is a node's); `result` itself with one rank."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy {strategy!r}: one of {', '.join(STRATEGIES)}")
    if nnodes < 1 or nproc % nnodes:
        raise ValueError(f"{nproc} ranks on {nnodes} nodes: torchrun runs the same number of ranks on every node "
                         "(--nproc-per-node); give a multiple of the node count")
    if nproc <= 1:
        return result
    wb = 2 if cfg.model.precision == "bf16_sr" else 4
    weights, grads = wb * arch.params, wb * arch.params
    # FSDP2 gathers fp32 weights in bf16 under autocast (on by default on a GPU: plan.py's assumption)
    gathered = 2 if cfg.model.bf16 is not False else wb
    phases = {}
    for phase, cats in result.phase_categories.items():
        cats = dict(cats)
        if strategy == "ddp":
            cats["gradients"] = max(cats.get("gradients", 0), grads)
        else:
            root = gathered * (arch.vocab * arch.hidden * (1 if arch.tied else 2) + arch.hidden)
            layer = gathered * arch.layer_params()
            shards = weights // nproc
            cats["optimizer states"] = cats.get("optimizer states", 0) // nproc
            if "gradients" in cats:
                cats["gradients"] = cats["gradients"] // nproc
            if phase in GATHERED_PHASES:
                cats["weights"] = shards + gathered * arch.params
            elif phase == "optimizer":
                cats["weights"] = shards
            else:
                cats["weights"] = shards + root + 2 * layer
                if phase == "backward":
                    cats["gradients"] = cats.get("gradients", 0) + root + layer
        phases[phase] = {k: int(v) for k, v in cats.items()}
    # Host RAM of a node's ranks: each keeps its own, except the reference model run on the CPU, which
    # the ranks share (distributed.share_on_node; streamed, each rank pins its own copy).
    shared = {"reference model"} if cfg.train.reference_compute == "cpu" else set()
    per_node = nproc // nnodes
    host = {k: v * (1 if k in shared else per_node) for k, v in result.host_categories.items()}
    return MemoryPlan(phases, host, result.host_pinned, result.vllm)
