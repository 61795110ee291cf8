"""Device-memory accounting of a GRPO step from a model config and the run's settings (no weights).

`plan(cfg)` gives each phase's peak (rollout, old log-probs, reference log-probs, forward, backward,
optimizer, evaluation) as the sum of the categories alive at its worst moment: weights, optimizer states,
gradients, activations (per token and layer, measured by layer_probe.py), loss head, KV cache, reference
buffers. The peak is the largest phase, in the allocator's view: CUDA context, cuBLAS workspace and
fragmentation come on top (`margin_bytes`). `host_categories` counts the host RAM the run keeps on purpose
(reference model, offloaded optimizer, offloaded activations) and `pinned_host_categories` the page-locked
part of it, with the same arithmetic as the code that allocates it (host_arena.py `arena_bytes`).
When a run does not fit, the suggestions (`SUGGESTIONS`) name the cheapest settings that would.

Design notes: docs/planner.md (what each category counts, phase by phase)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from ..config import Config, ConfigError, batch_plan, importance_sampling_correction
from ..host_arena import arena_bytes, round_up
from ..kernels.linear import default_chunk_size
from ..kernels.logprobs import _rows_per_chunk  # the CPU fallback's row chunk: its bound, read, not restated
from ..training.activation_offload import MIN_BYTES
from ..optim.offload import staging_bytes
from ..optim.optimizers import BNB_BLOCK, BNB_MIN_8BIT, optimizer_state_bytes  # noqa: F401 (also ours)
from . import reward_plan, vllm_plan
from .layer_probe import layer_costs

GiB = 2**30
GENERATION_LOGIT_BUFFERS = 6  # last-position logits (fp32), processed scores, probabilities, top-p sort + indices


@dataclass
class Arch:
    """The shapes that memory depends on, read from a transformers config."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    tensor_sizes: list[int] = field(default_factory=list)  # numel of every parameter tensor (tied once)
    config: dict = field(default_factory=dict)  # the transformers config (for the layer probe)

    @classmethod
    def from_config(cls, conf) -> "Arch":
        """From a transformers PretrainedConfig (or a dict with model_type)."""
        if isinstance(conf, dict):
            from transformers import AutoConfig
            conf = dict(conf)
            conf = AutoConfig.for_model(conf.pop("model_type"), **conf)
        from transformers import AutoModelForCausalLM
        with torch.device("meta"):  # shapes only: no memory, no weights
            model = AutoModelForCausalLM.from_config(conf)
        sizes = [p.numel() for p in model.parameters()]  # parameters() yields a tied weight once
        missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
                   if not isinstance(getattr(conf, k, None), int)]
        if missing:
            raise ConfigError(f"the planner reads decoder-only configs of the Llama/Qwen family; this "
                              f"{conf.model_type} config has no {', '.join(missing)}")
        head_dim = getattr(conf, "head_dim", None) or conf.hidden_size // conf.num_attention_heads
        return cls(conf.vocab_size, conf.hidden_size, conf.intermediate_size, conf.num_hidden_layers,
                   conf.num_attention_heads, getattr(conf, "num_key_value_heads", conf.num_attention_heads),
                   head_dim, bool(getattr(conf, "tie_word_embeddings", False)), sizes, conf.to_dict())

    @property
    def params(self) -> int:
        return sum(self.tensor_sizes)

    def layer_params(self) -> int:
        attn = self.hidden * (self.heads * self.head_dim) * 2 + self.hidden * (self.kv_heads * self.head_dim) * 2
        return attn + 3 * self.hidden * self.intermediate + 2 * self.hidden


def loss_head_bytes(n: int, arch: Arch, compute_bytes: int, weight_bytes: int, backward: bool, device: str) -> int:
    """The fused head's memory for n completion tokens (lowmem_grpo/kernels/linear.py), beyond its inputs."""
    chunk = default_chunk_size(n, arch.vocab)
    total = n * chunk * compute_bytes + n * arch.hidden * compute_bytes  # workspace + hidden in compute dtype
    if compute_bytes != weight_bytes:
        total += chunk * arch.hidden * compute_bytes  # one weight slice cast per GEMM
    if backward:
        total += 4 * n * arch.hidden  # fp32 d hidden accumulator
    if device == "cpu":  # the torch fallback: fp32 copies of row chunks of the slice (lowmem_grpo/kernels/logprobs.py):
        # three in the forward (the entropy's two and logsumexp's transient); one in the backward, which
        # writes the gradient into the chunk's own copy (the loss puts no gradient on the entropy)
        rows = min(n, _rows_per_chunk(chunk))
        total += (1 if backward else 3) * 4 * rows * chunk
    return total


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


