"""Shared pieces of the loss-head benchmarks: shapes, inputs, the two implementations, a CPU memory tracker.

The head is Qwen2.5-1.5B's: H = 1536, V = 151936, bf16 weight (the tied embedding, requires_grad) and
bf16 hidden states (requires_grad). N tokens are shaped as B = N // 512 sequences of T = 512 tokens,
no padding (mask all ones), one advantage per sequence.

Both implementations compute the same GRPO loss: token-level ratio rho = exp(logp - logp.detach()),
clip eps 0.2, beta 0 (no KL), old_logp None, loss_type "dapo" (token sum / token count).
  ours   lowmem_grpo.kernels.linear_grpo_loss: vocabulary slices, no [N, V] tensor (on the CPU, the logits
         kept for the backward where they fit 256 MiB).
  naive  logits = hidden @ W.T in bf16, fp32 log_softmax, gather, the same loss in torch.

`cpu_peak_bytes` measures the peak of tensor bytes allocated during a call. It does not use
`torch.distributed._tools.mem_tracker.MemTracker`: that is a TorchDispatchMode, which sees a
`torch.library.custom_op` as a single op and none of the tensors the op allocates internally (our
[N, chunk] workspace and fp32 [N, H] accumulator). `check_tracker` shows both on a probe op.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import platform
from typing import Callable

import torch
from torch import Tensor

from lowmem_grpo.kernels import linear_grpo_loss

HIDDEN = 1536  # Qwen2.5-1.5B hidden size
VOCAB = 151936  # Qwen2.5 vocabulary
SEQ_LEN = 512  # tokens per sequence: N tokens = (N // 512) sequences x 512
EPSILON = 0.2
GiB = 2**30
MiB = 2**20


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def batch_shape(n_tokens: int) -> tuple[int, int]:
    """(B, T) for N tokens: sequences of SEQ_LEN tokens, or a single sequence when N < SEQ_LEN."""
    if n_tokens <= SEQ_LEN:
        return 1, n_tokens
    if n_tokens % SEQ_LEN:
        raise ValueError(f"--tokens must be a multiple of {SEQ_LEN} above {SEQ_LEN}, got {n_tokens}")
    return n_tokens // SEQ_LEN, SEQ_LEN


def make_inputs(n_tokens: int, device: str, *, hidden_size: int = HIDDEN, vocab: int = VOCAB,
                dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> dict[str, Tensor]:
    """Leaf tensors of one micro-batch; logits have a realistic scale (std ~ 2)."""
    B, T = batch_shape(n_tokens)
    g = torch.Generator(device="cpu").manual_seed(seed)
    hidden = torch.randn(B, T, hidden_size, generator=g).to(device, dtype)  # (B, T, H)
    weight = (torch.randn(vocab, hidden_size, generator=g) * (2.0 / hidden_size**0.5)).to(device, dtype)  # (V, H)
    ids = torch.randint(0, vocab, (B, T), generator=g).to(device)  # (B, T)
    advantages = torch.randn(B, generator=g).to(device)  # (B,) fp32, one per sequence
    return {"hidden": hidden.requires_grad_(), "weight": weight.requires_grad_(), "ids": ids,
            "advantages": advantages}


def ours_loss(hidden: Tensor, weight: Tensor, ids: Tensor, advantages: Tensor) -> Tensor:
    loss, _ = linear_grpo_loss(hidden, weight, ids, advantages, epsilon_low=EPSILON, beta=0.0, loss_type="dapo")
    return loss


def naive_loss(hidden: Tensor, weight: Tensor, ids: Tensor, advantages: Tensor) -> Tensor:
    """The unfused head as a trainer would write it; every [B, T, V] tensor is noted."""
    logits = hidden @ weight.T  # (B, T, V) bf16
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (B, T, V) fp32 copy, then (B, T, V) fp32 saved
    logp = logprobs.gather(-1, ids.unsqueeze(-1)).squeeze(-1)  # (B, T)
    A = advantages[:, None].float()  # (B, 1)
    rho = torch.exp(logp - logp.detach())  # (B, T), == 1 with gradient
    per_token = -torch.min(rho * A, rho.clamp(1 - EPSILON, 1 + EPSILON) * A)  # (B, T)
    return per_token.sum() / per_token.numel()  # dapo with a full mask


IMPLS: dict[str, Callable[..., Tensor]] = {"ours": ours_loss, "naive": naive_loss}


def forward_backward(fn: Callable[..., Tensor], inputs: dict[str, Tensor]) -> None:
    """One training step of the head: loss, backward into hidden.grad and weight.grad."""
    loss = fn(**inputs)
    loss.backward()


def clear_grads(inputs: dict[str, Tensor]) -> None:
    for t in inputs.values():
        t.grad = None
    gc.collect()


# ---- memory ---------------------------------------------------------------------------------


def cpu_memory_events(fn: Callable[[], object]) -> list[tuple[int, int]]:
    """(bytes, running total) of every CPU allocation (+) and free (-) while fn() runs, in order.

    The profiler's memory hook sits in c10's CPU allocator, below the dispatcher, so it sees every
    allocation of every op, including those made inside custom ops and by the autograd engine. The
    running total is the allocator's own count of bytes allocated while profiling, so the order in
    which events are stored does not matter for the peak. Blocks allocated before fn() (the inputs)
    are not counted, and their frees (if any) are not reported. Counted: everything from c10's CPU
    allocator (tensors, and oneDNN scratch buffers it takes from there); not counted: memory taken
    by other means (Python objects, library-internal mallocs).
    """
    from torch.profiler import ProfilerActivity, profile

    from lowmem_grpo.memory.track import cpu_running_totals

    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return cpu_running_totals(prof)


def cpu_peak_bytes(fn: Callable[[], object]) -> int:
    """Peak of CPU tensor bytes allocated while fn() runs, above what was allocated before it.

    Memory that outlives fn() (the gradients) is counted; the inputs that exist before are not.
    """
    events = cpu_memory_events(fn)
    if not events:
        return 0
    baseline = events[0][1] - events[0][0]
    return max(total for _, total in events) - baseline


def cuda_peak_bytes(fn: Callable[[], object]) -> int:
    """Peak of CUDA allocated bytes while fn() runs, minus what was allocated before it."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def peak_bytes(fn: Callable[[], object], device: str) -> int:
    return cuda_peak_bytes(fn) if device == "cuda" else cpu_peak_bytes(fn)


