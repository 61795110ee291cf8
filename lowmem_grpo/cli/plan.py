"""`lowmem-grpo plan (RECIPE | --model NAME_OR_CONFIG) [--gpu-memory 8GiB] [--host-memory 32GiB] [--nproc N
[--nnodes M] [--strategy ddp|fsdp]] [--card NAME] [key=value ...] [--json]`

Predicts peak device memory per phase and category from a model config alone (a preset name or hub
id, a local config.json or model folder, or the recipe's model) and the run's settings, says whether
it fits the card after the documented margin, and if not, which changes make it fit. The card: on a
machine with a CUDA GPU, what it has free now (torch.cuda.mem_get_info, memory/fit.py), unless
--gpu-memory names another; without one, --gpu-memory (default 8GiB). Also the host
RAM the run keeps on purpose (reference model, offloaded optimizer, offloaded activations), the pinned
part of it (page-locked on a GPU: it cannot swap) apart from the rest, checked against --host-memory
(default: this machine's RAM). Exit status 0 when the run fits both, 1 when it fits either not. With
--nproc N, one rank's peak under torchrun (memory/parallel_plan.py) and the host RAM of one node (of the
--nnodes M the N ranks are spread over). With --card NAME, the step's time on that card
(memory/step_time.py; an unknown name lists the table of cards). With --largest, the same settings for every preset
(memory/largest.py): which fit the card and the host, and the largest that does (exit status 1: none).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ..config import Config, ConfigError, batch_plan, load_config
from ..memory.cards import card as find_card
from ..memory.parallel_plan import per_rank
from ..memory.plan import GiB, Arch, MemoryPlan, margin_bytes, plan
from ..memory.presets import PRESETS, preset
from ..memory.reward_plan import resolve_folders
from ..memory.step_time import estimate, format_step_time
from ..memory.suggest import suggestions
from ..memory.vllm_plan import format_summary as format_vllm


def format_plan(result: MemoryPlan) -> str:
    """Categories (rows) at each phase's predicted peak (columns), GiB; then the peak and the host RAM."""
    phases, by_phase = result.phases, result.phase_categories
    short = {"old log-probs": "old-lp", "reference log-probs": "ref-lp", "sampler log-probs": "sampler-lp",
             "evaluation": "eval"}
    cats = list(dict.fromkeys(c for cats in by_phase.values() for c in cats))  # first seen first
    lines = [f"{'GiB (predicted)':<20}" + "".join(f"{short.get(p, p):>10}" for p in phases)]
    for c in cats:
        lines.append(f"{c:<20}" + "".join(f"{by_phase[p].get(c, 0) / GiB:>10.3f}" for p in phases))
    lines.append(f"{'total':<20}" + "".join(f"{phases[p] / GiB:>10.3f}" for p in phases))
    lines += ["", f"peak: {result.peak_bytes / GiB:.3f} GiB ({result.peak_phase}), allocator view"]
    if result.host_categories:
        parts = ", ".join(f"{k} {v / GiB:.3f}" for k, v in result.host_categories.items())
        lines.append(f"host RAM: {result.host_bytes / GiB:.3f} GiB ({parts}), plus the Python process")
        pinned = result.host_pinned_bytes
        lines.append(f"  pinned (page-locked, cannot swap): {pinned / GiB:.3f} GiB"
                     + (f" ({', '.join(result.host_pinned)})" if pinned else "")
                     + f"; not pinned: {(result.host_bytes - pinned) / GiB:.3f} GiB")
    return "\n".join(lines)


def parse_bytes(text: str, option: str = "--gpu-memory") -> int:
    m = re.fullmatch(r"\s*([0-9.]+)\s*(GiB|GB|G|MiB|MB|M)?\s*", text, re.I)
    if not m:
        raise ConfigError(f"{option} {text!r}: give a size such as 8GiB, 7.5GB or 8192MiB")
    value, unit = float(m.group(1)), (m.group(2) or "GiB").lower()
    scale = {"gib": GiB, "g": GiB, "gb": 10**9, "mib": 2**20, "m": 2**20, "mb": 10**6}[unit]
    if int(value * scale) < 2**20:
        raise ConfigError(f"{option} {text!r}: a memory size must be at least 1MiB; give the card's or the machine's "
                          "size, such as 8GiB")
    return int(value * scale)


