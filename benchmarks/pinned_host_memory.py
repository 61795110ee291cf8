"""Pinned host memory of a recipe: what the run pins, against what the planner says and against what
per-tensor `pin_memory=True` would pin (torch's caching host allocator rounds each request up to a
power of two: lowmem_grpo/host_arena.py).

    python benchmarks/pinned_host_memory.py --arch Qwen2.5-1.5B --recipe recipes/qwen2.5-1.5b_gsm8k_8gb.yaml \\
        --json out.json          # on a GPU; --tiny: the architecture at toy width (CPU rehearsal)
    python benchmarks/pinned_host_memory.py --arch Qwen2.5-3B --recipe recipes/qwen2.5-3b_gsm8k_8gb.yaml \\
        --shapes-only            # the planner's figure against per-tensor pin_memory's, no model built

Builds the recipe's offloaded optimizer the trainer's way (`build_optimizer`) on a random-weight model
of the architecture on the device, and, with beta > 0, the streamed reference's block
(`reference.pinned_copies`; on a CPU its blocks are laid out the same and not registered). Reports:

    planned        plan()'s pinned host categories for the recipe on this architecture
    pinned         the blocks' bytes (HostArena.nbytes), and with gradient_accumulation_steps > 1 the
                   staging ring (one pinned power-of-two allocation, `staging_ring()`)
    rss_growth     this process's resident memory across building them: the pages the blocks take
    caching_alloc  growth of torch.cuda.host_memory_stats()'s allocated_bytes.current while building
                   them: 0 when nothing came from the caching host allocator (CUDA only)
    per_tensor     the same buffers pinned one by one with pin_memory=True: on CUDA the allocator's
                   growth as measured, on a CPU the sum of the power-of-two sizes it would request
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_utils import machine_info, write_json  # noqa: E402

from lowmem_grpo.config import load_config  # noqa: E402
from lowmem_grpo.memory.plan import Arch, plan  # noqa: E402
from lowmem_grpo.memory.presets import preset  # noqa: E402
from lowmem_grpo.optim.host_ram import process_ram  # noqa: E402
from lowmem_grpo.optim.optimizers import _optimizer_class, build_optimizer  # noqa: E402
from lowmem_grpo.policy.reference import pinned_copies  # noqa: E402

MiB = 2**20
TINY = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512}  # as trainer_step.py's --tiny


def _cached_bytes(device: str) -> int:
    return torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) if device == "cuda" else 0


def _per_tensor(buffers: list[torch.Tensor], device: str) -> int:
    """Bytes that pinning each buffer on its own takes from the caching host allocator."""
    if device != "cuda":
        return sum(_pow2(b.numel() * b.element_size()) for b in buffers)
    before = _cached_bytes(device)
    pinned = [torch.empty(b.shape, dtype=b.dtype, pin_memory=True) for b in buffers]
    grown = _cached_bytes(device) - before
    del pinned
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # (the host allocator's cache is freed with the device's in torch >= 2.5)
    return grown


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def from_shapes(args) -> dict:
    """--shapes-only: the planner's pinned bytes and the power-of-two blocks per-tensor pin_memory would
    take for the same buffers (offload.py's: weight copies unless fp32 masters, gradient buffers, one
    fp32 norm slot per tensor, the tied head's buffer; the streamed reference's weights), from the
    architecture's shapes alone: no model is built."""
    conf = preset(args.arch)
    cfg = load_config(args.recipe, args.overrides, check=False)
    arch = Arch.from_config(conf)
    planned = plan(cfg, arch)
    host, wb = planned.host_categories, 2 if cfg.model.precision == "bf16_sr" else 4
    sizes = [wb * n for n in arch.tensor_sizes]
    rows = {}
    if cfg.optim.offload_optimizer:
        copies = [] if (cfg.optim.optimizer == "adamw" and wb == 2) else sizes
        buffers = copies + sizes + [4 * len(sizes)] + ([wb * arch.vocab * arch.hidden] if arch.tied else [])
        rows["offloaded optimizer"] = {"exact": sum(buffers), "planned": sum(
            host[c] for c in planned.host_pinned if c != "reference model"), "per_tensor": sum(map(_pow2, buffers))}
    if "reference model" in planned.host_pinned:
        rows["streamed reference"] = {"exact": sum(sizes), "planned": host["reference model"],
                                      "per_tensor": sum(map(_pow2, sizes))}
    return rows