def plan(cfg: Config, arch: Arch, autocast: Optional[bool] = None, device: str = "cuda",
         rewards: Optional[list] = None, reward_placement: Optional[str] = None,
         card_bytes: Optional[int] = None) -> dict:
    """Predicted device bytes per phase, and per category at each phase's peak, for `cfg` on `arch`.

    `autocast`: whether bf16 autocast is on; None resolves model.bf16 as on an Ampere+ GPU (None = on).
    `device`: "cuda" (what the planner is for), or "cpu" to compare with a CPU run, where the fused
    head runs its torch fallback and bitsandbytes its CPU update. `rewards`: the reward models'
    shapes (reward_plan.RewardArch; default: read from rewards.reward_funcs), placed as
    rewards.model_placement says unless `reward_placement` overrides it. `card_bytes`: the card's memory, of which
    generation.engine=vllm takes its share (vllm_plan.py; None: the share it needs for a whole batch).
    """
    g, t, m = cfg.generation, cfg.train, cfg.model
    wb = 2 if m.precision == "bf16_sr" else 4  # weight (and gradient, and residual stream) bytes
    if autocast is None:
        autocast = m.bf16 is not False
    ab = 2 if (wb == 2 or autocast) else 4  # what matmuls output: the loss head's compute dtype
    costs = layer_costs(arch.config, torch.bfloat16 if wb == 2 else torch.float32, autocast)
    H, layers = arch.hidden, arch.layers
    b, seq = t.per_device_train_batch_size, g.max_prompt_length + g.max_completion_length
    mb_lp = t.logprob_micro_batch_size or b
    # positions (shared-prompt packing runs fewer), the attention mask held, sdpa's copy made per attention call
    T, mask, mask_call = decoder_positions(cfg, arch, b, ab)
    T_lp, mask_lp, mask_call_lp = decoder_positions(cfg, arch, mb_lp, ab)
    n, n_lp = b * g.max_completion_length, mb_lp * g.max_completion_length
    batches = batch_plan(cfg)
    gen_b = min(g.generation_micro_batch_size, batches.generation_batch_size)

    weights = wb * arch.params
    offload = cfg.optim.offload_optimizer
    states = optimizer_state_bytes(arch.tensor_sizes, cfg.optim.optimizer, wb)
    base = {"weights": weights, "optimizer states": 0 if offload else states}
    grads_all = wb * arch.params
    head_grad = wb * arch.vocab * H  # the output head's gradient: the first one backward makes
    if t.optimizer_in_backward or offload:  # only the tensors alive at once: the tied embedding + the largest other
        # (offloaded: every micro-batch's gradients go to the host from the hooks, accumulated or not)
        embedding = arch.vocab * H
        others = sorted((s for s in arch.tensor_sizes if s != embedding), reverse=True)
        grads_before = 0
        grads_head = grads_end = wb * ((embedding if arch.tied else 0) + (others[0] if others else 0))
        if device == "cuda":  # gradients held while their norms reach the host (optimizer_in_backward.py)
            from ..optim.optimizer_in_backward import LAG_BYTES
            lag = min(LAG_BYTES, grads_all)
            grads_head, grads_end = grads_head + lag, grads_end + lag
    else:  # after the first micro-batch of an accumulation, every gradient exists before backward starts
        grads_before = grads_all if t.gradient_accumulation_steps > 1 else 0
        grads_head, grads_end = max(grads_before, head_grad), grads_all
    casts = 2 * arch.layer_params() if (autocast and wb == 4) else 0  # autocast's bf16 copy of one layer's weights

    head_fwd = loss_head_bytes(n, arch, ab, wb, False, device)
    head_bwd = loss_head_bytes(n, arch, ab, wb, True, device)
    layer_io = T * H * wb  # one layer input (the residual stream is in the weight dtype)
    offloading = activations_offloaded(cfg, layer_io)
    # the final norm's saves; under activation offload only its output stays (the rest is host RAM)
    norm = (costs.norm_left_offloaded if offloading else costs.norm_saved) * T
    # Backward runs from the head down: activations fall layer by layer while gradients grow, so the
    # peak is at the start (head, then first layer) or at the end (last layer, every gradient made).
    if m.gradient_checkpointing:
        kept = 0 if offloading else layers * layer_io  # the layer inputs
        # A checkpointed layer's forward saves nothing inside (checkpoint's hooks drop it): a no-grad
        # forward's transient, beside its input (one of `kept`, or the one on its way to the host).
        fwd_layer = (layer_io if offloading else 0) + (costs.no_grad_peak - costs.kv_cache) * T + mask_call
        # one layer recomputed (with its mask copy), then its backward
        recompute = casts + (costs.saved + costs.backward_peak) * T + mask_call
        fwd_layers, fwd_head = kept + fwd_layer, kept + norm
        bwd_head, bwd_first, bwd_last = kept + norm, kept + recompute, layer_io + recompute
        if offloading:  # the next layer's input, prefetched during this layer's backward
            bwd_first += layer_io
    else:  # every layer keeps what it saved, its mask copy included
        saved = layers * (costs.saved * T + mask_call)
        fwd_layers, fwd_head = saved + (costs.forward_peak - costs.saved) * T, saved + norm
        bwd_head = saved + norm + layers * casts
        bwd_first = saved + layers * casts + costs.backward_peak * T
        bwd_last = costs.saved * T + mask_call + casts + costs.backward_peak * T
    fwd_layers, fwd_head, bwd_head, bwd_first, bwd_last = (
        x + mask for x in (fwd_layers, fwd_head, bwd_head, bwd_first, bwd_last))  # the mask lives all step
    total = lambda d: sum(d.values())  # noqa: E731
    forward = max([{"gradients": grads_before, "activations": fwd_layers + layers * casts},
                   {"gradients": grads_before, "activations": fwd_head + layers * casts, "loss head": head_fwd}],
                  key=total)
    in_backward_step = (optimizer_step_bytes(cfg, arch, device, one_tensor=True)
                        if t.optimizer_in_backward and not offload else 0)
    # A gradient that meets an existing .grad is made whole, then added: a transient the size of the
    # tensor. The largest is the embedding: at the head when gradients accumulate, and at the
    # embedding lookup when the head and the embedding are tied -- unless the offloaded optimizer
    # split them (the head's contribution is on the host by then; the sum is made there).
    new_grad = wb * max(arch.tensor_sizes)
    tied_sum_on_device = arch.tied and not offload
    backward = max([{"gradients": grads_head + (new_grad if grads_before else 0), "activations": bwd_head,
                     "loss head": head_bwd},
                    {"gradients": grads_head, "activations": bwd_first},
                    {"gradients": grads_end + (new_grad if (tied_sum_on_device or grads_before) else 0),
                     "activations": bwd_last}], key=total)
    forward, backward = {**base, **forward}, {**base, **backward}
    backward["optimizer states"] += in_backward_step  # each tensor's update runs as its gradient is ready

    def generation(rows: int, micro_batch: int) -> int:
        """Generation's memory for `rows` rows at once, all under "KV cache" as the profiler counts it: the
        cache, the prefill's transient or the sampling logits, the bf16 weight copies under autocast (its
        cache holds them in no-grad passes too; the compiled step holds its own instead: static_decode.py),
        and the compiled step's CUDA graphs."""
        cache_rows = generation_cache_rows(cfg, rows, micro_batch, device)
        from ..policy.static_decode import SPARE_COLUMNS  # the static buffers' columns past the length
        spare = SPARE_COLUMNS if compiled_decode(cfg, device) else 0
        kv = cache_rows * (seq + spare) * layers * costs.kv_cache
        prefill = rows * g.max_prompt_length * (costs.no_grad_peak - costs.kv_cache)  # one layer's transient
        logits = GENERATION_LOGIT_BUFFERS * 4 * rows * arch.vocab
        graphs = decode_graph_bytes(cfg, cache_rows, arch, ab, device)
        head_copy = 2 * arch.vocab * H if casts else 0  # the output head's bf16 copy (the tied one's too)
        return kv + graphs + max(prefill, logits) + layers * casts + head_copy

    vllm = vllm_plan.uses_vllm(cfg)  # vLLM samples: the trainer makes no KV cache (vLLM's share is added below)
    phases = {"rollout": {**base} if vllm else {**base, "KV cache": generation(gen_b, g.generation_micro_batch_size)}}
    rewards = reward_plan.reward_archs(cfg) if rewards is None else rewards
    where = reward_placement or reward_plan.placement(cfg, device)
    resident, scoring = reward_plan.device_bytes(cfg, rewards, where)
    if scoring:  # between the rollout and the loss: the policy's resident state and one scoring forward
        phases["rewards"] = {**base, **scoring}
    # A log-prob pass: no-grad forward of a micro-batch (one layer's transient), then the head forward.
    lp_activations = mask_lp + T_lp * H * wb + max((costs.no_grad_peak - costs.kv_cache) * T_lp + mask_call_lp,
                                                   costs.norm_saved * T_lp)
    lp_head = loss_head_bytes(n_lp, arch, ab, wb, False, device)
    if batches.needs_old_logprobs or (vllm and importance_sampling_correction(t, "vllm")):  # (the correction's pass)
        phases["old log-probs"] = {**base, "activations": lp_activations + layers * casts, "loss head": lp_head}
    if t.beta > 0:
        ref = {**base}
        if device != "cpu" and t.reference_compute != "cpu":
            # streamed (auto on a GPU): the forward runs on the device. (A CPU run counts it as host.)
            chunk = default_chunk_size(n_lp, arch.vocab)
            ref["reference buffers"] = 2 * arch.layer_params() * wb + chunk * H * ab + lp_activations + lp_head
        phases["reference log-probs"] = ref
    phases["forward"], phases["backward"] = forward, backward
    if not (t.optimizer_in_backward or offload):  # (those update tensor by tensor, or on the host)
        phases["optimizer"] = {**base, "gradients": grads_all}
        phases["optimizer"]["optimizer states"] += optimizer_step_bytes(cfg, arch, device)
    rows = evaluation_rows(cfg)
    if rows:  # between steps: the gradients are gone (zero_grad(set_to_none)), weights and states stay
        phases["evaluation"] = {**base, "KV cache": generation(rows, cfg.eval.eval_batch_size)}
    if resident:  # gpu-placed reward models: their weights, all run
        phases = {p: {**cats, "reward model": resident} for p, cats in phases.items()}
    vllm_entry = vllm_plan.summary(cfg, vllm_plan.need(cfg, arch, autocast, device), card_bytes) if vllm else None
    if vllm and device != "cpu":  # vLLM's share of the card, taken at start-up and kept all run
        phases = {p: {**cats, "vLLM": vllm_entry["share_bytes"]} for p, cats in phases.items()}
    phase_categories = {p: {c: int(v) for c, v in cats.items()} for p, cats in phases.items()}
    phase_totals = {p: sum(cats.values()) for p, cats in phase_categories.items()}
    peak_phase = max(phase_totals, key=phase_totals.get)
    host = host_categories(cfg, arch, layers * layer_io + costs.norm_offloaded * T if offloading else 0, device)
    pinned = [c for c in pinned_host_categories(cfg, device) if c in host]
    if reward_plan.host_bytes(rewards, where, device):
        host["reward models"] = reward_plan.host_bytes(rewards, where, device)
        pinned += ["reward models"] if where == "stream" and device != "cpu" else []
    if vllm and device == "cpu":
        host["vLLM"] = vllm_plan.host_bytes(cfg, arch)
    return {"vllm": vllm_entry, "categories": phase_categories[peak_phase], "phases": phase_totals,
            "phase_categories": phase_categories,
            "peak_bytes": phase_totals[peak_phase], "peak_phase": peak_phase,
            "host_categories": host, "host_bytes": sum(host.values()),
            "host_pinned": pinned, "host_pinned_bytes": sum(host[c] for c in pinned)}


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