def architecture(cfg: Config, model: str | None) -> tuple[Arch, str]:
    """The architecture to plan for: --model, else the recipe's model.config / name_or_path."""
    source = model or cfg.model.name_or_path
    if model is None and cfg.model.config is not None:
        return Arch.from_config(cfg.model.config), "model.config"
    if not source:
        raise ConfigError("no model: give --model (a preset such as Qwen2.5-1.5B, a hub id, or a config.json path)")
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        from transformers import AutoConfig
        return Arch.from_config(AutoConfig.from_pretrained(str(path))), str(path)
    try:
        return Arch.from_config(preset(source)), source
    except KeyError:
        raise ConfigError(f"{source!r} is neither a local config.json/model folder nor a preset; presets: "
                          f"{', '.join(PRESETS)} (also by hub id, e.g. Qwen/Qwen2.5-1.5B-Instruct)") from None


def gpu_budget(gpu_memory: str | None) -> tuple[int, str, dict]:
    """(bytes, where the number comes from, the card's free/total bytes when there is a card)."""
    card = {}
    if _cuda_available():
        import torch

        from ..memory.fit import device_free_bytes
        device = torch.device("cuda", torch.cuda.current_device())
        free, total = device_free_bytes(device)
        card = {"device": f"{device} ({torch.cuda.get_device_name(device)})", "free_bytes": free, "total_bytes": total}
        if gpu_memory is None:
            return free, f"free now on {card['device']} of {total / GiB:.2f} GiB, torch.cuda.mem_get_info", card
    if gpu_memory is None:
        return 8 * GiB, "the default; no CUDA GPU here", card
    return parse_bytes(gpu_memory), "--gpu-memory", card


def _cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()