# ---- tracker self-check ---------------------------------------------------------------------


@functools.cache
def _probe_op():
    """A custom op x [n] -> x + 1 [n] that goes through an fp32 workspace never leaving the op."""

    @torch.library.custom_op("lowmem_grpo_bench::probe_workspace", mutates_args=())
    def probe(x: Tensor, workspace_numel: int) -> Tensor:
        workspace = torch.ones(workspace_numel, dtype=torch.float32, device=x.device)
        return x + workspace[: x.numel()]

    probe.register_fake(lambda x, workspace_numel: torch.empty_like(x))
    return probe


def _memtracker_peak(fn: Callable[[], object]) -> int:
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    with tracker:
        fn()
    return int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])


def check_tracker() -> bool:
    """Do the trackers see tensors allocated inside a custom op? Prints one line per case."""
    # 1. a probe custom op with a 64 MiB internal workspace and a 4 KiB output: the peak is exact
    probe, x = _probe_op(), torch.zeros(1024)
    numel = 16 * MiB
    expected = numel * 4 + x.numel() * 4
    ours = cpu_peak_bytes(lambda: probe(x, numel))
    theirs = _memtracker_peak(lambda: probe(x, numel))
    print(f"probe custom op with a 64 MiB internal workspace: expected peak {expected} B; "
          f"profiler tracker {ours} B; MemTracker {theirs} B")
    ok = ours == expected

    # 2. the fused head, small: its internal bf16 [N, chunk] workspace and fp32 [N, H] accumulator
    #    must show up as allocations of exactly those sizes, and the peak must include them
    from lowmem_grpo.kernels import linear_token_logprobs

    n, h, v, chunk = 384, 64, 4096, 1024
    inputs = make_inputs(n, "cpu", hidden_size=h, vocab=v)
    hidden = inputs["hidden"].detach().reshape(n, h).requires_grad_()  # (N, H) bf16
    weight, ids = inputs["weight"], inputs["ids"].reshape(n)  # (V, H) bf16, (N,)

    def step():
        linear_token_logprobs(hidden, weight, ids, chunk_size=chunk).sum().backward()

    workspace, accumulator = n * chunk * 2, n * h * 4
    outputs = v * h * 2 + n * h * 2  # dW and dh, alive after the call
    events = cpu_memory_events(step)
    sizes = {b for b, _ in events if b > 0}
    ours = max(t for _, t in events) - (events[0][1] - events[0][0])
    clear_grads({"h": hidden, "w": weight})
    theirs = _memtracker_peak(step)
    clear_grads({"h": hidden, "w": weight})
    print(f"linear_token_logprobs N={n} H={h} V={v} chunk={chunk}: dW + dh = {outputs} B, internal "
          f"workspace {workspace} B (seen: {workspace in sizes}), fp32 accumulator {accumulator} B "
          f"(seen: {accumulator in sizes}); peak: profiler tracker {ours} B, MemTracker {theirs} B")
    ok &= workspace in sizes and accumulator in sizes and ours >= outputs + workspace + accumulator

    # 3. the naive head, small (aten ops only, where MemTracker sees everything): its peak is in the
    #    log_softmax backward: saved fp32 output + incoming fp32 grad + fp32 grad input = 12 N V bytes
    inputs = make_inputs(n, "cpu", hidden_size=h, vocab=v)
    ours = cpu_peak_bytes(lambda: forward_backward(naive_loss, inputs))
    clear_grads(inputs)
    theirs = _memtracker_peak(lambda: forward_backward(naive_loss, inputs))
    clear_grads(inputs)
    print(f"naive head N={n} H={h} V={v}: 12 N V = {12 * n * v} B; peak: profiler tracker {ours} B, "
          f"MemTracker {theirs} B")
    ok &= 12 * n * v <= ours <= 12 * n * v + 4096 and abs(theirs - ours) <= 0.1 * ours
    print(("PASS" if ok else "FAIL") + ": the profiler tracker counts allocations made inside custom ops")
    return ok


