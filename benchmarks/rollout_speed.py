"""Rollout speed: completion tokens per second of rollout.generate, generate() path vs the fast sampler.

    python benchmarks/rollout_speed.py --arch SmolLM2-135M --prompts 4 --G 8 --prompt-len 60 --max-new 64 \
        --eos-hazard 0.03 --repeats 3 --json runs/rollout_speed.json

Both paths are `lowmem_grpo.policy.rollout.generate` on the same inputs, with generation.fast_rollout
false ("generate": transformers' generate() on micro-batches of left-padded rows) and true ("fast":
policy/sampling.py: one prefill per prompt, finished rows leave the batch).

Set-up: a random-weight model of the architecture preset (lowmem_grpo/memory/presets.py; speed does not
depend on weight values, no download), fp32 weights, `--prompts` prompts of random ids, lengths spread
uniformly over prompt-len +- 25%, each repeated G times (as the trainer calls it), temperature 1.
Completion lengths are controlled: a forward hook adds a constant to the EOS logit, calibrated on the
prompts so that EOS has probability ~`--eos-hazard` per step (geometric lengths, mean ~1/hazard, cut at
--max-new), as a trained policy's varied lengths would be; a random model alone almost never stops.

Timing: one short warm-up run per path, then `--repeats` runs per path, the paths alternating and each
run seeded the same for both paths; wall time around the whole call. "tokens" are the useful completion
tokens (completion_mask: up to and including EOS), the quantity a rollout exists to produce; the two
paths draw different random streams, so their lengths differ a little and tokens/s is the fair rate.
Afterwards one untimed fast run reports what the sampler did (prefills, decode row-steps, compactions)
next to the row-steps generate() runs (every row until its micro-batch's longest row ends).
CPU timings move with anything else running on the machine: run it on a quiet one.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time

import torch

from bench_utils import machine_info, write_json
from lowmem_grpo.config import GenerationConfig
from lowmem_grpo.memory.presets import preset
from lowmem_grpo.policy.rollout import generate
from lowmem_grpo.policy.sampling import SamplingStats, sample


def build_model(arch: str, device: torch.device):
    from transformers import AutoConfig, AutoModelForCausalLM
    spec = preset(arch)
    model_type = spec.pop("model_type")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **spec))
    return model.to(device).eval(), spec["eos_token_id"], spec.get("pad_token_id", spec["eos_token_id"])


def make_prompts(n: int, length: int, vocab: int, eos: int) -> list[list[int]]:
    rng = random.Random(0)
    ids = [t for t in range(min(vocab, 4096)) if t != eos]
    lengths = [rng.randint(max(1, int(0.75 * length)), max(1, int(1.25 * length))) for _ in range(n)]
    return [[rng.choice(ids) for _ in range(k)] for k in lengths]


@torch.no_grad()
def add_eos_bias(model, prompts: list[list[int]], eos: int, hazard: float, device: torch.device) -> float:
    """Hook a constant onto the EOS logit so that P(EOS) ~ hazard at the prompts' last positions."""
    out = []
    for p in prompts:
        logits = model(torch.tensor([p], device=device)).logits[0, -1].float()  # (V,)
        others = torch.cat([logits[:eos], logits[eos + 1:]]).logsumexp(0)
        out.append((logits[eos] - others).item())
    bias = torch.logit(torch.tensor(hazard)).item() - statistics.mean(out)
    head = model.get_output_embeddings()
    head.register_forward_hook(lambda mod, args, logits: logits.index_add(
        -1, torch.tensor([eos], device=logits.device), torch.full((*logits.shape[:-1], 1), bias, dtype=logits.dtype,
                                                                  device=logits.device)))
    return bias


