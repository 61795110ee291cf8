"""Step time and peak memory of real trainer steps on a random-weight model of a real architecture.

    python benchmarks/trainer_step.py --arch Qwen2.5-0.5B --recipe recipes/qwen2.5-0.5b_gsm8k_8gb.yaml \
        --device cuda --memory-cap-gib 8 --prompt-len 256 --completion-len 512 --steps 3 --json out.json

The recipe's settings are used as they are (batch sizes, G, beta, optimizer, checkpointing, bf16),
except: the model is built from the architecture preset with random weights (memory and speed do not
depend on weight values; no hub download), prompts are random token ids of exactly --prompt-len
tokens, completions run to --completion-len (EOS is an id a random model practically never samples),
and the reward is the fraction of even token ids (it varies, so advantages are non-zero). Nothing is
saved to disk. On CUDA the random weights are drawn on the GPU (`random_model_drawn_on`). On CUDA,
--memory-cap-gib models a card with that much memory: the CUDA context (driver,
kernel images) sits on the card but outside the caching allocator, and set_per_process_memory_fraction
caps only the allocator, so the allocator is capped at the card's size minus the context as measured
at start-up (the driver's used memory after CUDA init minus before: NVML before, mem_get_info after;
without an NVML reading from before init, everything on the device outside this process's allocator,
other processes included, counts as context). The context grows a little later as kernels load lazily (cuBLAS, Triton): the
result reports what lay outside the allocator at the end too. A step that does not fit fails with an
out-of-memory error.
Before anything touches CUDA the allocator is set up as `lowmem-grpo train` sets it up
(bench_utils.use_train_allocator: expandable segments), and the result records it ("allocator").
Each step = one generation batch's rollout (if due) + one optimizer step, timed after a device sync, split
into generation (the rollout), training (the rest: log-prob passes, forward, backward) and the host update
of an offloaded optimizer (optim.offload_optimizer: the seconds its updates ran, on its worker thread
while the next forward starts; "host_update_wait_s": how long they still ran after the step returned,
waited for after the step's time, so each step starts with the last one's updates done). Beside the
peaks: the page-locked host memory the run holds after setup and after each step (`pinned_host_bytes`)
against the planner's pinned host categories, and the planner's device peak for the same settings.
With --profile the last step runs under the torch profiler and the result holds where its time went
(step_profile.py: per phase GPU busy and idle time, device time by kind with the copies' bytes, the host's
waits on the device, the ten kernels with the most time); that step's times include the profiler's overhead.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_utils import use_train_allocator  # noqa: E402
from step_profile import format_summary, profile_call  # noqa: E402

from lowmem_grpo.config import load_config  # noqa: E402
from lowmem_grpo.memory.plan import Arch, plan  # noqa: E402
from lowmem_grpo.memory.presets import preset  # noqa: E402
from lowmem_grpo.host_arena import HostArena  # noqa: E402
from lowmem_grpo.policy.model import load_model  # noqa: E402
from lowmem_grpo.training.metrics import peak_memory_bytes, reset_peak_memory  # noqa: E402
from lowmem_grpo.training.trainer import Trainer  # noqa: E402

GiB = 2**30


def even_fraction(prompts, completions, completion_ids, **kwargs):
    """Benchmark reward: fraction of even ids in the completion (varies across samples)."""
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


# --tiny: the architecture's own model type and layer code at toy width and depth, so a CPU rehearsal of
# a GPU session (benchmarks/gpu_session.sh rehearse) runs every code path of the real set-up in seconds.
TINY = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 512}


def build(args, before_trainer=None) -> Trainer:
    """A Trainer for `args`: `arch` is a preset name or a transformers config dict (with model_type).
    `before_trainer()` (main: the memory cap) is called before the random model is drawn, or, under
    model.offload_weights, after: a model larger than the cap is drawn whole on the GPU and handed to the
    host (the cap's context is then measured after CUDA's start: cap_cuda_memory); the Trainer's own set-up
    runs under the cap either way."""
    arch = preset(args.arch) if isinstance(args.arch, str) else dict(args.arch)
    if getattr(args, "tiny", False):
        arch.update(TINY)
        arch.pop("head_dim", None)  # derived from hidden_size / heads at the tiny width
    if getattr(args, "layers", None):  # the first N decoder layers: each costs what it does in the full model
        arch["num_hidden_layers"] = args.layers
    vocab = arch["vocab_size"]
    arch["eos_token_id"] = vocab - 1  # an id a random model samples with probability ~1/V per token
    for key in ("bos_token_id", "pad_token_id"):  # the preset's ids can lie outside a --tiny vocabulary
        if key in arch:
            arch[key] = vocab - 1
    rng = random.Random(0)
    data = Path(tempfile.mkdtemp(prefix="lowmem_bench_")) / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt_ids": [rng.randrange(vocab - 1) for _ in range(args.prompt_len)]})
                            + "\n" for _ in range(256)))
    overrides = [
        f"model.config={json.dumps(arch)}", "model.name_or_path=''", "model.gguf_file=null", "model.tokenizer=none",
        f"data.train_file={data}", "data.eval_file=null", "eval_on_start=false", "eval_on_end=false",
        f"max_prompt_length={args.prompt_len}", f"max_completion_length={args.completion_len}",
        f"reward_funcs=[{Path(__file__).resolve()}:even_fraction]", "reward_weights=null",
        f"train.device={args.device}", f"output_dir={tempfile.mkdtemp(prefix='lowmem_bench_out_')}",
        "progress_bar=false", *args.overrides,
    ]
    cfg = load_config(args.recipe, overrides)
    device = torch.device(args.device)
    draw_first = cfg.model.offload_weights
    if before_trainer is not None and not draw_first:
        before_trainer()
    model = random_model_drawn_on(cfg, device) if device.type == "cuda" else None
    if before_trainer is not None and draw_first:
        before_trainer()
    return Trainer(cfg, model=model)


def random_model_drawn_on(cfg, device: torch.device) -> torch.nn.Module:
    """The model `Trainer(cfg)` would load (policy/model.py `load_model`: the recipe's weight dtype, random
    weights from its seed), its weights drawn on the CUDA `device` and handed over on the CPU, as load_model
    hands its models over: the CPU draws them one after another (a 1.5B model in bf16: 40 s on this
    project's 2-core CPU), the GPU in parallel. The device's cache is emptied and its peaks reset after,
    so that nothing of this counts in a step's peaks."""
    with torch.device(device):
        model = load_model(cfg.model, cfg.train.seed)
    model.to("cpu")
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return model


def allocator_fraction(card_bytes: int, context_bytes: int, total_bytes: int) -> float:
    """The set_per_process_memory_fraction that leaves the allocator `card_bytes - context_bytes` of a
    device of `total_bytes`: allocator + CUDA context = the modelled card."""
    if card_bytes <= context_bytes:
        raise ValueError(f"--memory-cap-gib {card_bytes / GiB:.2f} is not more than the CUDA context "
                         f"({context_bytes / GiB:.2f} GiB): give the size of a real card, e.g. 8")
    return min(1.0, (card_bytes - context_bytes) / total_bytes)


def _nvml_used_bytes(device: torch.device):
    """The device's used memory as NVML (nvidia-smi) reports it, for every process; None without NVML
    (pynvml). Reading it creates no CUDA context."""
    if device.index is not None:
        index = device.index
    else:  # no index: the current device, once CUDA runs (before, torch would start CUDA to find it)
        index = torch.cuda.current_device() if torch.cuda.is_initialized() else 0
    try:
        return int(torch.cuda.device_memory_used(torch.device("cuda", index)))
    except Exception:  # noqa: BLE001 - no pynvml, no NVML library: fall back (see cap_cuda_memory)
        return None


MIN_CONTEXT_BYTES = 32 * 2**20  # a CUDA context holds at least this much; a smaller reading is not one


def _init_cuda(device: torch.device) -> None:
    torch.zeros(1, device=device)  # creates the context
    torch.cuda.synchronize(device)


def outside_allocator_bytes(device: torch.device) -> int:
    """Device memory in use that this process's caching allocator does not hold (context, other processes)."""
    free, total = torch.cuda.mem_get_info(device)
    return total - free - torch.cuda.memory_reserved(device)


def cap_cuda_memory(gib: float, device: torch.device) -> dict:
    """Cap this process as on a card of `gib` GiB: the allocator gets the card minus the CUDA context.
    Call before anything touches CUDA (the context is measured as it is created). `device` without an
    index (`cuda`) is the current device."""
    # One meter on both sides: NVML's used memory and cudaMemGetInfo's total - free need not agree (on an
    # H200, NVML before and mem_get_info after CUDA init gave a context of 0.5 MiB, where 0.9 GiB lay outside
    # the allocator after a step; on an H100, 0.13 GiB against 0.84).
    before = None if torch.cuda.is_initialized() else _nvml_used_bytes(device)  # (an import started CUDA)
    _init_cuda(device)
    after = _nvml_used_bytes(device) if before is not None else None
    outside_after_init = outside_allocator_bytes(device)
    context = after - before - torch.cuda.memory_reserved(device) if after is not None else None
    if context is not None and context >= MIN_CONTEXT_BYTES:
        measured_by = "NVML before and after CUDA init, less what the allocator reserved"
    else:
        measured_by = ("all device memory outside this allocator after CUDA init (" + (
            "no NVML reading before init" if context is None else
            f"NVML saw the context grow by only {context / 2**20:.1f} MiB") + ": other processes' memory counts too)")
        context = outside_after_init
    if device.index is None:  # set_per_process_memory_fraction refuses a device without an index
        device = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = allocator_fraction(int(gib * GiB), context, total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    info = {"card_bytes": int(gib * GiB), "context_bytes": context, "allocator_cap_bytes": int(fraction * total),
            "device_total_bytes": total, "context_measured_by": measured_by,
            "outside_allocator_after_init_bytes": outside_after_init}
    print(f"modelling a {gib:g} GiB card: CUDA context {context / GiB:.2f} GiB ({info['context_measured_by']}), "
          f"allocator capped at {fraction * total / GiB:.2f} GiB of this {total / GiB:.1f} GiB device")
    return info


def pinned_host_bytes(device: torch.device) -> dict:
    """Page-locked host memory this process holds now: the HostArena blocks registered with CUDA (the
    offloaded optimizer's, the streamed reference's, activation offload's; found among the live objects)
    and, on CUDA, what torch's caching host allocator holds (pin_memory=True tensors, e.g. the offloaded
    optimizer's staging ring), as `torch.cuda.host_memory_stats` counts it."""
    # type(o), not isinstance: isinstance reads o.__class__, which deprecated module proxies warn about
    arenas = [o for o in gc.get_objects() if issubclass(type(o), HostArena) and o.pinned]
    out = {"arena_bytes": sum(a.nbytes for a in arenas), "arenas": len(arenas), "caching_allocator_bytes": 0}
    if device.type == "cuda":
        stats = torch.cuda.host_memory_stats()
        out["caching_allocator_bytes"] = int(stats.get("allocated_bytes.current", 0))
        out["caching_allocator_reserved_bytes"] = int(stats.get("reserved_bytes.current", 0))
    out["total_bytes"] = out["arena_bytes"] + out["caching_allocator_bytes"]
    return out


class HostUpdateClock:
    """Seconds an offloaded optimizer (optim/offload.py) spends in its host updates (`_update_all`,
    on whichever thread runs them), summed until `take()`; a no-op for an optimizer without them."""

    def __init__(self, optimizer):
        self.seconds = 0.0
        self.active = hasattr(optimizer, "_update_all")
        if self.active:
            update = optimizer._update_all

            def timed(*args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return update(*args, **kwargs)
                finally:
                    self.seconds += time.perf_counter() - t0
            optimizer._update_all = timed

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def main(argv=None) -> int:
    allocator = use_train_allocator()  # first: before anything can start CUDA
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="Qwen2.5-0.5B",
                    help="architecture preset (lowmem_grpo/memory/presets.py)")
    ap.add_argument("--recipe", default=None,
                    help="recipe whose settings to use (default: the config defaults)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--memory-cap-gib", type=float, default=None,
                    help="CUDA: cap the process at this many GiB")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--completion-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", default=None,
                    help="write the results here (after setup, then after every step)")
    ap.add_argument("--tiny", action="store_true",
                    help="the architecture at toy width and depth (rehearsals)")
    ap.add_argument("--layers", type=int, default=None,
                    help="only this many decoder layers (CPU runs of big models)")
    ap.add_argument("--profile", action="store_true",
                    help="run the last step under the torch profiler and record where its time went "
                         "(step_profile.py: per phase GPU busy and idle, device time by kind, syncs, top kernels)")
    ap.add_argument("overrides", nargs="*", help="extra key=value config overrides")
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    cap = {}

    def capped():
        if device.type == "cuda" and args.memory_cap_gib:
            cap.update(cap_cuda_memory(args.memory_cap_gib, device))
    torch.manual_seed(0)
    t0 = time.perf_counter()
    trainer = build(args, before_trainer=capped)
    cap = cap or None
    setup_s = time.perf_counter() - t0
    planned = plan(trainer.cfg, Arch.from_config(trainer.policy.config), autocast=trainer.autocast,
                   device=trainer.device.type)
    result = {
        "arch": args.arch, "tiny": args.tiny, "recipe": args.recipe, "device": str(device),
        "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                        else platform.processor() or "cpu"),
        "memory_cap_gib": args.memory_cap_gib, "prompt_len": args.prompt_len,
        "completion_len": args.completion_len,
        "overrides": args.overrides, "allocator": allocator, "setup_s": setup_s, "steps": [], "peak_bytes": 0,
        "peak_memory_meaning": "CUDA allocator peak" if device.type == "cuda" else "process peak RSS (host)",
        "memory_cap": cap, "planned_peak_bytes": planned.peak_bytes,
        "planned_peak_phase": planned.peak_phase,
        "planned_pinned_host_bytes": planned.host_pinned_bytes,
        "planned_pinned_host": {c: planned.host_categories[c] for c in planned.host_pinned},
        "pinned_after_setup": pinned_host_bytes(device),
    }
    pinned = result["pinned_after_setup"]["total_bytes"]
    print(f"setup {setup_s:.1f} s; pinned host memory {pinned / GiB:.3f} GiB "
          f"(planned {planned.host_pinned_bytes / GiB:.3f} GiB)", flush=True)
    if args.json:  # after setup: a run stopped in its first step still leaves this
        Path(args.json).write_text(json.dumps(result, indent=2))
    host_update = HostUpdateClock(trainer.optimizer)
    for i in range(args.steps):
        profiled = args.profile and i == args.steps - 1
        reset_peak_memory(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        generated = trainer.generation is None
        if profiled:
            (gb, metrics, generation_s), summary = profile_call(trainer.run_step, device)
        else:
            gb, metrics, generation_s = trainer.run_step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step_s = summary["call_s"] if profiled else time.perf_counter() - t0
        row = {"step": trainer.step, "step_s": step_s, "generated": generated, "generation_s": generation_s,
               "training_s": step_s - generation_s, "loss": metrics["loss"],
               "grad_norm": metrics["grad_norm"],
               "peak_bytes": peak_memory_bytes(device), "profiled": profiled}
        if host_update.active:  # the updates still running when the step returned: waited for here, untimed
            t1 = time.perf_counter()
            trainer.optimizer.synchronize()
            row.update(host_update_wait_s=time.perf_counter() - t1, host_update_s=host_update.take())
        if generated:  # rollout speed: rows x decoded positions (every row decodes until the longest ends)
            row["rollout_tokens_per_s"] = gb.batch.completion_ids.numel() / generation_s
        if device.type == "cuda":
            row["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
            row["outside_allocator_bytes"] = outside_allocator_bytes(device)  # the context as it is now
        row["pinned"] = pinned_host_bytes(device)
        result["steps"].append(row)
        result["peak_bytes"] = max(result["peak_bytes"], row["peak_bytes"])
        print(json.dumps(row), flush=True)
        if profiled:  # the step's times above include the profiler's overhead
            result["profile"] = summary
            print(format_summary(summary), flush=True)
        if args.json:  # after every step: a run stopped at its time limit still leaves what it measured
            Path(args.json).write_text(json.dumps(result, indent=2))
    times = [round(s["step_s"], 1) for s in result["steps"]]
    print(f"{args.arch} on {result['device_name']}: peak {result['peak_bytes'] / GiB:.2f} GiB "
          f"(planned {planned.peak_bytes / GiB:.2f} GiB), step times {times} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