def measure(args) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM
    device = args.device
    conf = preset(args.arch)
    if args.tiny:
        conf.update(TINY)
        conf.pop("head_dim", None)
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # the preset's ids lie outside a toy vocabulary
            if key in conf:
                conf[key] = conf["vocab_size"] - 1
    cfg = load_config(args.recipe, args.overrides, check=False)
    planned = plan(cfg, Arch.from_config(conf))  # for a GPU run: a CPU run lays its blocks out the same
    dtype = torch.bfloat16 if cfg.model.precision == "bf16_sr" else torch.float32
    hf_conf = AutoConfig.for_model(conf.pop("model_type"), **conf)
    with torch.device(device):  # random weights: only shapes and dtypes matter here
        model = AutoModelForCausalLM.from_config(hf_conf, dtype=dtype)
    if device == "cuda":
        torch.cuda.init()
    rows = {}
    _optimizer_class(cfg.optim.optimizer, cfg.model.precision == "bf16_sr")  # imported before RSS is read
    rss, cached = process_ram() or 0, _cached_bytes(device)
    opt = build_optimizer(model, cfg.optim, stochastic_rounding=cfg.model.precision == "bf16_sr", in_backward=True)
    opt.split_tied_head(model)  # as the trainer does: a tied head's gradient has its own block
    blocks = [opt.arena] + ([opt.head_arena] if opt.head_arena is not None else [])
    staging = opt.staging_ring() if cfg.train.gradient_accumulation_steps > 1 else None  # made in micro-batch 2
    buffers = ([h for p, h in opt.host.items() if h.dtype == p.dtype] + list(opt.host_grad.values())
               + [opt._host_norm_slots] + ([opt.head_host] if opt.head_host is not None else []))
    rows["offloaded optimizer"] = {
        "planned": sum(planned.host_categories[c] for c in planned.host_pinned if c != "reference model"),
        "pinned": sum(b.nbytes for b in blocks) + (0 if staging is None else staging.nbytes),
        "registered": all(b.pinned for b in blocks) and (staging is None or staging.is_pinned()),
        "rss_growth": (process_ram() or 0) - rss, "caching_alloc": _cached_bytes(device) - cached,
        "per_tensor": _per_tensor(buffers, device)}
    del opt, blocks, buffers, staging
    gc.collect()
    if cfg.train.beta > 0 and cfg.train.reference_compute != "cpu":
        reference = AutoModelForCausalLM.from_config(hf_conf, dtype=dtype)  # on the CPU, as the trainer's
        params = list(reference.parameters())
        rss, cached = process_ram() or 0, _cached_bytes(device)
        arena = pinned_copies(params) if device == "cuda" else None
        if arena is None:  # a CPU: the same block, not registered
            from lowmem_grpo.host_arena import HostArena
            arena = HostArena([(p.shape, p.dtype) for p in params])
            for p in params:
                p.data = arena.take(p.shape, p.dtype).copy_(p.data)
        rows["streamed reference"] = {
            "planned": planned.host_categories["reference model"], "pinned": arena.nbytes,
            "registered": arena.pinned, "rss_growth": (process_ram() or 0) - rss,
            "caching_alloc": _cached_bytes(device) - cached, "per_tensor": _per_tensor(params, device)}
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="Qwen2.5-1.5B")
    ap.add_argument("--recipe", default="recipes/qwen2.5-1.5b_gsm8k_8gb.yaml")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="the architecture at toy width and depth (rehearsals)")
    ap.add_argument("--json", default=None)
    ap.add_argument("overrides", nargs="*", help="key=value settings on top of the recipe")
    ap.add_argument("--shapes-only", action="store_true", help="no model, no allocation: the planner's pinned "
                                                               "bytes against per-tensor pin_memory's, from shapes")
    args = ap.parse_args(argv)
    if args.shapes_only:
        rows = from_shapes(args)
        print(f"{args.arch}, {args.recipe}: GiB (from the shapes)")
        print(f"{'':<22}{'exact':>10}{'planned':>10}{'per-tensor pin_memory':>24}")
        for name, r in rows.items():
            print(f"{name:<22}{r['exact'] / 2**30:>10.3f}{r['planned'] / 2**30:>10.3f}{r['per_tensor'] / 2**30:>12.3f}"
                  f" (+{100 * (r['per_tensor'] / r['exact'] - 1):.1f}%)")
        if args.json:
            write_json(args.json, {"arch": args.arch, "recipe": args.recipe, "shapes_only": True, "rows": rows})
        return 0
    rows = measure(args)
    print(f"{args.arch}{' (tiny)' if args.tiny else ''}, {args.recipe}, {args.device}: MiB")
    print(f"{'':<22}{'planned':>12}{'pinned':>12}{'RSS +':>12}{'cache +':>10}{'per-tensor':>12}  registered")
    for name, r in rows.items():
        print(f"{name:<22}{r['planned'] / MiB:>12.2f}{r['pinned'] / MiB:>12.2f}{r['rss_growth'] / MiB:>12.2f}"
              f"{r['caching_alloc'] / MiB:>10.2f}{r['per_tensor'] / MiB:>12.2f}  {r['registered']}")
    if args.json:
        write_json(args.json, {"machine": machine_info(args.device), "arch": args.arch, "tiny": args.tiny,
                               "recipe": args.recipe, "rows": rows})
    exact = all(r["planned"] == r["pinned"] for r in rows.values())
    print("pinned == planned" if exact else "MISMATCH: pinned != planned")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