def run(model, prompts, cfg, *, eos, pad, device, seed):
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    batch = generate(model, prompts, cfg, eos_ids=[eos], pad_id=pad, device=device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, batch


def generate_row_steps(batch, micro_batch: int) -> int:
    """Decode forwards x rows generate() runs: every row of a micro-batch until its longest row ends."""
    lengths = batch.completion_mask.sum(1)
    return sum(len(chunk) * (int(chunk.max()) - 1) for chunk in lengths.split(micro_batch))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", default="SmolLM2-135M", help="preset name (lowmem_grpo/memory/presets.py)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--G", type=int, default=8, help="completions per prompt")
    parser.add_argument("--prompt-len", type=int, default=60, help="mean prompt length (spread +-25%%)")
    parser.add_argument("--max-new", type=int, default=64)
    parser.add_argument("--eos-hazard", type=float, default=0.03, help="P(EOS) per step; 0 = never stop early")
    parser.add_argument("--micro-batch", type=int, default=64, help="generation_micro_batch_size")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    args = parser.parse_args()

    device = torch.device(args.device)
    model, eos, pad = build_model(args.arch, device)
    distinct = make_prompts(args.prompts, args.prompt_len, model.config.vocab_size, eos)
    bias = add_eos_bias(model, distinct, eos, args.eos_hazard, device) if args.eos_hazard > 0 else None
    prompts = [p for p in distinct for _ in range(args.G)]
    base = GenerationConfig(max_completion_length=args.max_new, generation_micro_batch_size=args.micro_batch)
    cfgs = {"generate": dataclasses.replace(base, fast_rollout=False),
            "fast": dataclasses.replace(base, fast_rollout=True)}
    print(f"{args.arch} random weights on {device}: {args.prompts} prompts ({[len(p) for p in distinct]} tokens) "
          f"x G={args.G}, max {args.max_new} new tokens, EOS logit bias {bias}")

    for name, cfg in cfgs.items():  # warm-up
        run(model, prompts, dataclasses.replace(cfg, max_completion_length=4), eos=eos, pad=pad, device=device, seed=0)
    runs: dict[str, list[dict]] = {name: [] for name in cfgs}
    for r in range(args.repeats):
        for name, cfg in cfgs.items():
            seconds, batch = run(model, prompts, cfg, eos=eos, pad=pad, device=device, seed=1000 + r)
            tokens = int(batch.completion_mask.sum())
            runs[name].append({"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
                               "mean_length": tokens / len(prompts),
                               "truncated": float(batch.is_truncated.float().mean()),
                               "generate_row_steps": generate_row_steps(batch, args.micro_batch)})
            print(f"  repeat {r} {name:8s} {seconds:7.2f} s  {tokens:5d} tokens  {tokens / seconds:7.1f} tok/s  "
                  f"mean length {tokens / len(prompts):.1f}, truncated {runs[name][-1]['truncated']:.2f}")

    stats = SamplingStats()
    torch.manual_seed(1000)
    sample(model, distinct, args.G, base, eos_ids=[eos], pad_id=pad, device=device, stats=stats)
    summary = {}
    for name, rs in runs.items():
        total_t, total_n = sum(x["seconds"] for x in rs), sum(x["tokens"] for x in rs)
        summary[name] = {"median_seconds": statistics.median(x["seconds"] for x in rs), "tokens": total_n,
                         "seconds": total_t, "tokens_per_s": total_n / total_t,
                         "mean_length": total_n / (len(prompts) * len(rs))}
    speedup = summary["fast"]["tokens_per_s"] / summary["generate"]["tokens_per_s"]
    for name, x in summary.items():
        print(f"{name:8s} {x['tokens_per_s']:7.1f} tok/s, median {x['median_seconds']:.2f} s per rollout, "
              f"mean length {x['mean_length']:.1f}")
    print(f"speed-up (tokens/s): {speedup:.2f}x")
    print(f"fast sampler, one rollout: {stats.prefill_rows} prompt prefills (generate(): {len(prompts)}), "
          f"{stats.decode_row_steps} decode row-steps (generate() on its own draw: "
          f"{runs['generate'][0]['generate_row_steps']}), {stats.compactions} compactions")
    if args.json:
        write_json(args.json, {"args": vars(args), "machine": machine_info(device.type), "eos_logit_bias": bias,
                               "prompt_lengths": [len(p) for p in distinct], "runs": runs, "summary": summary,
                               "speedup_tokens_per_s": speedup, "fast_sampler_stats": dataclasses.asdict(stats)})


if __name__ == "__main__":
    main()
