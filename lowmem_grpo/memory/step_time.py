"""The time of one optimizer step on a named card (cards.py), from the FLOPs and bytes of each phase.

`estimate(cfg, arch, card)` gives the seconds of generation (prefill + decode), reference log-probs,
training (forward, recompute, backward, and the host adds of accumulated gradients), the host update of
an offloaded optimizer, and the PCIe time that no computation hides ("transfer"); `total` is their sum.
Matmul phases run at the card's bf16 rate x `EFFICIENCY.compute`, decode steps at the larger of their
FLOPs and their bytes (weights + KV cache) over bandwidth x `EFFICIENCY.decode`, copies at the link's
rate x `EFFICIENCY.pcie`; which copies overlap which computation follows the code (docs/planner.md).
`transfers(cfg, arch)` lists what crosses PCIe and how often (per micro-batch, reference pass or step).
Completions count at full length (an upper estimate); the efficiencies are fitted to two H100 runs by
benchmarks/step_time_fit.py, whose table gives the error per measured phase.

Design notes: docs/planner.md ("Step time on a named card")
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from ..config import Config, batch_plan
from ..training.step_modes import layer_major_wanted
from .cards import Card
from .plan import (Arch, StepSizes, activations_offloaded, compiled_decode, decoder_positions, old_logprob_pass,
                   reference_micro_batches, reference_stream_groups, table_in_host_ram)
from .vllm_plan import uses_vllm


@dataclass(frozen=True)
class Efficiency:
    """What fraction of a card's (and the host's) rates each kind of work reaches."""

    compute: float  # of the bf16 dense rate: training, reference and prefill matmuls
    decode: float  # of the memory bandwidth: a decode step reading every weight and the KV cache
    pcie: float  # of the link's rate per direction: copies from and to pinned host memory
    host_update_gbps: float  # host memory traffic of the offloaded optimizer's update (host_update_bytes)
    host_add_gbps: float  # host memory traffic adding a later micro-batch's gradients into the host buffers


# Fitted by benchmarks/step_time_fit.py on the two H100 runs (its table: the error per phase), except
# `compute`: those runs' training is mostly gradient copies and host adds, so they do not pin it (fitted
# too, it comes out 0.16, and the held-out 4096-token run's training then misses by +67%); 0.4, the low
# end of the 40-60% of the bf16 rate dense training reaches, estimates that run within 10%.
EFFICIENCY = Efficiency(compute=0.4, decode=0.385, pcie=0.453, host_update_gbps=45.7, host_add_gbps=21.8)


@dataclass(frozen=True)
class Transfer:
    """`nbytes` crossing PCIe in `direction` ("h2d" or "d2h"), `count` times per optimizer step."""

    kind: str
    direction: str
    nbytes: int
    count: float
    per: str  # what it happens once per: "micro-batch", "reference pass", "step"

    @property
    def total(self) -> int:
        return int(self.nbytes * self.count)


@dataclass
class StepTime:
    """Seconds per optimizer step by phase; `exposed`: the transfer seconds by the phase they stall."""

    card: str
    generation: float
    reference: Optional[float]  # None: no reference (beta 0) or one computed on the CPU (not estimated)
    training: float
    host_update: float
    exposed: dict[str, float] = field(default_factory=dict)
    transfers: list[Transfer] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def transfer(self) -> float:
        return sum(self.exposed.values())

    @property
    def total(self) -> float:
        return self.generation + (self.reference or 0.0) + self.training + self.host_update + self.transfer

    def seconds(self) -> dict:
        return {"generation": self.generation, "training": self.training, "reference": self.reference,
                "host_update": self.host_update, "transfer": self.transfer, "total": self.total}

    def transfer_bytes(self) -> dict:
        """{"h2d": bytes, "d2h": bytes, "parts": {direction: {kind: bytes}}} per optimizer step."""
        parts: dict[str, dict[str, int]] = {"h2d": {}, "d2h": {}}
        for t in self.transfers:
            parts[t.direction][t.kind] = parts[t.direction].get(t.kind, 0) + t.total
        return {"h2d": sum(parts["h2d"].values()), "d2h": sum(parts["d2h"].values()), "parts": parts}


# ----- FLOPs -------------------------------------------------------------------------------------------
def matmul_params(arch: Arch) -> int:
    """Weights one token multiplies by in one decoder layer (q, k, v, o, gate, up, down; not the norms)."""
    return arch.layer_params() - 2 * arch.hidden


def layers_flops(arch: Arch, positions: int, rows: int, length: int) -> float:
    """Forward FLOPs of the decoder layers over `positions` positions in `rows` causal rows of `length`:
    2 per weight and position, and the attention's QK^T and AV over half the (length x length) square."""
    attention = 2 * 2 * rows * length * length / 2 * arch.heads * arch.head_dim
    return arch.layers * (2 * matmul_params(arch) * positions + attention)


