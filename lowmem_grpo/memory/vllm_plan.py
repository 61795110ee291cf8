"""vLLM's share of the plan (generation.engine=vllm): what it takes of the card, and what it needs inside.

On a GPU, vLLM in the trainer's process takes vllm_gpu_memory_utilization x the card's memory when it
starts (vLLM's rule: it refuses to start when that much is not free) and keeps it all run (sleep mode
is not built): the "vLLM" category, in every phase. Inside that share it places its copy of the weights
(in policy/vllm_engine.py's `engine_dtype`), the activations of its profiling forward
(max_num_batched_tokens tokens, and the sampler's logits for max_num_seqs rows), its CUDA graphs' pool
and its own workspaces, and gives the rest to its KV cache, in blocks of BLOCK tokens. `VLLMNeed` is
that arithmetic: the least share that starts (KV for one max_model_len sequence) and the share that
decodes a whole generation batch at once (KV for every row). The trainer makes no KV cache of its
own then. On the CPU vLLM lives in host RAM: its weights and vllm_cpu_kv_cache_gib ("vLLM" host).

Design notes: docs/rollouts.md ("vLLM as the rollout engine")
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from ..config import Config, rollout_engine
from .layer_probe import layer_costs

GiB = 2**30
BLOCK = 16  # tokens per KV-cache block (vLLM's default block size)
LOGIT_BUFFERS = 6  # the sampler's (rows, V) fp32 buffers: logits, processed logits, probabilities, top-p sort + indices
GRAPH_TOKENS = 512  # the largest batch vLLM captures a CUDA graph for (its default cap)
# vLLM's own cuBLAS and attention workspaces and other allocations it makes inside its share: a stated
# estimate, not yet measured on a GPU (vLLM logs what it measured at start-up).
WORKSPACE_BYTES = 256 * 2**20


def uses_vllm(cfg: Config) -> bool:
    return rollout_engine(cfg.generation) == "vllm"


@dataclass(frozen=True)
class VLLMNeed:
    """Bytes vLLM needs inside its share."""

    weights: int
    activations: int  # the profiling forward and the sampler's buffers
    graphs: int  # the CUDA graphs' pool (0 off CUDA)
    workspace: int
    kv_per_sequence: int  # one max_model_len sequence's KV cache, whole blocks
    sequences: int  # max_num_seqs: the rows of one generation batch

    @property
    def least(self) -> int:
        """The share vLLM starts with: room for one sequence's KV cache."""
        return self.weights + self.activations + self.graphs + self.workspace + self.kv_per_sequence

    @property
    def whole_batch(self) -> int:
        """The share that holds every row's KV cache at once (no row waits for another to finish)."""
        return self.least + self.kv_per_sequence * (self.sequences - 1)

    def utilization(self, bytes_: int, card_bytes: int) -> float:
        """The vllm_gpu_memory_utilization (hundredths, rounded up) that gives vLLM `bytes_` of the card."""
        return math.ceil(100 * bytes_ / card_bytes) / 100


def need(cfg: Config, arch, autocast: bool, device: str = "cuda") -> VLLMNeed:
    """What vLLM needs for `cfg` on `arch` (plan.Arch); `autocast` as the trainer resolves model.bf16."""
    from ..policy.vllm_engine import engine_sizes
    sizes = engine_sizes(cfg)
    policy_bytes = 2 if cfg.model.precision == "bf16_sr" else 4
    wb = 2 if device == "cuda" and autocast else policy_bytes  # engine_dtype
    costs = layer_costs(arch.config, torch.bfloat16 if wb == 2 else torch.float32, False)
    per_token = costs.no_grad_peak - costs.kv_cache + 2 * arch.hidden * wb  # one layer's transient, the stream in/out
    tokens = sizes.max_num_batched_tokens
    activations = tokens * per_token + LOGIT_BUFFERS * 4 * sizes.max_num_seqs * arch.vocab
    graphs = min(GRAPH_TOKENS, 2 * sizes.max_num_seqs) * per_token if device == "cuda" else 0
    kv = math.ceil(sizes.max_model_len / BLOCK) * BLOCK * arch.layers * 2 * arch.kv_heads * arch.head_dim * wb
    return VLLMNeed(wb * arch.params, int(activations), int(graphs), WORKSPACE_BYTES if device == "cuda" else 0,
                    int(kv), sizes.max_num_seqs)