def run(recipe: str | None, model: str | None, gpu_memory: str | None, overrides: list[str], as_json: bool,
        host_memory: str | None = None, nproc: int = 1, strategy: str | None = None,
        nnodes: int = 1, largest: bool = False, card_name: str | None = None) -> int:
    target = find_card(card_name) if card_name is not None else None  # an unknown name: before any planning
    if target is not None and (largest or nproc > 1):
        raise ConfigError(f"--card estimates one process's step: drop {'--largest' if largest else f'--nproc {nproc}'}")
    cfg = load_config(recipe, overrides, check=False)
    if recipe is not None:  # reward-model folders named from the recipe's folder
        resolve_folders(cfg, Path(recipe).resolve().parent)
    if largest:
        if model is not None or nproc > 1:
            raise ConfigError("--largest plans every preset in one process: drop "
                              + ("--model" if model is not None else f"--nproc {nproc}"))
        settings = (f"{Path(recipe).name}'s settings" if recipe else "lowmem-grpo's default settings (a recipe, "
                    "e.g. qwen2.5-3b_gsm8k_8gb, brings its memory modes)")
        settings += f" with {' '.join(overrides)}" if overrides else ""
        return run_largest(cfg, gpu_memory, host_memory, as_json, settings=settings)
    arch, source = architecture(cfg, model)
    budget, budget_source, card = gpu_budget(gpu_memory)
    host_budget = parse_bytes(host_memory, "--host-memory") if host_memory else physical_ram_bytes()
    if nproc < 1:
        raise ConfigError(f"--nproc {nproc}: give the number of ranks (>= 1)")
    if nnodes < 1 or nproc % nnodes:
        raise ConfigError(f"--nproc {nproc} --nnodes {nnodes}: torchrun runs the same number of ranks on every "
                          "node; give --nproc as the ranks of all nodes (a multiple of --nnodes)")
    strategy = strategy or cfg.train.strategy
    if nproc > 1:
        batch_plan(cfg, nproc)  # each rank's share must be whole groups: the trainer's own check
        if cfg.train.optimizer_in_backward or cfg.optim.offload_optimizer:
            raise ConfigError(f"--nproc {nproc}: optimizer_in_backward and offload_optimizer do not run under "
                              "torchrun (training/distributed.py); add optimizer_in_backward=false "
                              "offload_optimizer=false")
    card_bytes = card["total_bytes"] if card and budget_source != "--gpu-memory" else budget  # vLLM takes a share of it
    result = per_rank(plan(cfg, arch, card_bytes=card_bytes), cfg, arch, nproc, strategy, nnodes)
    margin = margin_bytes(result.peak_bytes)
    total = result.peak_bytes + margin
    vllm = result.vllm
    fits = total <= budget and not (vllm and vllm["problem"])
    ideas = [] if fits or nproc > 1 else suggestions(cfg, arch, budget, card_bytes=card_bytes)  # (one process)
    host_fits = result.host_bytes <= host_budget
    step = estimate(cfg, arch, target) if target is not None else None
    if as_json:
        print(json.dumps({"model": source, "params": arch.params, "gpu_memory_bytes": budget,
                          "gpu_memory_source": budget_source, "card": card or None, "nproc": nproc,
                          "nnodes": nnodes,
                          "strategy": strategy if nproc > 1 else None,
                          "peak_bytes": result.peak_bytes, "margin_bytes": margin, "total_bytes": total,
                          "fits": fits, "peak_phase": result.peak_phase, "phases": result.phases,
                          "categories": result.categories, "phase_categories": result.phase_categories,
                          "host_bytes": result.host_bytes, "host_categories": result.host_categories,
                          "host_pinned_bytes": result.host_pinned_bytes, "host_pinned": result.host_pinned,
                          "host_memory_bytes": host_budget, "host_fits": host_fits,
                          "suggestions": [s.to_dict() for s in ideas],
                          "vllm": vllm, "step_time_card": target.as_dict() if step else None,
                          "step_time_s": step.seconds() if step else None,
                          "transfer_bytes": step.transfer_bytes() if step else None,
                          "step_time_notes": step.notes if step else None}, indent=2))
        return 0 if fits and host_fits else 1
    print(f"model: {source} ({arch.params / 1e9:.3f} B parameters)"
          + (f", one of {nproc} ranks (strategy={strategy})" if nproc > 1 else "")
          + (f" on {nnodes} nodes (host RAM: one node's {nproc // nnodes})" if nnodes > 1 else ""))
    print(format_plan(result))
    if vllm:
        print(format_vllm(vllm))
    print(f"+ margin (CUDA context 0.5 GiB + 5% fragmentation): {margin / GiB:.3f} GiB "
          f"-> {total / GiB:.3f} GiB of {budget / GiB:.2f} GiB ({budget_source}): {'FITS' if fits else 'DOES NOT FIT'}"
          + (" (vLLM does not start in its share: above)" if vllm and vllm["problem"] else ""))
    if card and budget_source == "--gpu-memory":
        print(f"  (this machine's {card['device']} has {card['free_bytes'] / GiB:.2f} of "
              f"{card['total_bytes'] / GiB:.2f} GiB free now)")
    for s in ideas:
        mark = "fits" if s.fits else "still over"
        host = f", host RAM {s.host_bytes / GiB:.1f} GiB" if s.host_bytes else ""
        print(f"  {'combined: ' if s.combined else ''}{s.change}: {s.total_bytes / GiB:.3f} GiB "
              f"({mark}{host})")
    if step is not None:
        print(format_step_time(step))
    if not host_fits:
        print(f"error: the run keeps {result.host_bytes / GiB:.2f} GiB in host RAM but "
              f"{'--host-memory is' if host_memory else 'this machine has'} {host_budget / GiB:.2f} GiB: "
              "turn off optim.offload_optimizer / model.offload_activations, or use a machine with more RAM")
    return 0 if fits and host_fits else 1


def run_largest(cfg: Config, gpu_memory: str | None, host_memory: str | None, as_json: bool,
                names: list[str] | None = None, settings: str = "these settings") -> int:
    """`plan --largest`: every preset (or `names`) with `cfg`'s settings; exit status 1 when none fits."""
    from ..memory.largest import candidates, format_candidates, largest, verdict
    budget, budget_source, card = gpu_budget(gpu_memory)
    host_budget = parse_bytes(host_memory, "--host-memory") if host_memory else physical_ram_bytes()
    found = candidates(cfg, budget, host_budget, names)
    best = largest(found)
    if as_json:
        print(json.dumps({"gpu_memory_bytes": budget, "gpu_memory_source": budget_source, "card": card or None,
                          "host_memory_bytes": host_budget, "settings": settings,
                          "largest": best.name if best else None,
                          "verdict": verdict(found), "presets": [c.as_dict() for c in found]}, indent=2))
    else:
        print(f"every preset with {settings}, against {budget / GiB:.2f} GiB ({budget_source}) with the margin "
              f"(CUDA context 0.5 GiB + 5%) and {host_budget / GiB:.1f} GiB of host RAM:")
        print(format_candidates(found))
        print(verdict(found))
    return 0 if best else 1


def physical_ram_bytes() -> int:
    """This machine's RAM (POSIX); what --host-memory defaults to."""
    import os
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
