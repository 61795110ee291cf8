"""Device-memory accounting of a GRPO step from a model config and the run's settings (no weights).

`plan(cfg)` gives each phase's peak (rollout, old log-probs, reference log-probs, forward, backward,
optimizer, evaluation) as the sum of the categories alive at its worst moment: weights, optimizer states,
gradients, activations (per token and layer, measured by layer_probe.py), loss head, KV cache, reference
buffers. The peak is the largest phase, in the allocator's view: CUDA context, cuBLAS workspace and
fragmentation come on top (`margin_bytes`). The result is a `MemoryPlan`; the body is one short function
per component (gradients, activations) and per phase, over the `StepSizes` derived once from the settings.
Host RAM (host_plan.py) and the suggestions when a run does not fit (suggest.py) have their own modules.

Design notes: docs/planner.md (what each category counts, phase by phase)
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from ..config import Config, batch_plan, importance_sampling_correction, rollout_sampler
from ..kernels.linear import default_chunk_size
from ..training.activation_offload import MIN_BYTES
from ..optim.optimizers import BNB_BLOCK, BNB_MIN_8BIT, optimizer_state_bytes  # noqa: F401 (also ours)
from . import reward_plan, vllm_plan
from .arch import Arch  # noqa: F401 (importable from here, as before)
from .head_bytes import loss_head_bytes
from .host_plan import host_categories, packed_decode_bytes, pinned_host_categories, planned_packing
from .layer_probe import LayerCosts, layer_costs
from .rollout_copy import compact_copy_bytes  # noqa: F401 (importable from here too)
from ..training.step_modes import head_gradient_once, layer_major_wanted, layers_per_checkpoint, offload_weights

GiB = 2**30
GENERATION_LOGIT_BUFFERS = 6  # last-position logits (fp32), processed scores, probabilities, top-p sort + indices


def optimizer_step_bytes(cfg: Config, arch: Arch, device: str, one_tensor: bool = False) -> int:
    """Temporaries of an optimizer step (of one tensor's step, for the optimizer in backward).

    torch AdamW (foreach) makes ~2 weight-sized temporaries over the whole list; bitsandbytes 8-bit on
    a GPU updates in one fused kernel (none), on the CPU it makes 5 fp32 copies of the tensor it
    updates (measured: benchmarks/RESULTS.md); bf16_sr feeds it 4 MiB chunks.
    """
    wb = 2 if cfg.model.precision == "bf16_sr" else 4
    largest = max(arch.tensor_sizes)
    if cfg.optim.optimizer == "adamw":
        return 2 * wb * (largest if one_tensor else arch.params)
    if device != "cpu":
        return 0
    return 5 * 4 * (min(largest, 2**20) if cfg.model.precision == "bf16_sr" else largest)


def decoder_positions(cfg: Config, arch: Arch, micro_batch: int, query_bytes: int = 2) -> tuple[int, int, int]:
    """(decoder positions, attention mask bytes held, bytes made per attention call) of one micro-batch of
    completions at full lengths.

    Packed (train.pack_prompts, policy/packing.py): the worst-case layout over where the micro-batch
    falls in its groups, only where the trainer would pack it (always with pack_prompts=true; where it
    does less work when unset). Unpacked: B rows of P + C positions, whose padding (left of the
    prompts, right of the completions that end early) transformers turns into a (B, 1, L, L) mask;
    only a batch without any padding gets none, and the planner does not count on that.
    Either mask is bool for sdpa (1 byte per element) and additive for eager (the weight dtype's bytes),
    made once per decoder forward and held until its backward is over (checkpointing keeps it as a layer
    input). sdpa turns a bool mask into an additive copy in the query dtype (`query_bytes`) in every
    attention call (measured on the CPU: aten.where; CUDA's memory-efficient kernel does the same), which
    that layer's backward keeps: "per call". flex_attention's BlockMask is small.
    The probe's per-position costs are used as they are: attention scores that grow with L^2 are not
    in them (sdpa's CUDA kernels do not materialise them).
    """
    from ..policy.packing import MASKED_IMPLEMENTATIONS, packing_pays, planned_token_counts
    g, t, impl = cfg.generation, cfg.train, cfg.model.attn_implementation
    counts = planned_token_counts(micro_batch, g.num_generations, g.max_prompt_length, g.max_completion_length)
    packs = t.pack_prompts is not False and impl in MASKED_IMPLEMENTATIONS and (
        t.pack_prompts or packing_pays(counts, arch.layer_params(), arch.heads * arch.head_dim, impl))
    positions, elements = ((counts.packed, counts.mask_bytes()) if packs else
                           (counts.unpacked, counts.rows * counts.length ** 2))
    weight_bytes = 2 if cfg.model.precision == "bf16_sr" else 4
    held = elements * {"sdpa": 1, "eager": weight_bytes}.get(impl, 0)
    return positions, held, elements * query_bytes if impl == "sdpa" else 0


class ReadsLikeADict:
    """Deprecated dict-style reads of a typed result that used to be a dict: `result["key"]` and
    `result.get("key")` warn (DeprecationWarning naming the field) and read `to_dict()`."""

    def to_dict(self) -> dict:
        raise NotImplementedError

    def __getitem__(self, key: str):
        warnings.warn(f'{type(self).__name__}["{key}"] is deprecated (it was a dict): read .{key}',
                      DeprecationWarning, stacklevel=2)
        return self.to_dict()[key]

    def get(self, key: str, default=None):
        warnings.warn(f'{type(self).__name__}.get("{key}") is deprecated (it was a dict): read .{key}',
                      DeprecationWarning, stacklevel=2)
        return self.to_dict().get(key, default)


@dataclass(frozen=True)
class MemoryPlan(ReadsLikeADict):
    """plan()'s prediction: device bytes per category at each phase's peak, and host RAM kept on purpose.

    The totals, the peak and the host sums are read from the stored categories, so they always agree.
    Every name is the key `lowmem-grpo plan --json` prints it under; `to_dict()` is that JSON's part.
    """

    phase_categories: dict[str, dict[str, int]]  # phase -> category -> bytes at its peak, in the step's order
    host_categories: dict[str, int]  # host RAM per category (host_categories(), reward models, vLLM on a CPU)
    host_pinned: list[str]  # the page-locked categories among them
    vllm: Optional[dict] = None  # vllm_plan.summary() with generation.engine=vllm

    @property
    def phases(self) -> dict[str, int]:
        """Each phase's predicted peak (bytes, allocator view)."""
        return {phase: sum(cats.values()) for phase, cats in self.phase_categories.items()}

    @property
    def peak_phase(self) -> str:
        """The phase with the largest peak (the first, where two are equal)."""
        totals = self.phases
        return max(totals, key=totals.get)

    @property
    def peak_bytes(self) -> int:
        return self.phases[self.peak_phase]

    @property
    def categories(self) -> dict[str, int]:
        """The categories at the peak phase's peak."""
        return self.phase_categories[self.peak_phase]

    @property
    def host_bytes(self) -> int:
        return sum(self.host_categories.values())

    @property
    def host_pinned_bytes(self) -> int:
        return sum(self.host_categories[c] for c in self.host_pinned)

    def to_dict(self) -> dict:
        """The result as plan() returned it before it was typed (keys in that order), for JSON."""
        return {"vllm": self.vllm, "categories": self.categories, "phases": self.phases,
                "phase_categories": self.phase_categories, "peak_bytes": self.peak_bytes,
                "peak_phase": self.peak_phase, "host_categories": self.host_categories, "host_bytes": self.host_bytes,
                "host_pinned": self.host_pinned, "host_pinned_bytes": self.host_pinned_bytes}


class MicroBatchShape(NamedTuple):
    """One micro-batch of completions at full length, as the decoder and the loss head see it."""

    positions: int  # decoder positions (shared-prompt packing runs fewer): decoder_positions()
    mask_bytes: int  # the attention mask, held from the forward to the end of its backward
    mask_call_bytes: int  # sdpa's additive copy of it, made in every attention call
    completion_tokens: int  # the tokens the loss head scores


@dataclass(frozen=True)
class StepSizes:
    """What one plan() derives from the settings once and every phase reads."""

    cfg: Config
    arch: Arch
    device: str
    weight_bytes: int  # per element of the weights, gradients and residual stream
    compute_bytes: int  # per element of what matmuls output: the loss head's compute dtype
    costs: LayerCosts  # per-token costs of one decoder layer (layer_probe.py)
    train: MicroBatchShape  # a training micro-batch
    logprob: MicroBatchShape  # a micro-batch of the log-prob passes outside the loss
    layer_cast_bytes: int  # autocast's bf16 copy of one layer's weights (0 without one)
    layer_input_bytes: int  # one layer input of a training micro-batch
    offloads_activations: bool  # whether model.offload_activations moves the layer inputs
    layer_major: bool  # train.layer_major_backward as resolved (training/step_modes.py: layer_major_wanted)
    group: int  # model.layers_per_checkpoint: layers recomputed together (1 outside a layer-major backward)
    head_once: bool  # train.head_gradient_once_per_step
    streams_weights: bool = False  # model.offload_weights: the decoder layers' weights in host RAM

    @classmethod
    def of(cls, cfg: Config, arch: Arch, autocast: bool, device: str, world_size: int = 1) -> "StepSizes":
        weight_bytes = 2 if cfg.model.precision == "bf16_sr" else 4
        compute_bytes = 2 if (weight_bytes == 2 or autocast) else 4
        costs = layer_costs(arch.config, torch.bfloat16 if weight_bytes == 2 else torch.float32, autocast)
        train_rows = cfg.train.per_device_train_batch_size
        logprob_rows = cfg.train.logprob_rows
        train, logprob = (MicroBatchShape(*decoder_positions(cfg, arch, rows, compute_bytes),
                                          rows * cfg.generation.max_completion_length)
                          for rows in (train_rows, logprob_rows))
        layer_input = train.positions * arch.hidden * weight_bytes  # the residual stream: the weight dtype
        casts = 2 * arch.layer_params() if (autocast and weight_bytes == 4) else 0
        return cls(cfg, arch, device, weight_bytes, compute_bytes, costs, train, logprob, casts, layer_input,
                   activations_offloaded(cfg, layer_input), layer_major_wanted(cfg, world_size),
                   layers_per_checkpoint(cfg, world_size), head_gradient_once(cfg, world_size),
                   offload_weights(cfg, world_size))

    def kept_layer_inputs(self) -> int:
        """Layer inputs checkpointing keeps per micro-batch: one per layer, or per group of layers."""
        return -(-self.arch.layers // self.group)

    def resident(self) -> dict[str, int]:
        """What every phase holds: the weights, and the optimizer states unless they are on the host."""
        cfg, params = self.cfg, self.arch.params
        states = optimizer_state_bytes(self.arch.tensor_sizes, cfg.optim.optimizer, self.weight_bytes)
        found = {"weights": self.weight_bytes * (params - self.params_in_host_ram()),
                 "optimizer states": 0 if cfg.optim.offload_optimizer else states}
        if cfg.generation.rollout_quantization != "none" and not self.streams_weights:  # kept all run
            found.update(self.rollout_copy())
        return found

    def params_in_host_ram(self) -> int:
        """Parameters model.offload_weights keeps in host RAM: the layers' and an untied embedding table's."""
        return (self.arch.layers * self.arch.layer_params() + table_in_host_ram(self.cfg, self.arch)
                if self.streams_weights else 0)

    def rollout_copy(self) -> dict[str, int]:
        """generation.rollout_quantization's copy: in every phase, but where model.offload_weights frees it
        after each rollout's log-prob pass (made again from the host copy for the next one): there only in the
        rollout, its log-prob pass and evaluation."""
        g = self.cfg.generation
        if g.rollout_quantization == "none":
            return {}
        return {"rollout copy": compact_copy_bytes(self.arch, self.weight_bytes, self.streams_weights,
                                                   g.rollout_quantization)}

    def streamed_layers(self, backward: bool = False) -> dict[str, int]:
        """model.offload_weights: the layers' weights on the device in a pass that runs them: the one computing
        and the next one on its way (in the backward, a group of layers_per_checkpoint and the next group)."""
        if not self.streams_weights:
            return {}
        return {"streamed layers": 2 * (self.group if backward else 1) * self.weight_bytes * self.arch.layer_params()}

    def head_bytes(self, shape: MicroBatchShape, backward: bool, differentiated: bool = False) -> int:
        return loss_head_bytes(shape.completion_tokens, self.arch, self.compute_bytes, self.weight_bytes, backward,
                               self.device, differentiated)


class GradientBytes(NamedTuple):
    """Gradient bytes on the device at the moments a training micro-batch's memory peaks."""

    before: int  # before its backward starts (accumulated from earlier micro-batches)
    at_head: int  # while the head's backward runs
    at_end: int  # when the last layer's backward is done
    whole: int  # every gradient at once (the optimizer step's input)
    head_sum: int = 0  # the head's gradient summed over micro-batches, beside each loss head after the first


def gradient_bytes(sizes: StepSizes) -> GradientBytes:
    """Only the tensors alive at once with the optimizer in backward or offloaded (every micro-batch's gradients
    leave from the hooks); otherwise every gradient exists once the first micro-batch of an accumulation is done."""
    cfg, arch, element = sizes.cfg, sizes.arch, sizes.weight_bytes
    whole = element * arch.params
    if not (cfg.train.optimizer_in_backward or cfg.optim.offload_optimizer):
        before = whole if cfg.train.gradient_accumulation_steps > 1 else 0
        head = element * arch.vocab * arch.hidden  # the output head's gradient: the first one backward makes
        return GradientBytes(before, max(before, head), whole, whole)
    embedding = arch.vocab * arch.hidden  # the tied embedding + the largest other tensor
    others = sorted((s for s in arch.tensor_sizes if s != embedding), reverse=True)
    alive = element * ((embedding if arch.tied else 0) + (others[0] if others else 0))
    if sizes.device == "cuda":  # gradients held while their norms reach the host (optimizer_in_backward.py)
        from ..optim.optimizer_in_backward import LAG_BYTES
        alive += min(LAG_BYTES, whole)
    at_end = alive
    if sizes.layer_major:  # one group's layers' gradients summed on the device over the step's micro-batches; a
        # tied embedding's lookup gradient comes after the layers' backward (backward_phase: "lookup")
        at_end += element * (sizes.group * arch.layer_params() - (embedding if arch.tied else 0))
    held = element * arch.vocab * arch.hidden if sizes.head_once else 0  # train.head_gradient_once_per_step
    return GradientBytes(0, alive, at_end, whole, held)


class ActivationBytes(NamedTuple):
    """Activation bytes of a training micro-batch at the moments its memory peaks (the attention mask included).

    Backward runs from the head down: activations fall layer by layer while gradients grow, so its peak is
    at the start (the head, then the first layer) or at the end (the last layer, every gradient made)."""

    forward_layers: int  # the worst layer of the forward
    forward_head: int  # the final norm's saves, beside the head's forward
    backward_head: int  # the head's backward
    backward_first: int  # the first layer's backward
    backward_last: int  # the last layer's backward


def activation_bytes(sizes: StepSizes) -> ActivationBytes:
    shape, costs, layers = sizes.train, sizes.costs, sizes.arch.layers
    positions, casts, layer_input = shape.positions, sizes.layer_cast_bytes, sizes.layer_input_bytes
    # the final norm's saves; under activation offload only its output stays (the rest is host RAM)
    norm = (costs.norm_left_offloaded if sizes.offloads_activations else costs.norm_saved) * positions
    if sizes.cfg.model.gradient_checkpointing:
        kept = 0 if sizes.offloads_activations else sizes.kept_layer_inputs() * layer_input  # the layer inputs
        # A checkpointed layer's forward saves nothing inside (checkpoint's hooks drop it): a no-grad
        # forward's transient, beside its input (one of `kept`, or the one on its way to the host).
        forward_layer = ((layer_input if sizes.offloads_activations else 0)
                         + (costs.no_grad_peak - costs.kv_cache) * positions + shape.mask_call_bytes)
        # one layer (a group of them) recomputed, each with its mask copy, then its backward
        recompute = (sizes.group * (casts + costs.saved * positions + shape.mask_call_bytes)
                     + costs.backward_peak * positions)
        first = kept + recompute
        if sizes.offloads_activations:  # the next layer's input, prefetched during this layer's backward
            first += layer_input
        found = (kept + forward_layer, kept + norm, kept + norm, first, layer_input + recompute)
        if sizes.layer_major:  # every micro-batch's layer inputs, through the backward of the last one
            k = sizes.cfg.train.gradient_accumulation_steps
            outs = k * layer_input  # the gradient at each micro-batch's last layer output
            earlier = (k - 1) * kept + outs
            first_inputs = 0 if sizes.offloads_activations else (k - 1) * layer_input  # the last layer backward
            found = tuple(b + earlier for b in found[:4]) + (found[4] + outs + first_inputs,)
    else:  # every layer keeps what it saved, its mask copy included
        saved = layers * (costs.saved * positions + shape.mask_call_bytes)
        found = (saved + (costs.forward_peak - costs.saved) * positions, saved + norm,
                 saved + norm + layers * casts, saved + layers * casts + costs.backward_peak * positions,
                 costs.saved * positions + shape.mask_call_bytes + casts + costs.backward_peak * positions)
    return ActivationBytes(*(bytes_ + shape.mask_bytes for bytes_ in found))  # the mask lives all step


def _largest(candidates: list[dict]) -> dict:
    """The candidate moment with the most bytes (the first, where two are equal)."""
    return max(candidates, key=lambda cats: sum(cats.values()))


def forward_phase(sizes: StepSizes, grads: GradientBytes, acts: ActivationBytes) -> dict:
    """The training forward's peak: its worst layer, or the loss head's forward."""
    casts = sizes.arch.layers * sizes.layer_cast_bytes
    worst = _largest([{"gradients": grads.before, "activations": acts.forward_layers + casts},
                      {"gradients": grads.before + grads.head_sum, "activations": acts.forward_head + casts,
                       "loss head": sizes.head_bytes(sizes.train, backward=False, differentiated=True)}])
    return {**sizes.resident(), **sizes.streamed_layers(), **worst}


def backward_phase(sizes: StepSizes, grads: GradientBytes, acts: ActivationBytes) -> dict:
    """The training backward's peak: at the head, the first layer or the last layer.

    A gradient that meets an existing .grad is made whole, then added: a transient the size of the
    tensor. The largest is the embedding: at the head when gradients accumulate, and at the
    embedding lookup when the head and the embedding are tied -- unless the offloaded optimizer
    split them (the head's contribution is on the host by then; the sum is made there)."""
    cfg, arch = sizes.cfg, sizes.arch
    offload = cfg.optim.offload_optimizer
    new_grad = sizes.weight_bytes * max(arch.tensor_sizes)
    tied_sum_on_device = arch.tied and not offload
    worst = _largest([{"gradients": grads.at_head + grads.head_sum + (new_grad if grads.before else 0),
                       "activations": acts.backward_head, "loss head": sizes.head_bytes(sizes.train, backward=True)},
                      {"gradients": grads.at_head, "activations": acts.backward_first},
                      {"gradients": grads.at_end + (new_grad if (tied_sum_on_device or grads.before) else 0),
                       "activations": acts.backward_last}]
                     + ([{"gradients": grads.at_head,  # a layer-major step's lookups: every micro-batch's
                          "activations": (cfg.train.gradient_accumulation_steps + 1) * sizes.layer_input_bytes}]
                        if sizes.layer_major else []))  # gradient at the first layer, and one lookup's output
    found = {**sizes.resident(), **sizes.streamed_layers(backward=True), **worst}
    if cfg.train.optimizer_in_backward and not offload:  # each tensor's update runs as its gradient is ready
        found["optimizer states"] += optimizer_step_bytes(cfg, arch, sizes.device, one_tensor=True)
    return found


def optimizer_phase(sizes: StepSizes, grads: GradientBytes) -> Optional[dict]:
    """The optimizer step's peak; None where tensors update in backward, or on the host."""
    cfg = sizes.cfg
    if cfg.train.optimizer_in_backward or cfg.optim.offload_optimizer:
        return None
    found = {**sizes.resident(), "gradients": grads.whole}
    found["optimizer states"] += optimizer_step_bytes(cfg, sizes.arch, sizes.device)
    return found


def generation_bytes(sizes: StepSizes, rows: int, micro_batch: int) -> int:
    """Generation's memory for `rows` rows at once, all under "KV cache" as the profiler counts it: the
    cache, the prefill's transient or the sampling logits, the bf16 weight copies under autocast (its
    cache holds them in no-grad passes too; the compiled step holds its own instead: static_decode.py),
    and the compiled step's CUDA graphs."""
    from ..policy.static_decode import SPARE_COLUMNS  # the static buffers' columns past the length
    cfg, arch, costs, device = sizes.cfg, sizes.arch, sizes.costs, sizes.device
    cache_rows = generation_cache_rows(cfg, rows, micro_batch, device)
    spare = SPARE_COLUMNS if compiled_decode(cfg, device) else 0
    sequence = cfg.generation.max_prompt_length + cfg.generation.max_completion_length
    cache = cache_rows * (sequence + spare) * arch.layers * costs.kv_cache
    prefill = rows * cfg.generation.max_prompt_length * (costs.no_grad_peak - costs.kv_cache)  # one layer's
    logits = GENERATION_LOGIT_BUFFERS * 4 * rows * arch.vocab
    graphs = decode_graph_bytes(cfg, cache_rows, arch, sizes.compute_bytes, device)
    head_copy = 2 * arch.vocab * arch.hidden if sizes.layer_cast_bytes else 0  # the output head's bf16 copy
    return cache + graphs + max(prefill, logits) + arch.layers * sizes.layer_cast_bytes + head_copy


def logprob_pass_bytes(sizes: StepSizes) -> tuple[float, int]:
    """(activations, loss head) of a log-prob pass outside the loss: a no-grad forward of a micro-batch (one
    layer's transient, or the final norm's saves), then the head's forward."""
    shape, costs = sizes.logprob, sizes.costs
    activations = shape.mask_bytes + shape.positions * sizes.arch.hidden * sizes.weight_bytes + max(
        (costs.no_grad_peak - costs.kv_cache) * shape.positions + shape.mask_call_bytes,
        costs.norm_saved * shape.positions)
    return activations, sizes.head_bytes(shape, backward=False)


def logprob_phases(sizes: StepSizes) -> dict[str, dict]:
    """The old and reference log-prob passes the run makes, by phase name."""
    cfg, arch = sizes.cfg, sizes.arch
    train, resident = cfg.train, sizes.resident()
    activations, head = logprob_pass_bytes(sizes)
    found = {}
    sampler = rollout_sampler(cfg.generation)
    if old_logprob_pass(cfg):
        found["old log-probs"] = {**resident, "activations": activations + arch.layers * sizes.layer_cast_bytes,
                                  "loss head": head}
        if sizes.streams_weights:  # layer-major, as the streamed reference's: the rows wait at each layer
            found["old log-probs"]["activations"] += waiting_at_each_layer(sizes)
            found["old log-probs"].update(sizes.streamed_layers())
    if sampler == "compact":  # the copy's log-probs of what it sampled, a layer's weight dequantized at a time
        dequantized = sizes.compute_bytes * arch.hidden * max(arch.intermediate, arch.heads * arch.head_dim)
        found["sampler log-probs"] = {**resident, **sizes.rollout_copy(), "activations": activations + dequantized,
                                      "loss head": head}
    if train.beta > 0:
        found["reference log-probs"] = reference = {**resident}
        if sizes.device != "cpu" and train.reference_compute != "cpu":
            # streamed (auto on a GPU): the forward runs on the device, layer-major (policy/reference.py):
            # every micro-batch's hidden states, mask and rotary tables wait at each layer, and the head
            # scores every row. (A CPU run counts it as host.)
            shape, k = sizes.logprob, reference_stream_groups(cfg)[0]
            waiting = waiting_at_each_layer(sizes)
            every_row = shape._replace(completion_tokens=k * shape.completion_tokens)
            chunk = default_chunk_size(every_row.completion_tokens, arch.vocab, sizes.device)
            reference["reference buffers"] = (2 * arch.layer_params() * sizes.weight_bytes
                                              + chunk * arch.hidden * sizes.compute_bytes + activations + waiting
                                              + sizes.head_bytes(every_row, backward=False))
    return found


def table_in_host_ram(cfg: Config, arch: Arch) -> int:
    """Parameters of the input embedding's table that model.offload_weights keeps in host RAM and looks up
    there (an untied one: policy/streaming.py, host_table), or 0."""
    return arch.vocab * arch.hidden if cfg.model.offload_weights and not arch.tied else 0


def old_logprob_pass(cfg: Config) -> bool:
    """Whether the policy's no-grad log-prob pass runs over each generation batch: the loss needs old
    log-probs, or the importance-sampling correction divides by the sampler's (vLLM, the compact copy)."""
    sampler = rollout_sampler(cfg.generation)
    correction = sampler != "native" and importance_sampling_correction(cfg.train, sampler)
    return batch_plan(cfg).needs_old_logprobs or correction


def waiting_at_each_layer(sizes: StepSizes) -> int:
    """A streamed layer-major no-grad pass: the other micro-batches of a group (reference_stream_rows) wait at
    each layer with their hidden states, mask and rotary tables."""
    shape, k = sizes.logprob, reference_stream_groups(sizes.cfg)[0]
    return (k - 1) * (shape.mask_bytes + shape.positions * (sizes.arch.hidden + 2 * sizes.arch.head_dim)
                      * sizes.weight_bytes)


def reference_micro_batches(cfg: Config) -> int:
    """Micro-batches of one reference pass: the generation batch in logprob_micro_batch_size rows."""
    return math.ceil(batch_plan(cfg).generation_batch_size / cfg.train.logprob_rows)


def reference_stream_groups(cfg: Config) -> tuple[int, int]:
    """(micro-batches that go through a streamed layer together, times the weights cross per generation
    batch): train.reference_stream_rows in whole log-prob micro-batches (policy/reference.py)."""
    t, total = cfg.train, reference_micro_batches(cfg)
    rows = t.reference_stream_rows or batch_plan(cfg).generation_batch_size
    together = min(total, max(1, rows // t.logprob_rows))
    return together, math.ceil(total / together)


def plan(cfg: Config, arch: Arch, autocast: Optional[bool] = None, device: str = "cuda",
         rewards: Optional[list] = None, reward_placement: Optional[str] = None,
         card_bytes: Optional[int] = None, world_size: int = 1) -> MemoryPlan:
    """Predicted device bytes per phase, and per category at each phase's peak, for `cfg` on `arch`.

    `autocast`: whether bf16 autocast is on; None resolves model.bf16 as on an Ampere+ GPU (None = on).
    `device`: "cuda" (what the planner is for), or "cpu" to compare with a CPU run, where the fused
    head runs its torch fallback and bitsandbytes its CPU update. `rewards`: the reward models'
    shapes (reward_plan.RewardArch; default: read from rewards.reward_funcs), placed as
    rewards.model_placement says unless `reward_placement` overrides it. `card_bytes`: the card's memory, of which
    generation.engine=vllm takes its share (vllm_plan.py; None: the share it needs for a whole batch).
    `world_size`: the processes of the run (a layer-major backward runs in one only).
    """
    autocast = cfg.model.bf16 is not False if autocast is None else autocast
    sizes = StepSizes.of(cfg, arch, autocast, device, world_size)
    vllm = vllm_plan.uses_vllm(cfg)  # vLLM samples: the trainer makes no KV cache (vLLM's share is added below)
    generation_rows = min(cfg.generation.generation_micro_batch_size, batch_plan(cfg).generation_batch_size)
    phases = {"rollout": {**sizes.resident()} if vllm else
              {**sizes.resident(), **sizes.rollout_copy(),
               "KV cache": generation_bytes(sizes, generation_rows, cfg.generation.generation_micro_batch_size)}}
    rewards = reward_plan.reward_archs(cfg) if rewards is None else rewards
    where = reward_placement or reward_plan.placement(cfg, device)
    resident_rewards, scoring = reward_plan.device_bytes(cfg, rewards, where)
    if scoring:  # between the rollout and the loss: the policy's resident state and one scoring forward
        phases["rewards"] = {**sizes.resident(), **scoring}
    phases.update(logprob_phases(sizes))
    grads, acts = gradient_bytes(sizes), activation_bytes(sizes)
    phases["forward"], phases["backward"] = forward_phase(sizes, grads, acts), backward_phase(sizes, grads, acts)
    optimizer = optimizer_phase(sizes, grads)
    if optimizer is not None:
        phases["optimizer"] = optimizer
    rows = evaluation_rows(cfg)
    if rows:  # between steps: the gradients are gone (zero_grad(set_to_none)), weights and states stay
        evaluation = generation_bytes(sizes, rows, cfg.eval.eval_batch_size)
        phases["evaluation"] = {**sizes.resident(), **sizes.rollout_copy(), "KV cache": evaluation}
    if resident_rewards:  # gpu-placed reward models: their weights, all run
        phases = {p: {**cats, "reward model": resident_rewards} for p, cats in phases.items()}
    vllm_entry = vllm_plan.summary(cfg, vllm_plan.need(cfg, arch, autocast, device), card_bytes) if vllm else None
    if vllm and device != "cpu":  # vLLM's share of the card, taken at start-up and kept all run
        phases = {p: {**cats, "vLLM": vllm_entry["share_bytes"]} for p, cats in phases.items()}
    host, pinned = host_ram(sizes, rewards, where)
    return MemoryPlan({p: {c: int(v) for c, v in cats.items()} for p, cats in phases.items()}, host, pinned,
                      vllm_entry)


def host_ram(sizes: StepSizes, rewards: list, where: str) -> tuple[dict[str, int], list[str]]:
    """(host RAM per category, the pinned categories) of plan(): host_categories() with the offloaded
    activations, the reward models and vLLM on a CPU."""
    cfg, arch, device = sizes.cfg, sizes.arch, sizes.device
    # a layer-major backward keeps every micro-batch's layer inputs (training/layer_inputs.py)
    inputs_kept = cfg.train.gradient_accumulation_steps if sizes.layer_major else 1
    offloaded = (inputs_kept * sizes.kept_layer_inputs() * sizes.layer_input_bytes
                 + sizes.costs.norm_offloaded * sizes.train.positions if sizes.offloads_activations else 0)
    host = host_categories(cfg, arch, offloaded, device, gradients_once=sizes.layer_major and sizes.head_once)
    pinned = [c for c in pinned_host_categories(cfg, device) if c in host]
    if reward_plan.host_bytes(rewards, where, device):
        host["reward models"] = reward_plan.host_bytes(rewards, where, device)
        pinned += ["reward models"] if where == "stream" and device != "cpu" else []
    if vllm_plan.uses_vllm(cfg) and device == "cpu":
        host["vLLM"] = vllm_plan.host_bytes(cfg, arch)
    elif (packs := planned_packing(cfg.generation)) and device == "cpu" and not compiled_decode(cfg, device):
        host["packed decode weights"] = packed_decode_bytes(arch, sizes.compute_bytes, packs)
    return host, pinned


def activations_offloaded(cfg: Config, layer_io: int) -> bool:
    """Whether model.offload_activations moves the layer inputs (`layer_io` bytes each, one micro-batch's):
    it leaves saved tensors under its minimum size where they are (training/activation_offload.py).
    The final norm's saves are at least a layer input's size, so they go with them (not counted: its fp32
    ones alone moving, when a layer input is between half the minimum and the minimum)."""
    return cfg.model.offload_activations and cfg.model.gradient_checkpointing and layer_io >= MIN_BYTES


def compiled_decode(cfg: Config, device: str = "cuda") -> bool:
    """Whether generation decodes with the compiled static step (generation.compile_decode; auto: on CUDA)."""
    setting = cfg.generation.compile_decode
    return (setting is True or (setting == "auto" and device != "cpu")) and cfg.generation.fast_rollout


def generation_cache_rows(cfg: Config, rows: int, micro_batch: int, device: str = "cuda") -> int:
    """Rows of KV cache a generation call holds for `rows` rows decoding at once (at most `micro_batch`): those
    rows, growing with the completions (the dynamic step, the planner counts them grown to the length limit),
    or with the compiled static step the smallest batch-size bucket that holds them, preallocated whole at
    the length limit (policy/static_decode.py)."""
    from ..policy.static_decode import bucket_for
    return bucket_for(rows, micro_batch) if compiled_decode(cfg, device) else rows


def decode_graph_bytes(cfg: Config, cache_rows: int, arch: Arch, compute_bytes: int,
                       device: str = "cuda") -> int:
    """The compiled step's CUDA graphs while a rollout decodes with `cache_rows` rows of cache
    (policy/decode_graphs.py): their static logits buffer, (rows, V) fp32, and their memory pool, about the
    largest bucket's step transients, its (rows, V) logits in the compute dtype. Both go when the rollout
    ends; 0 off CUDA."""
    if device != "cuda" or not compiled_decode(cfg, device):
        return 0
    return (4 + compute_bytes) * cache_rows * arch.vocab


def evaluation_rows(cfg: Config) -> int:
    """Rows one greedy generate() call of evaluation decodes at once (training/evaluate.py), 0 when the run
    has no held-out prompts (neither `train`'s evaluations nor `lowmem-grpo eval` can run then).

    eval.eval_batch_size rows, fewer when there are fewer prompts to evaluate (eval_max_samples, or
    eval_holdout when the held-out prompts are taken from the training file; an eval_file's length is
    not read: its prompts count as many)."""
    d, e = cfg.data, cfg.eval
    if not (d.eval_file or d.eval_holdout):
        return 0
    limits = [e.eval_batch_size] + [n for n in (e.eval_max_samples, None if d.eval_file else d.eval_holdout) if n]
    return min(limits)


# What the allocator does not show, added to the allocator-view peak before comparing with a card:
# the CUDA context (~0.3-0.5 GiB with lazy module loading on CUDA 12), cuBLAS/cuDNN workspaces and
# allocator fragmentation. A stated estimate, not yet fitted to GPU runs (the planner's accuracy
# table will do that): 0.5 GiB + 5% of the allocator peak.
CONTEXT_BYTES = GiB // 2
FRAGMENTATION = 0.05


def margin_bytes(peak: int) -> int:
    return int(CONTEXT_BYTES + FRAGMENTATION * peak)