def head_flops(arch: Arch, tokens: int) -> float:
    """Forward FLOPs of the output head over `tokens` tokens (the fused head: completion tokens only)."""
    return 2 * arch.vocab * arch.hidden * tokens


def decode_step(arch: Arch, rows: int, context: int, compute_bytes: int) -> tuple[float, float]:
    """(FLOPs, bytes read) of one decode step of `rows` rows at `context` cached positions: every weight
    the step multiplies by (the embedding lookup reads `rows` rows of its table: counted only as the head
    when tied) and the K and V of every cached position."""
    flops = layers_flops(arch, rows, 0, 0) + 4 * rows * context * arch.heads * arch.head_dim * arch.layers
    flops += head_flops(arch, rows)
    weights = arch.params - (0 if arch.tied else arch.vocab * arch.hidden)
    kv = rows * context * arch.layers * 2 * arch.kv_heads * arch.head_dim * compute_bytes
    return flops, compute_bytes * weights + kv


def host_update_bytes(cfg: Config, arch: Arch) -> int:
    """Host memory an offloaded update touches per optimizer step: the norm pass reads every gradient; the
    update reads the gradient and the weight copy (fp32 master for adamw) and reads and writes the states
    and the weight (optim/offload.py). 8-bit AdamW with bf16 weights: 2 + 2 + 2x2 + 2x2 = 12 B/parameter."""
    wb = 2 if cfg.model.precision == "bf16_sr" else 4
    master = 4 if cfg.optim.optimizer == "adamw" else wb
    states = 8 if cfg.optim.optimizer == "adamw" else 2  # bytes per parameter, both moments
    return arch.params * (2 * wb + 2 * states + 2 * master)


# ----- what crosses PCIe -----------------------------------------------------------------------------
def transfers(cfg: Config, arch: Arch, device: str = "cuda", reference_per_micro_batch: bool = False
              ) -> list[Transfer]:
    """Every copy between host and device in one optimizer step as the code makes them today: the streamed
    reference's layers and head slices once per generation batch (layer-major; `reference_per_micro_batch`:
    once per logprob micro-batch, as the code did before, for the calibration runs); the offloaded
    optimizer's gradients once per micro-batch (a tied embedding's head part separately; with a layer-major
    backward the layers' once per step, the embedding lookup's as at most one row per position, the head's
    too with train.head_gradient_once_per_step) and the new weights once per step (model.offload_weights:
    the layers' weights up in each forward, backward and old log-prob pass instead, and into the compact
    copy); offloaded activations (the layer inputs checkpointing keeps, one per group of
    model.layers_per_checkpoint layers, and the final norm's saves) down in each forward and up in each
    backward."""
    t = cfg.train
    wb = 2 if cfg.model.precision == "bf16_sr" else 4
    batches = batch_plan(cfg)
    steps = batches.steps_per_generation_batch
    micro = batches.micro_batches_per_generation / steps
    head = arch.vocab * arch.hidden
    positions = decoder_positions(cfg, arch, t.per_device_train_batch_size)[0]  # of one micro-batch
    out = []
    if t.beta > 0 and device != "cpu" and t.reference_compute != "cpu":
        passes = reference_micro_batches(cfg) if reference_per_micro_batch else reference_stream_groups(cfg)[1]
        out.append(Transfer("reference layers", "h2d", wb * arch.layers * arch.layer_params(), passes / steps,
                            "reference pass"))
        out.append(Transfer("reference head", "h2d", wb * head, passes / steps, "reference pass"))
    if cfg.optim.offload_optimizer:
        every = wb * (arch.params + (head if arch.tied else 0))
        if layer_major_wanted(cfg, 1):  # the layers' gradients once per step; the lookup's as the rows it
            layers = wb * arch.layers * arch.layer_params()  # read (at most one per position, an int64 id each)
            out.append(Transfer("gradients", "d2h", layers, 1, "step"))
            rows = min(arch.vocab, positions)
            out.append(Transfer("lookup gradients", "d2h", rows * (wb * arch.hidden + 8), micro, "micro-batch"))
            every -= layers + wb * head
        # the head's and final norm's sums, held on the device (a layer-major step's setting)
        once = cfg.train.head_gradient_once_per_step and layer_major_wanted(cfg, 1)
        out.append(Transfer("gradients", "d2h", every, 1 if once else micro, "step" if once else "micro-batch"))
        layers = wb * arch.layers * arch.layer_params()
        if cfg.model.offload_weights:  # the layers cross when they compute, not after their update: in the
            # step's forward and backward, each old log-prob pass, and into the compact copy per generation batch
            table = table_in_host_ram(cfg, arch)  # an untied embedding: only the rows it reads cross
            out.append(Transfer("weights", "h2d", wb * (arch.params - table) - layers, 1, "step"))
            if table:
                out.extend(_embedding_rows(cfg, arch, wb, positions, micro, steps))
            out.append(Transfer("policy layers", "h2d", layers, 2, "step"))
            if old_logprob_pass(cfg):
                out.append(Transfer("policy layers", "h2d", layers, reference_stream_groups(cfg)[1] / steps,
                                    "old log-prob pass"))
            out.append(Transfer("rollout copy", "h2d", layers, 1 / steps, "generation batch"))
        else:
            out.append(Transfer("weights", "h2d", wb * arch.params, 1, "step"))
    layer_io = positions * arch.hidden * wb
    if activations_offloaded(cfg, layer_io):  # the layer inputs, and the final norm's saves that go with them
        sizes = StepSizes.of(cfg, arch, cfg.model.bf16 is not False, device)
        moved = sizes.kept_layer_inputs() * layer_io + int(sizes.costs.norm_offloaded * positions)
        for direction in ("d2h", "h2d"):
            out.append(Transfer("activations", direction, moved, micro, "micro-batch"))
    return out