def host_categories(cfg: Config, arch: Arch, offloaded_activations: int = 0, device: str = "cuda") -> dict:
    """Host RAM the run keeps on purpose, per category (module docstring).

    The offloaded optimizer's weight copy (unless fp32 masters) and gradient buffer are one block of
    host memory laid out as host_arena.py lays it out, its alignment and page rounding
    included, and the tied head's buffer another: the two categories sum to the bytes the run pins,
    to the byte (tests/memory/test_host_ram_plan.py checks it against the real optimizer). The
    streamed reference model on a GPU is one block too (policy/reference.py)."""
    wb = 2 if cfg.model.precision == "bf16_sr" else 4
    host = {}
    if cfg.train.beta > 0:
        streamed = device != "cpu" and cfg.train.reference_compute != "cpu"  # auto streams on a GPU
        host["reference model"] = arena_bytes(wb * n for n in arch.tensor_sizes) if streamed else wb * arch.params
    if cfg.optim.offload_optimizer:  # torch AdamW steps fp32 masters (optim/offload.py)
        master = 4 if cfg.optim.optimizer == "adamw" else wb
        host["optimizer states"] = optimizer_state_bytes(arch.tensor_sizes, cfg.optim.optimizer, master)
        copies = [wb * n for n in arch.tensor_sizes] if master == wb else []  # in the block, in its order
        block = arena_bytes(copies + [wb * n for n in arch.tensor_sizes] + [4 * len(arch.tensor_sizes)])
        host["weights copy"] = sum(round_up(c) for c in copies) if copies else master * arch.params
        host["gradient buffer"] = block - (host["weights copy"] if copies else 0)  # + norm slots, page tail
        if arch.tied:  # the tied head's contribution, its own block
            host["gradient buffer"] += arena_bytes([wb * arch.vocab * arch.hidden])
        if cfg.train.gradient_accumulation_steps > 1:  # later micro-batches' gradients arrive there
            host["gradient buffer"] += staging_bytes()
    if offloaded_activations:
        host["activations (offloaded)"] = offloaded_activations
    return {k: int(v) for k, v in host.items()}