# ---- the device as `train` sets it up, and its roofline ----------------------------------------


def use_train_allocator() -> dict:
    """Set up the CUDA caching allocator as `lowmem-grpo train` does (memory/fit.py
    `use_expandable_segments`: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True unless the user chose
    the allocator's settings), so that a benchmark's peaks and out-of-memory errors are the CLI's. Call it
    first, before anything initialises CUDA: the allocator reads the setting once, when CUDA starts.
    Returns what to record with the results: the two variables as the allocator will read them, whether
    this call set the first, and whether CUDA had started before it (then the setting came too late)."""
    from lowmem_grpo.memory.fit import ALLOC_CONF_VARIABLES, use_expandable_segments
    started = torch.cuda.is_initialized()
    set_here = use_expandable_segments()
    return {**{name: os.environ.get(name) for name in ALLOC_CONF_VARIABLES}, "set_here": set_here,
            "cuda_initialized_before": started}


def peak_memory_bandwidth(device) -> float | None:
    """The CUDA device's peak memory bandwidth in bytes/s, from its memory clock and bus width (double
    data rate: 2 transfers per clock); None where torch does not report them."""
    props = torch.cuda.get_device_properties(device)
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    if not clock_khz or not bus_bits:
        return None
    return 2 * clock_khz * 1e3 * bus_bits / 8


# ---- reporting ------------------------------------------------------------------------------


def kernels_digest() -> str:
    """Short sha256 of the kernels' sources: which version of the ops a result was measured on."""
    import hashlib

    import lowmem_grpo.kernels as kernels

    folder = os.path.dirname(kernels.__file__)
    digest = hashlib.sha256()
    for name in sorted(f for f in os.listdir(folder) if f.endswith(".py")):
        with open(os.path.join(folder, name), "rb") as f:
            digest.update(name.encode() + b"\0" + f.read())
    return digest.hexdigest()[:12]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        return f"{names[0]} ({platform.machine()})"
    except (OSError, IndexError):
        return platform.processor() or platform.machine()


def machine_info(device: str) -> dict[str, object]:
    info: dict[str, object] = {"torch": torch.__version__, "device": device, "python": platform.python_version(),
                               "kernels_sha256": kernels_digest()}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    else:
        info["cpu"] = _cpu_model()
        info["cpu_count"] = os.cpu_count()
        info["torch_threads"] = torch.get_num_threads()
    return info


def write_json(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    print(f"wrote {path}")