def share_bytes(cfg: Config, card_bytes: int) -> int:
    """What vLLM takes of a card of `card_bytes`: vllm_gpu_memory_utilization of it (vLLM rounds up)."""
    return math.ceil(card_bytes * cfg.generation.vllm_gpu_memory_utilization)


def share_problem(cfg: Config, needed: VLLMNeed, card_bytes: int) -> Optional[str]:
    """Why vLLM would not start in its share of a card of `card_bytes`, with the utilization that would; None if it
    starts. (A share between `least` and `whole_batch` starts: rows then wait for KV blocks, which is slower.)"""
    share = share_bytes(cfg, card_bytes)
    if share >= needed.least:
        return None
    f = cfg.generation.vllm_gpu_memory_utilization
    return (f"vllm_gpu_memory_utilization={f} gives vLLM {share / GiB:.2f} GiB of the {card_bytes / GiB:.2f} GiB "
            f"card, but it needs {needed.least / GiB:.2f} GiB to start (weights {needed.weights / GiB:.2f}, "
            f"activations {needed.activations / GiB:.2f}, CUDA graphs {needed.graphs / GiB:.2f}, workspace "
            f"{needed.workspace / GiB:.2f}, one sequence's KV cache {needed.kv_per_sequence / GiB:.3f}): set "
            f"vllm_gpu_memory_utilization={needed.utilization(needed.least, card_bytes)} at least "
            f"({needed.utilization(needed.whole_batch, card_bytes)} holds all {needed.sequences} rows at once), "
            "or engine=native")


def summary(cfg: Config, needed: VLLMNeed, card_bytes: Optional[int]) -> dict:
    """The plan's "vllm" entry: the share taken, what it needs, and the utilizations that would do."""
    share = share_bytes(cfg, card_bytes) if card_bytes else needed.whole_batch
    out = {"share_bytes": share, "card_bytes": card_bytes, "utilization": cfg.generation.vllm_gpu_memory_utilization,
           "weights": needed.weights, "activations": needed.activations, "graphs": needed.graphs,
           "workspace": needed.workspace, "kv_per_sequence": needed.kv_per_sequence, "sequences": needed.sequences,
           "least_bytes": needed.least, "whole_batch_bytes": needed.whole_batch,
           "problem": share_problem(cfg, needed, card_bytes) if card_bytes else None}
    if card_bytes:
        out["least_utilization"] = needed.utilization(needed.least, card_bytes)
        out["whole_batch_utilization"] = needed.utilization(needed.whole_batch, card_bytes)
    return out


def host_bytes(cfg: Config, arch) -> int:
    """vLLM on the CPU: its copy of the weights (the policy's dtype) and its KV cache (VLLM_CPU_KVCACHE_SPACE,
    whole GiB as policy/vllm_engine.py sets it)."""
    from ..policy.vllm_engine import cpu_kv_cache_space
    wb = 2 if cfg.model.precision == "bf16_sr" else 4
    return wb * arch.params + cpu_kv_cache_space(cfg.generation.vllm_cpu_kv_cache_gib) * GiB


def format_summary(entry: dict) -> str:
    """The lines `lowmem-grpo plan` prints about vLLM."""
    g = lambda b: f"{b / GiB:.2f}"  # noqa: E731
    lines = [f"vLLM (engine=vllm): share {g(entry['share_bytes'])} GiB"
             + (f" = vllm_gpu_memory_utilization {entry['utilization']} x the {g(entry['card_bytes'])} GiB card"
                if entry["card_bytes"] else " (what it needs for the whole batch; no card given)"),
             f"  inside it: weights {g(entry['weights'])}, activations {g(entry['activations'])}, CUDA graphs "
             f"{g(entry['graphs'])}, workspace {g(entry['workspace'])}, KV cache "
             f"{entry['kv_per_sequence'] / 2**20:.1f} MiB per sequence x {entry['sequences']} rows",
             f"  needs {g(entry['least_bytes'])} GiB to start, {g(entry['whole_batch_bytes'])} GiB for all rows "
             "at once"]
    if entry["card_bytes"]:
        lines[-1] += (f" (vllm_gpu_memory_utilization {entry['least_utilization']} / "
                      f"{entry['whole_batch_utilization']})")
    if entry["problem"]:
        lines.append(f"  does not start: {entry['problem']}")
    return "\n".join(lines)