def pinned_host_categories(cfg: Config, device: str = "cuda") -> list[str]:
    """The host categories that are page-locked (they cannot swap): on a GPU, the buffers that cross PCIe
    asynchronously. The fp32 masters and the optimizer states are ordinary memory."""
    if device == "cpu":
        return []
    pinned = []
    if cfg.train.beta > 0 and cfg.train.reference_compute != "cpu":  # streamed: auto on a GPU
        pinned.append("reference model")
    if cfg.optim.offload_optimizer:  # the weight copy unless it is an fp32 master of bf16 weights
        master_of_bf16 = cfg.optim.optimizer == "adamw" and cfg.model.precision == "bf16_sr"
        pinned += ["gradient buffer"] if master_of_bf16 else ["weights copy", "gradient buffer"]
    if cfg.model.offload_activations:
        pinned.append("activations (offloaded)")
    return pinned


def format_plan(result: dict) -> str:
    """Categories (rows) at each phase's predicted peak (columns), GiB."""
    phases = list(result["phases"])
    short = {"old log-probs": "old-lp", "reference log-probs": "ref-lp", "evaluation": "eval"}
    cats = []
    for cat in (c for p in phases for c in result["phase_categories"][p]):
        if cat not in cats:
            cats.append(cat)
    lines = [f"{'GiB (predicted)':<20}" + "".join(f"{short.get(p, p):>10}" for p in phases)]
    for c in cats:
        lines.append(f"{c:<20}" + "".join(f"{result['phase_categories'][p].get(c, 0) / GiB:>10.3f}" for p in phases))
    lines.append(f"{'total':<20}" + "".join(f"{result['phases'][p] / GiB:>10.3f}" for p in phases))
    lines += ["", f"peak: {result['peak_bytes'] / GiB:.3f} GiB ({result['peak_phase']}), allocator view"]
    if result.get("host_categories"):
        parts = ", ".join(f"{k} {v / GiB:.3f}" for k, v in result["host_categories"].items())
        lines.append(f"host RAM: {result['host_bytes'] / GiB:.3f} GiB ({parts}), plus the Python process")
        pinned = result.get("host_pinned_bytes", 0)
        lines.append(f"  pinned (page-locked, cannot swap): {pinned / GiB:.3f} GiB"
                     + (f" ({', '.join(result['host_pinned'])})" if pinned else "")
                     + f"; not pinned: {(result['host_bytes'] - pinned) / GiB:.3f} GiB")
    return "\n".join(lines)


