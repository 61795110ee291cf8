"""Rollout speed: completion tokens per second of transformers' generate() vs the fast sampler, without
and with continuous refill, and with the static-shape decode step, eager and compiled (issue 27).

    python benchmarks/rollout_speed.py --arch SmolLM2-135M --prompts 8 --G 8 --max-new 64 --eos-hazard 0.05 \
        --micro-batch 16 --repeats 3 --json runs/rollout_speed.json

Three paths on the same inputs:
  generate  `lowmem_grpo.policy.rollout.generate` with generation.fast_rollout false: transformers'
            generate() on micro-batches of left-padded rows;
  fast      policy/sampling.py's `sample` with refill=False: one prefill per prompt, finished rows leave
            the batch, but a new micro-batch starts only when the last row of the previous one has
            finished (the loop before issue 27);
  refill    `sample` as rollout.generate runs it: a finished row's slot takes the next waiting sample.
  static    refill with the static-shape step (policy/static_decode.py), eager: the preallocated cache,
            the step at batch-size buckets;
  compiled  the same step under torch.compile, as generation.compile_decode runs it (on CUDA: CUDA graphs
            per batch x length bucket, captured by each rollout: policy/decode_graphs.py).
  packed    refill with the Linear weights packed once per rollout into oneDNN's GEMM layout
            (generation.pack_decode_weights, policy/packed_linear.py; CPU only);
  packed-head  the same with the output head's weight alone packed (generation.pack_decode_weights=head);
  vllm      generation.engine=vllm (policy/vllm_engine.py): vLLM in this process on a copy of the weights
            (needs vLLM: `make test-vllm`'s venv; with --eos-hazard 0, since the EOS bias below is a hook on
            this process's model, which vLLM does not run).
Only the paths named in --paths run (default generate, fast, refill).

The GEMM-only bound, measured in the same run (benchmarks/decode_profile.py): one decode step's bare GEMMs
(every Linear weight times a (micro-batch, in) input through torch.matmul, and on the CPU again through
oneDNN's packed weights: "fp32 packed", "bf16 packed", the latter through fp32 copies where the CPU has
no bf16 GEMM, as the packed paths run it), fp32 and bf16, timed before each repeat's paths;
"gemm_bound_tokens_per_s" = micro-batch / the fastest step's seconds. Each path's "fraction_of_gemm_bound"
divides its tokens/s by the bound of the GEMMs it runs (packed for the packed paths) in the dtype its
matmuls run in (bf16 with --dtype bf16 or --autocast); "fraction_of_fastest_gemm_bound", by the faster of
the plain and packed bounds in that dtype (the bound the CPU's GEMMs give, whichever way they run).
--profile: after the timed runs, one more rollout of each sampler path under torch.profiler, its time split
into GEMM / attention / the model's other ops / sampling and loop / untraced.
--op-census: after the timed runs, one more rollout of each sampler path counting the dispatcher ops of its
decode steps' forwards (decode_profile.op_census): per step and per layer, by kind (GEMM, views, other) and
by name, and the ops per step outside the forward (prefills, sampling, bookkeeping).

On a GPU (benchmarks/gpu_session.sh part rollout-*): --paths refill,static,compiled --eos-hazard 0 (every
row runs --max-new tokens) --dtype bf16. The compiled path's warm-up (one whole rollout, which compiles and
captures each bucket it meets) is timed apart ("warmup_seconds"). "weight_gb_per_s" is the decode steps'
weight reads alone (decode steps x parameter bytes / seconds): a lower bound on the bandwidth used, to set
against the card's roofline (H100 SXM: 3.35 TB/s).
--tiny: the architecture at toy width and depth (the CPU rehearsal of the GPU session).
--narrow: the architecture at its own depth, every width at a minimum (hidden 64, one head of 64, vocabulary
1024): its step time is what a step costs per op and per layer whatever the GEMMs (dispatch, Python, thread
hand-offs), to set beside the full model's step time and its GEMM bound.
--autocast: fp32 weights decoding under bf16 autocast, as the recipes with fp32 master weights (the 0.5B
ones) roll out: the eager paths cast each weight once per rollout (autocast's cache), the compiled path
decodes from bf16 copies made once per rollout (policy/static_decode.py, bf16_weight_copies); the matmuls
read bf16 weights either way, so "weight_gb_per_s" counts 2 bytes per parameter then.

Set-up: a random-weight model of the architecture preset (lowmem_grpo/memory/presets.py; speed does not
depend on weight values, no download), fp32 weights, `--prompts` prompts of random ids, lengths spread
uniformly over prompt-len +- 25%, each repeated G times (as the trainer calls it), temperature 1.
Completion lengths are controlled: a forward hook adds a constant to the EOS logit, calibrated on the
prompts so that EOS has probability ~`--eos-hazard` per step (geometric lengths, mean ~1/hazard, cut at
--max-new), as a trained policy's varied lengths would be; a random model alone almost never stops.

Timing: one short warm-up run per path, then `--repeats` runs per path, the paths alternating and each
run seeded the same for every path; wall time around the whole call. "tokens" are the useful completion
tokens (up to and including EOS), the quantity a rollout exists to produce; the paths draw different
random streams, so their lengths differ a little and tokens/s is the fair rate. For the two sampler
paths the sampler's own counts (SamplingStats) are summed over the timed runs: mean rows per decode
step overall and while samples still waited for a slot (the micro-batch, when refill keeps it full);
generate()'s row-steps are counted from its lengths (every row until its micro-batch's longest ends).
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
from decode_profile import gemm_bound, op_census, profile_parts, step_gflop
from lowmem_grpo.config import GenerationConfig
from lowmem_grpo.memory.presets import preset
from lowmem_grpo.policy.batch import eos_mask
from lowmem_grpo.policy.rollout import generate
from lowmem_grpo.policy.sampling import SamplingStats, sample


TINY = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 1024}  # as trainer_step.py's


# --narrow: the architecture at its own depth with every width at a minimum (one head of 64), so that a decode
# step's GEMMs, attention reads and elementwise work nearly vanish and what is left is its cost per op and per
# layer (dispatch, Python, thread hand-offs): the part of a step that does not shrink with faster GEMMs
NARROW = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 1, "num_key_value_heads": 1,
          "head_dim": 64, "vocab_size": 1024}


def build_model(arch: str, device: torch.device, dtype: torch.dtype = torch.float32, tiny: bool = False,
                narrow: bool = False):
    from transformers import AutoConfig, AutoModelForCausalLM
    spec = preset(arch)
    small = TINY if tiny else NARROW if narrow else None
    if small is not None:
        spec.update(small)
        if tiny:
            spec.pop("head_dim", None)
        for key in ("eos_token_id", "bos_token_id", "pad_token_id"):  # ids inside the small vocabulary
            if key in spec:
                spec[key] = small["vocab_size"] - 1
    model_type = spec.pop("model_type")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **spec))
    return (model.to(device, dtype).eval(), spec["eos_token_id"],
            spec.get("pad_token_id", spec["eos_token_id"]))


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


def run(model, prompts, distinct, cfg, path: str, *, G, eos, pad, device, seed, autocast=False):
    """One rollout by `path`: (seconds, completion tokens, mean length over rows, truncated fraction, stats)."""
    stats = SamplingStats()
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    if path == "vllm":
        completions = ENGINE["vllm"].generate(prompts, eos_ids=[eos], pad_id=pad)[0].completion_ids
    elif path == "generate":
        completions = generate(model, prompts, dataclasses.replace(cfg, fast_rollout=False), eos_ids=[eos],
                               pad_id=pad, device=device, autocast_bf16=autocast).completion_ids
    else:
        completions = sample(model, distinct, G, cfg, eos_ids=[eos], pad_id=pad, device=device, stats=stats,
                             refill=path != "fast", decode=DECODE.get(path, "dynamic"),
                             autocast_bf16=autocast, packed=PACKED.get(path, False))
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    mask, truncated = eos_mask(completions, [eos])
    return seconds, mask, truncated, stats


def generate_row_steps(lengths, micro_batch: int) -> int:
    """Decode forwards x rows generate() runs: every row of a micro-batch until its longest row ends."""
    return sum(len(chunk) * (int(chunk.max()) - 1) for chunk in lengths.split(micro_batch))


PATHS = ("generate", "fast", "refill", "static", "compiled", "packed", "packed-head", "vllm")
ENGINE: dict = {}  # the vLLM engine of the run, when --paths names it
DECODE = {"static": "static", "compiled": "compiled"}  # sample()'s decode per path (else "dynamic")
PACKED = {"packed": True, "packed-head": "head"}  # sample()'s packed per path (else False)
BOUNDS = (("fp32", torch.float32, False), ("bf16", torch.bfloat16, False), ("fp32 packed", torch.float32, True),
          ("bf16 packed", torch.bfloat16, True))  # the GEMM-only bounds: name, dtype, packed weights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", default="SmolLM2-135M", help="preset name (lowmem_grpo/memory/presets.py)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--G", type=int, default=8, help="completions per prompt")
    parser.add_argument("--prompt-len", type=int, default=60, help="mean prompt length (spread +-25%%)")
    parser.add_argument("--max-new", type=int, default=64)
    parser.add_argument("--max-prompt-length", type=int, default=None,
                        help="generation.max_prompt_length (default: the longest prompt); with --max-new it sets the "
                             "static paths' cache length, which their attention reads whole every step")
    parser.add_argument("--eos-hazard", type=float, default=0.03, help="P(EOS) per step; 0 = never stop early")
    parser.add_argument("--micro-batch", type=int, default=64, help="generation_micro_batch_size")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--paths", default="generate,fast,refill", help=f"comma-separated, of {', '.join(PATHS)}")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="the model's weights")
    parser.add_argument("--tiny", action="store_true", help="the architecture at toy width and depth (rehearsals)")
    parser.add_argument("--narrow", action="store_true",
                        help="the architecture at its own depth and minimal width: a step's cost per op and layer")
    parser.add_argument("--autocast", action="store_true",
                        help="decode under bf16 autocast (with --dtype fp32: the fp32-master-weight recipes)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--profile", action="store_true",
                        help="one more rollout per sampler path under torch.profiler: time by part")
    parser.add_argument("--op-census", action="store_true",
                        help="one more rollout per sampler path counting its decode steps' dispatcher ops")
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    args = parser.parse_args()
    paths = [p for p in args.paths.split(",") if p]
    if not paths or any(p not in PATHS for p in paths):
        parser.error(f"--paths: choose from {', '.join(PATHS)}, got {args.paths!r}")
    if "vllm" in paths and (args.eos_hazard > 0 or args.autocast):
        parser.error("--paths vllm: use --eos-hazard 0 (the EOS bias is a hook vLLM does not run) and no --autocast")
    if args.autocast and args.dtype != "fp32":
        parser.error("--autocast decodes fp32 weights under bf16 autocast: use it with --dtype fp32")

    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    if args.tiny and args.narrow:
        parser.error("--tiny and --narrow are two different small models: choose one")
    model, eos, pad = build_model(args.arch, device, dtype, args.tiny, args.narrow)
    param_bytes = sum(p.numel() * (2 if args.autocast else p.element_size()) for p in model.parameters())
    distinct = make_prompts(args.prompts, args.prompt_len, model.config.vocab_size, eos)
    bias = add_eos_bias(model, distinct, eos, args.eos_hazard, device) if args.eos_hazard > 0 else None
    prompts = [p for p in distinct for _ in range(args.G)]
    cfg = GenerationConfig(max_completion_length=args.max_new, generation_micro_batch_size=args.micro_batch,
                           max_prompt_length=args.max_prompt_length or max(len(p) for p in distinct))
    print(f"{args.arch}{' (tiny)' if args.tiny else ' (narrow)' if args.narrow else ''} random {args.dtype} weights"
          f"{' under bf16 autocast' if args.autocast else ''} on {device}: {args.prompts} prompts "
          f"({[len(p) for p in distinct]} tokens) "
          f"x G={args.G}, max {args.max_new} new tokens, micro-batch {args.micro_batch}, EOS logit bias {bias}")

    if "vllm" in paths:
        from lowmem_grpo.policy.vllm_engine import VLLMEngine
        t0 = time.perf_counter()
        ENGINE["vllm"] = VLLMEngine(model, cfg, device=device, seed=0, max_num_seqs=len(prompts))  # as the trainer
        print(f"  vLLM start-up {time.perf_counter() - t0:7.2f} s")
    kw = dict(G=args.G, eos=eos, pad=pad, device=device, autocast=args.autocast)
    warmup = {}
    for path in paths:  # warm-up; the static paths' shapes depend on the length limit: a whole rollout
        short = path not in DECODE
        warmup[path] = run(model, prompts, distinct, dataclasses.replace(cfg, max_completion_length=4) if short else cfg,
                           path, seed=0, **kw)[0]
        print(f"  warm-up  {path:8s} {warmup[path]:7.2f} s")
    runs: dict[str, list[dict]] = {path: [] for path in paths}
    bound: dict[str, list[float]] = {}  # seconds of one step's bare GEMMs, per repeat, by kind
    stats = {path: SamplingStats() for path in paths if path not in ("generate", "vllm")}
    for r in range(args.repeats):
        if device.type == "cpu":
            for name, dt, packed in BOUNDS:
                bound.setdefault(name, []).append(gemm_bound(model, args.micro_batch, dt, packed=packed))
            print(f"  repeat {r} GEMM bound: " + ", ".join(f"{k} {args.micro_batch / v[-1]:7.1f} tok/s"
                                                           for k, v in bound.items())
                  + f" ({step_gflop(model, args.micro_batch):.1f} GFLOP per step)")
        for path in paths:
            seconds, mask, truncated, st = run(model, prompts, distinct, cfg, path, seed=1000 + r, **kw)
            tokens = int(mask.sum())
            runs[path].append({"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
                               "mean_length": tokens / len(prompts), "truncated": float(truncated.float().mean()),
                               "generate_row_steps": generate_row_steps(mask.sum(1), args.micro_batch),
                               "sampler": dataclasses.asdict(st)})
            if path in stats:
                for f in dataclasses.fields(SamplingStats):
                    setattr(stats[path], f.name, getattr(stats[path], f.name) + getattr(st, f.name))
            print(f"  repeat {r} {path:8s} {seconds:7.2f} s  {tokens:5d} tokens  {tokens / seconds:7.1f} tok/s  "
                  f"mean length {tokens / len(prompts):.1f}, truncated {runs[path][-1]['truncated']:.2f}")

    summary = {}
    for path, rs in runs.items():
        total_t, total_n = sum(x["seconds"] for x in rs), sum(x["tokens"] for x in rs)
        summary[path] = {"median_seconds": statistics.median(x["seconds"] for x in rs), "tokens": total_n,
                         "seconds": total_t, "tokens_per_s": total_n / total_t,
                         "mean_length": total_n / (len(prompts) * len(rs)), "warmup_seconds": warmup[path]}
        if path in stats:
            summary[path].update(mean_rows_per_step=stats[path].mean_rows_per_step,
                                 mean_rows_per_step_queued=stats[path].mean_rows_per_step_queued,
                                 decode_row_steps=stats[path].decode_row_steps, refills=stats[path].refills,
                                 compactions=stats[path].compactions, prefill_rows=stats[path].prefill_rows,
                                 weight_gb_per_s=stats[path].decode_steps * param_bytes / total_t / 1e9)
        else:
            row_steps = sum(x["generate_row_steps"] for x in rs)
            summary[path].update(decode_row_steps=row_steps)
    for path, x in summary.items():
        rows = (f", {x['mean_rows_per_step']:.1f} rows per decode step ({x['mean_rows_per_step_queued']:.1f} while "
                f"samples waited), {x['decode_row_steps']} row-steps, {x['refills']} refills, "
                f"{x['compactions']} compactions, {x['prefill_rows']} prefills, weights read at "
                f"{x['weight_gb_per_s']:.1f} GB/s"
                if path in stats else "" if path == "vllm" else
                f", {x['decode_row_steps']} row-steps (counted from its lengths)")
        print(f"{path:8s} {x['tokens_per_s']:7.1f} tok/s, median {x['median_seconds']:.2f} s per rollout, "
              f"mean length {x['mean_length']:.1f}{rows}")
    gemm = {name: args.micro_batch / min(ts) for name, ts in bound.items() if ts}
    if gemm:
        matmul_dtype = "bf16" if args.dtype == "bf16" or args.autocast else "fp32"
        fastest = max(v for k, v in gemm.items() if k.split()[0] == matmul_dtype)
        for path, x in summary.items():
            own = f"{matmul_dtype} packed" if PACKED.get(path) is True else matmul_dtype
            x["fraction_of_gemm_bound"] = x["tokens_per_s"] / gemm.get(own, gemm[matmul_dtype])
            x["fraction_of_fastest_gemm_bound"] = x["tokens_per_s"] / fastest
        print(f"GEMM-only bound ({step_gflop(model, args.micro_batch):.1f} GFLOP per step): "
              + ", ".join(f"{k} {v:.1f} tok/s" for k, v in gemm.items()) + f"; fraction of the {matmul_dtype} "
              "bound of its own GEMMs (of the fastest): " + ", ".join(
                  f"{p} {x['fraction_of_gemm_bound']:.2f} ({x['fraction_of_fastest_gemm_bound']:.2f})"
                  for p, x in summary.items()))
    profiles = {}
    if args.profile:
        for path in (p for p in paths if p in stats):
            profiles[path] = profile_parts(lambda: run(model, prompts, distinct, cfg, path, seed=7, **kw), model)
            wall = profiles[path]["wall"]
            print(f"profile {path:8s} {wall:7.2f} s: " + ", ".join(
                f"{k} {v / wall:.0%}" for k, v in profiles[path].items() if k != "wall"))
    census = {}
    if args.op_census:
        for path in (p for p in paths if p in stats):
            census[path] = c = op_census(lambda: run(model, prompts, distinct, cfg, path, seed=7, **kw), model)
            layers = model.config.get_text_config().num_hidden_layers
            print(f"op census {path:8s} {c['per_step']:.0f} ops per decode step's forward ({c['per_layer']:.1f} "
                  "per layer: " + ", ".join(f"{k} {v / layers:.1f}" for k, v in c["by_kind"].items())
                  + f"), {c['outside_forward_per_step']:.0f} per step outside it; most per layer: "
                  + ", ".join(f"{k} {v / layers:.1f}" for k, v in list(c["by_name"].items())[:12]))
    ratios = {f"{a}/{b}": summary[a]["tokens_per_s"] / summary[b]["tokens_per_s"]
              for a, b in (("fast", "generate"), ("refill", "generate"), ("refill", "fast"), ("static", "refill"),
                           ("compiled", "refill"), ("compiled", "static"), ("packed", "refill"), ("packed", "static"),
                           ("packed-head", "refill"), ("packed", "vllm"), ("packed-head", "vllm"), ("vllm", "refill"),
                           ("vllm", "generate"))
              if a in summary and b in summary}
    for name, value in ratios.items():
        print(f"speed-up {name} (tokens/s): {value:.2f}x")
    if args.json:
        write_json(args.json, {"args": vars(args), "machine": machine_info(device.type), "eos_logit_bias": bias,
                               "prompt_lengths": [len(p) for p in distinct], "runs": runs, "summary": summary,
                               "gemm_bound_tokens_per_s": gemm, "gemm_bound_step_seconds": bound, "profiles": profiles,
                               "op_census": census, "speedups_tokens_per_s": ratios})


if __name__ == "__main__":
    main()