def _embedding_rows(cfg: Config, arch: Arch, wb: int, positions: int, micro: float, steps: int) -> list[Transfer]:
    """The rows an embedding table in host RAM sends up per optimizer step, at most: two lookups of every
    training micro-batch (its forward, and its recomputation for the lookup's gradient), and every position of
    the generation batch in the rollout, in the compact copy's log-prob pass and in the old log-prob pass."""
    row = wb * arch.hidden
    g, rows = cfg.generation, batch_plan(cfg).generation_batch_size
    out = [Transfer("embedding rows", "h2d", 2 * positions * row, micro, "micro-batch")]
    sequences = rows * (g.max_prompt_length + g.max_completion_length) * row
    passes = 1 + (cfg.generation.rollout_quantization != "none") + old_logprob_pass(cfg)
    out.append(Transfer("embedding rows", "h2d", passes * sequences, 1 / steps, "generation batch"))
    return out


# ----- the estimate ----------------------------------------------------------------------------------
def estimate(cfg: Config, arch: Arch, card: Card, efficiency: Efficiency = EFFICIENCY,
             reference_per_micro_batch: bool = False) -> StepTime:
    """Seconds of one optimizer step of `cfg` on `arch` on `card` (module docstring); one process.
    `reference_per_micro_batch`: the reference streamed once per micro-batch, as before (`transfers`)."""
    t, g, e = cfg.train, cfg.generation, efficiency
    wb = 2 if cfg.model.precision == "bf16_sr" else 4
    ab = 2 if (wb == 2 or cfg.model.bf16 is not False) else 4  # what the matmuls read under autocast
    flop_rate, bandwidth = card.bf16_tflops * 1e12 * e.compute, card.memory_gbps * 1e9
    pcie = card.pcie_gbps * 1e9 * e.pcie
    batches = batch_plan(cfg)
    steps = batches.steps_per_generation_batch  # a generation batch's rollout and log-probs feed this many
    P, C = g.max_prompt_length, g.max_completion_length
    notes = []

    # generation: calls of up to generation_micro_batch_size rows; each a prefill, then C decode steps
    rows_left, generation = batches.generation_batch_size, 0.0
    while rows_left > 0:
        rows = min(rows_left, g.generation_micro_batch_size)
        rows_left -= rows
        generation += (layers_flops(arch, rows * P, rows, P) + head_flops(arch, rows)) / flop_rate
        flops, nbytes = decode_step(arch, rows, P + C // 2, ab)  # the context halfway through
        generation += C * max(flops / flop_rate, nbytes / (bandwidth * e.decode))
    if not compiled_decode(cfg):
        notes.append("generation.compile_decode is off: eager decode steps are launch-bound, several times "
                     "slower than estimated here (RESULTS.md, 'Second GPU run')")
    if uses_vllm(cfg):
        notes.append("generation.engine=vllm: generation is estimated as the native compiled decode's")

    every_move = transfers(cfg, arch, reference_per_micro_batch=reference_per_micro_batch)
    moves = {x.kind: x for x in every_move}  # (gradients: see below)
    exposed = {}
    mb_lp = t.logprob_rows
    positions_lp = decoder_positions(cfg, arch, mb_lp)[0]
    lp_layers = layers_flops(arch, positions_lp, mb_lp, P + C) / flop_rate
    lp_head = head_flops(arch, mb_lp * C) / flop_rate
    passes = math.ceil(batches.generation_batch_size / mb_lp) / steps
    reference = None
    if "reference layers" in moves:  # each layer's copy overlaps the layer before's compute (every micro-batch
        # of it, layer-major); the head's slices do not
        copy_layers = moves["reference layers"].total / pcie
        reference = passes * (lp_layers + lp_head)
        exposed["reference"] = max(0.0, copy_layers - passes * lp_layers) + moves["reference head"].total / pcie
    elif t.beta > 0:
        notes.append("train.reference_compute=cpu: the reference forward runs on the host, not estimated")

    # training: per micro-batch a forward, with checkpointing a recompute, and a backward of twice the forward;
    # the fused head recomputes its logits in backward and makes two gradients
    b = t.per_device_train_batch_size
    micro = batches.micro_batches_per_generation / steps
    positions = decoder_positions(cfg, arch, b)[0]
    fwd_layers, fwd_head = layers_flops(arch, positions, b, P + C), head_flops(arch, b * C)
    forward = (fwd_layers + fwd_head) / flop_rate
    backward = ((3 if cfg.model.gradient_checkpointing else 2) * fwd_layers + 3 * fwd_head) / flop_rate
    training = micro * (forward + backward)
    if old_logprob_pass(cfg):  # the policy's no-grad pass over the generation batch
        training += passes * (lp_layers + lp_head)
    stalls = 0.0
    if "gradients" in moves:  # the first micro-batch's copies overlap its backward (side stream); later ones
        # arrive through the staging ring, which the backward's thread waits on and adds from (read, read, write)
        grads = sum(x.nbytes for x in every_move if x.kind == "gradients" and x.per == "micro-batch")
        stalls += max(0.0, grads / pcie - backward)
        add = 3 * grads / (e.host_add_gbps * 1e9)
        training += (micro - 1) * add
        stalls += (micro - 1) * max(0.0, grads / pcie - add)
        # a layer-major backward's layer gradients: once, each layer's during the backward of the next ones
        once = sum(x.nbytes for x in every_move if x.kind == "gradients" and x.per == "step")
        stalls += max(0.0, once / pcie - micro * backward) if once else 0.0
    if "lookup gradients" in moves:  # a layer-major lookup's rows: the host waits for them
        stalls += micro * moves["lookup gradients"].nbytes / pcie
    if "policy layers" in moves:  # model.offload_weights: each layer's copy overlaps the compute of the one before
        # it (every micro-batch of it), in the forward and in the backward; the old log-prob pass's likewise
        layers = moves["policy layers"].nbytes / pcie  # (every layer once)
        stalls += max(0.0, layers - micro * fwd_layers / flop_rate)
        stalls += max(0.0, layers - micro * (backward - 3 * fwd_head / flop_rate))
        if old_logprob_pass(cfg):
            stalls += max(0.0, layers * reference_stream_groups(cfg)[1] / steps - passes * lp_layers)
        stalls += moves["rollout copy"].total / pcie  # quantized as it arrives: not overlapped
    if "activations" in moves:  # down during the forward, up (prefetched) during the backward
        copy = moves["activations"].nbytes / pcie
        stalls += micro * (max(0.0, copy - forward) + max(0.0, copy - backward))
    exposed["training"] = stalls

    host_update = 0.0
    if cfg.optim.offload_optimizer:  # each weight goes up as soon as its update is done (overlapped)
        host_update = host_update_bytes(cfg, arch) / (e.host_update_gbps * 1e9)
        exposed["host_update"] = max(0.0, moves["weights"].nbytes / pcie - host_update)
    else:  # the device optimizer: read the gradient, read and write the weight and both moments
        states = 2 if cfg.optim.optimizer != "adamw" else 2 * wb  # bytes per parameter, both moments
        training += arch.params * (3 * wb + 2 * states) / (bandwidth * e.decode)
    return StepTime(card.name, generation / steps, reference, training, host_update, exposed, every_move, notes)


def format_step_time(s: StepTime) -> str:
    """The estimate as plan prints it under the memory table."""
    parts = [f"generation {s.generation:.2f}"]
    if s.reference is not None:
        parts.append(f"reference {s.reference:.2f}")
    parts.append(f"training {s.training:.2f}")
    if s.host_update:
        parts.append(f"host update {s.host_update:.2f}")
    parts.append(f"transfer not hidden {s.transfer:.2f}")
    moved = s.transfer_bytes()

    def direction(name: str, word: str) -> str:
        kinds = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in moved["parts"][name].items())
        return f"{moved[name] / 1e9:.1f} GB {word} ({kinds})" if kinds else f"nothing {word}"
    lines = [f"step time on {s.card} (estimate, docs/planner.md): {s.total:.1f} s = {' + '.join(parts)}",
             f"  across PCIe per step: {direction('h2d', 'up')}, {direction('d2h', 'down')}"]
    lines += [f"  note: {n}" for n in s.notes]
    return "\n".join(lines)