# What the allocator does not show, added to the allocator-view peak before comparing with a card:
# the CUDA context (~0.3-0.5 GiB with lazy module loading on CUDA 12), cuBLAS/cuDNN workspaces and
# allocator fragmentation. A stated estimate, not yet fitted to GPU runs (the planner's accuracy
# table will do that): 0.5 GiB + 5% of the allocator peak.
CONTEXT_BYTES = GiB // 2
FRAGMENTATION = 0.05


def margin_bytes(peak: int) -> int:
    return int(CONTEXT_BYTES + FRAGMENTATION * peak)


# Changes the planner may suggest, cheapest first (cost to training quality/speed, not bytes):
# evaluation's own batch (costs evaluation time only), memory-only switches, then switches that cost
# time, then ones that change the algorithm's batch.
# Each reads the config it is applied to (so they compose) and returns the changes as
# {(section, key): value}, or None where it does not apply.
def _smaller_eval_batch(c: Config):
    """Evaluation decodes eval_batch_size held-out prompts at once (TRL: per_device_eval_batch_size): down to
    the rollout's generation micro-batch, then by halves (to 8)."""
    rows, gen_b = evaluation_rows(c), min(c.generation.generation_micro_batch_size, batch_plan(c).generation_batch_size)
    if rows > gen_b:
        return {("eval", "eval_batch_size"): gen_b}
    return {("eval", "eval_batch_size"): rows // 2} if rows > 8 else None


def _reference_on_cpu(c: Config):
    return {("train", "reference_compute"): "cpu"} if c.train.beta > 0 and c.train.reference_compute == "auto" else None


def _optimizer_in_backward(c: Config):
    if c.train.optimizer_in_backward or c.optim.offload_optimizer:  # (offloaded: no full gradient on the device)
        return None
    micro = batch_plan(c).micro_batches_per_generation  # the same generation batch, one step per micro-batch
    return {("train", "optimizer_in_backward"): True, ("train", "gradient_accumulation_steps"): 1,
            ("train", "steps_per_generation"): micro, ("train", "generation_batch_size"): None}


def _bf16_sr(c: Config):
    return {("model", "precision"): "bf16_sr"} if c.model.precision != "bf16_sr" else None


def _checkpointing_or_offload(c: Config):
    if not c.model.gradient_checkpointing:
        return {("model", "gradient_checkpointing"): True}
    return {("model", "offload_activations"): True} if not c.model.offload_activations else None


def _offload_optimizer(c: Config):
    """Optimizer states to host RAM (gradients sent down from backward hooks and summed there, so gradient
    accumulation stays as it is)."""
    if c.optim.offload_optimizer:
        return None
    edits = {("optim", "offload_optimizer"): True}
    if c.optim.optimizer == "paged_adamw_8bit":
        edits[("optim", "optimizer")] = "adamw_8bit"
    return edits


def _native_engine(c: Config):
    """The native rollout on the trained weights: no second copy of them, no vLLM share."""
    if not vllm_plan.uses_vllm(c):
        return None
    return {("generation", "engine"): "native", ("generation", "use_vllm"): None}


def _smaller_generation_micro_batch(c: Config):
    gen_b = min(c.generation.generation_micro_batch_size, batch_plan(c).generation_batch_size)
    return {("generation", "generation_micro_batch_size"): gen_b // 2} if gen_b > 8 else None


def _half_micro_batch(c: Config):
    """Half the micro-batch, twice as many of them: the same generation batch and optimizer step."""
    t = c.train
    if t.per_device_train_batch_size < 2 or t.per_device_train_batch_size % 2:
        return None
    micro = batch_plan(c).micro_batches_per_generation * 2
    edits = {("train", "per_device_train_batch_size"): t.per_device_train_batch_size // 2}
    if t.generation_batch_size is None:
        edits[("train", "steps_per_generation")] = micro
    if not t.optimizer_in_backward or c.optim.offload_optimizer:  # (on-device in backward: a micro-batch is a step)
        edits[("train", "gradient_accumulation_steps")] = t.gradient_accumulation_steps * 2
    return edits


def _shorter_completions(c: Config):
    length = c.generation.max_completion_length
    return {("generation", "max_completion_length"): int(length * 0.75)} if length > 128 else None


SUGGESTIONS = (_smaller_eval_batch, _reference_on_cpu, _optimizer_in_backward, _bf16_sr, _checkpointing_or_offload,
               _offload_optimizer, _native_engine, _smaller_generation_micro_batch, _half_micro_batch,
               _shorter_completions)


def _apply(cfg: Config, edits: dict) -> Config:
    import copy
    new = copy.deepcopy(cfg)
    for (section, key), value in edits.items():
        setattr(getattr(new, section), key, value)
    return new


def _describe(edits: dict) -> str:
    text = " ".join(f"{key}={str(v).lower() if isinstance(v, bool) else v}" for (_, key), v in edits.items()
                    if v is not None)
    if ("model", "precision") in edits:
        text += " (bf16 weights, stochastic rounding; GPU sm_80+)"
    return text


def suggestions(cfg: Config, arch: Arch, budget: int, autocast: Optional[bool] = None,
                card_bytes: Optional[int] = None) -> list[dict]:
    """Single changes and a cumulative combination (cheapest first) with their predicted totals (and the
    host RAM each needs). `autocast` as for plan(); `card_bytes` (default `budget`): the card vLLM takes a
    share of, where generation.engine=vllm (first suggestion then: the share vLLM needs, where less)."""
    card_bytes = card_bytes or budget

    def predicted(c: Config) -> Optional[dict]:
        try:
            return plan(c, arch, autocast=autocast, card_bytes=card_bytes)
        except ConfigError:  # a change this config cannot take
            return None

    def entry(change: str, result: dict) -> dict:
        peak = result["peak_bytes"]
        total = peak + margin_bytes(peak)
        starts = not (result["vllm"] and result["vllm"]["problem"])
        return {"change": change, "peak_bytes": peak, "total_bytes": total, "fits": total <= budget and starts,
                "host_bytes": result["host_bytes"]}

    def vllm_share(c: Config):
        """vLLM's share down to what it needs for a whole batch (or to start), where that is less."""
        found = predicted(c) if vllm_plan.uses_vllm(c) else None
        if not (found and found["vllm"]):
            return None
        current, need = c.generation.vllm_gpu_memory_utilization, found["vllm"]
        wanted = [u for u in (need["whole_batch_utilization"], need["least_utilization"]) if u < current]
        return {("generation", "vllm_gpu_memory_utilization"): wanted[0]} if wanted else None

    def lowers_a_phase_over(before: dict, after: dict) -> bool:
        """Whether `after` lowers a phase of `before` that does not fit (not, e.g., a smaller evaluation
        batch where evaluation already fits)."""
        return any(after["phases"].get(p, 0) < v for p, v in before["phases"].items() if v + margin_bytes(v) > budget)

    out, current = [], plan(cfg, arch, autocast=autocast, card_bytes=card_bytes)
    options = (vllm_share,) + SUGGESTIONS
    for option in options:
        edits = option(cfg)
        result = predicted(_apply(cfg, edits)) if edits else None
        if result is not None and lowers_a_phase_over(current, result):
            out.append(entry(_describe(edits), result))
    combined, steps = cfg, []
    for option in options:  # apply cheapest-first until it fits
        edits = option(combined)
        result = predicted(_apply(combined, edits)) if edits else None
        if result is None or not lowers_a_phase_over(current, result):
            continue
        current = result
        combined = _apply(combined, edits)
        steps.append(_describe(edits))
        if entry("", result)["fits"]:
            if len(steps) > 1:
                out.append({**entry(" + ".join(steps), result), "combined": True})
            break
    return out
