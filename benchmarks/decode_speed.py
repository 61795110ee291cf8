"""Decode speed of the trainer's rollout at a recipe's settings: the static decode step eager against the
same step compiled, with CUDA graphs per batch bucket (generation.compile_decode), and whether they sample
the same tokens.

    python benchmarks/decode_speed.py --shape Qwen2.5-0.5B:recipes/qwen2.5-0.5b_gsm8k_8gb.yaml \\
        --shape Qwen2.5-1.5B:recipes/qwen2.5-1.5b_gsm8k_8gb.yaml --json out.json

For each shape ARCH:RECIPE, the model is built as the trainer builds it (policy/model.py `load_model`: the
recipe's weight precision, random weights of the architecture preset, made on the device) and decodes as
the trainer's rollout does (`sample`, bf16 autocast where the trainer would use it) one generation
micro-batch of the recipe: generation_micro_batch_size rows, G = num_generations samples of each of
micro_batch / G prompts of max_prompt_length random ids, every row max_completion_length tokens (no EOS
id: the work is fixed), sampled with the recipe's settings (temperature, top-p, ...). Runs, each seeded
the same:

    eager      sample(decode="static"), after a 4-token warm-up
    compiled   sample(decode="compiled"), twice: the first compiles and captures each bucket it meets
               ("first_run_s"; "compile_s" is what it took beyond the second), the second is timed

Reported per path: tokens per second (rows x tokens / seconds), decode steps per second, and the weights
read per second (decode steps x the parameters' bytes / seconds: a lower bound on the bandwidth a step
uses) against the card's peak memory bandwidth (bench_utils.peak_memory_bandwidth). Whether the graphed
step's tokens equal eager's, for both compiled runs: the fraction of rows equal throughout, and the first
position where each row differs (min and median; the row length if it never does). Sampled tokens follow
the logits, so a difference in the last bits can flip a near-tie, after which the row diverges: in bf16,
Inductor's fused kernels round intermediates differently from eager, so equal first tokens and most rows
equal are what to expect there (tests/policy/test_static_decode.py checks greedy tokens at toy size).
Also: graphs compiled and CUDA-graph skips (torch._dynamo's counters) in the compiled runs.

The CUDA allocator is set up as `lowmem-grpo train` sets it up (bench_utils.use_train_allocator). The
JSON is rewritten after each shape, so a run stopped at its time limit keeps the shapes it finished.
--tiny: the architecture at toy width and depth, 8-token prompts and completions (the CPU rehearsal of the
GPU session; on a CPU the compiled step is Inductor's, without CUDA graphs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_utils import machine_info, peak_memory_bandwidth, use_train_allocator, write_json  # noqa: E402

from lowmem_grpo.config import load_config  # noqa: E402
from lowmem_grpo.memory.presets import preset  # noqa: E402
from lowmem_grpo.policy.model import bf16_autocast_wanted, load_model  # noqa: E402
from lowmem_grpo.policy.sampling import SamplingStats, sample  # noqa: E402

TINY = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 512}  # as trainer_step.py's


def build(arch_name: str, recipe: str, device: torch.device, tiny: bool):
    """(model, generation config, bf16 autocast) as the trainer would have them for `recipe`."""
    arch = preset(arch_name)
    overrides = []
    if tiny:
        arch.update(TINY)
        arch.pop("head_dim", None)
        overrides = ["max_prompt_length=8", "max_completion_length=8"]
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):  # ids inside the vocabulary at any width
        if key in arch:
            arch[key] = arch["vocab_size"] - 1
    cfg = load_config(recipe, [f"model.config={json.dumps(arch)}", "model.name_or_path=''",
                               "model.tokenizer=none", *overrides], check=False)
    with torch.device(device):  # random weights made where they are used
        model = load_model(cfg.model, seed=0)
    return model.eval(), cfg.generation, bf16_autocast_wanted(cfg.model.bf16, device)


def first_differences(got: torch.Tensor, want: torch.Tensor) -> list[int]:
    """Per row, the first position where `got` and `want` (rows x tokens) differ; the row length if none."""
    differ = got != want
    return [int(row.nonzero()[0]) if row.any() else got.shape[1] for row in differ]


def compare(got: torch.Tensor, want: torch.Tensor) -> dict:
    first = first_differences(got, want)
    return {"rows_equal": sum(f == got.shape[1] for f in first) / len(first),
            "first_difference_min": min(first), "first_difference_median": statistics.median(first)}


def measure(arch_name: str, recipe: str, device: torch.device, tiny: bool) -> dict:
    from torch._dynamo.utils import counters
    model, gen, autocast = build(arch_name, recipe, device, tiny)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    G, rows = gen.num_generations, gen.generation_micro_batch_size
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab - 1, (gen.max_prompt_length,), generator=generator).tolist()
               for _ in range(max(rows // G, 1))]
    kw = dict(eos_ids=[], pad_id=vocab - 1, device=device, autocast_bf16=autocast)
    peak = peak_memory_bandwidth(device) if device.type == "cuda" else None

    def run(decode: str, max_new: int | None = None) -> tuple[float, torch.Tensor, SamplingStats]:
        stats = SamplingStats()
        torch.manual_seed(0)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        out = sample(model, prompts, G, gen, decode=decode, stats=stats, max_new_tokens=max_new, **kw)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0, out, stats

    def rates(seconds: float, out: torch.Tensor, stats: SamplingStats) -> dict:
        row = {"seconds": seconds, "tokens": out.numel(), "tokens_per_s": out.numel() / seconds,
               "decode_steps": stats.decode_steps, "decode_steps_per_s": stats.decode_steps / seconds,
               "weight_bytes_per_s": stats.decode_steps * param_bytes / seconds}
        if peak:
            row["of_peak_bandwidth"] = row["weight_bytes_per_s"] / peak
        return row

    result = {"arch": arch_name, "recipe": recipe, "tiny": tiny, "rows": len(prompts) * G, "G": G,
              "prompt_len": gen.max_prompt_length, "completion_len": gen.max_completion_length,
              "weights": str(next(model.parameters()).dtype), "autocast_bf16": autocast,
              "param_bytes": param_bytes, "peak_bandwidth_bytes_per_s": peak}
    run("static", max_new=4)  # first use of the kernels (cuBLAS, sdpa): not the step's cost
    seconds, eager, stats = run("static")
    result["eager"] = rates(seconds, eager, stats)
    eager_rate = result["eager"]["tokens_per_s"]
    print(f"  {arch_name} eager    {seconds:7.2f} s  {eager_rate:9.1f} tok/s", flush=True)
    graphs, skips = counters["stats"]["unique_graphs"], counters["inductor"]["cudagraph_skips"]
    first_s, first, _ = run("compiled")
    seconds, graphed, stats = run("compiled")
    c = result["compiled"] = {
        **rates(seconds, graphed, stats), "first_run_s": first_s, "compile_s": first_s - seconds,
        "graphs": counters["stats"]["unique_graphs"] - graphs,
        "cudagraph_skips": counters["inductor"]["cudagraph_skips"] - skips,
        "tokens_vs_eager": {"first_run": compare(first, eager), "timed_run": compare(graphed, eager)}}
    print(f"  {arch_name} compiled {seconds:7.2f} s  {c['tokens_per_s']:9.1f} tok/s "
          f"(first run {first_s:.1f} s), {c['tokens_per_s'] / eager_rate:.2f}x eager; rows equal to eager's: "
          f"{c['tokens_vs_eager']['timed_run']['rows_equal']:.2f}", flush=True)
    del model
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main(argv=None) -> int:
    allocator = use_train_allocator()  # as the trainer's rollouts run: first, before CUDA starts
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", action="append", required=True, metavar="ARCH:RECIPE",
                    help="an architecture preset and the recipe whose settings it decodes with (repeatable)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="toy width and depth, 8-token sequences (rehearsals)")
    ap.add_argument("--json", default=None, help="write the results here (after every shape)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    report = {"machine": machine_info(device.type), "allocator": allocator, "shapes": []}
    for shape in args.shape:
        arch_name, _, recipe = shape.partition(":")
        report["shapes"].append(measure(arch_name, recipe, device, args.tiny))
        if args.json:
            write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
