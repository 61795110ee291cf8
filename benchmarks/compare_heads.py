"""Our fused loss head against the field's, on the same inputs (issue 25, item 1).

The same hidden states (B, T, H), lm_head weight (V, H), ids, advantages, old and reference log-probs go
through four paths, each a GRPO loss whose backward fills hidden.grad and weight.grad:
  naive  logits = hidden @ W.T in the input dtype, fp32 log_softmax, gather, TRL's per-token loss.
  trl    TRL's fused LM head (trl.kernels.ChunkedLogProbFunction, what `add_fused_lm_head` patches into
         the model: the kept rows, 32768-wide vocabulary tiles) followed by TRL's per-token loss and
         reduction, transcribed from GRPOTrainer._compute_loss (TRL has no standalone loss function).
  liger  liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss with its defaults (compiled=True, one
         sequence per chunk); compiled=False when torch.compile cannot run (said in the row).
  ours   lowmem_grpo.kernels.linear_grpo_loss.
A path whose package is not installed, or that cannot fit in this machine's memory, is a row saying
so. Per path: loss error and gradient errors (max |g - g64| / max |g64| for dh and dW) against an
exact fp64 values computed from the same (dtype-rounded) inputs, peak memory during one fwd+bwd (tracked
bytes on the CPU, lowmem_grpo.memory.track; allocator peak on a GPU; inputs not counted, gradients
counted), and the median fwd+bwd time of --repeats runs after one warm-up (the warm-up is the one
measured for memory).

Inputs: N completion tokens as N // T sequences of T = min(N, 512) tokens, no padding; hidden ~ N(0, 1),
W ~ N(0, 4 / H) (logits of std ~2); old_logp = logp + 0.3 N(0,1) and ref_logp = logp + 0.5 N(0,1)
around the exact log-probs, so ratios fall on both sides of the clip range (eps 0.2); temperature 1.

    python benchmarks/compare_heads.py --quick                       # seconds: the test suite runs it
    python benchmarks/compare_heads.py --tokens 8192 --hidden 1536 --dtypes float32 bfloat16 \
        --loss-types dapo --betas 0.04 --json runs/compare_heads.json  # the issue's target point
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch
from torch import Tensor

from lowmem_grpo.kernels import linear_grpo_loss
from lowmem_grpo.kernels import spec
from lowmem_grpo.memory.track import track

VOCAB = 151936  # Qwen2.5
EPSILON = 0.2
SEQ_LEN = 512
PATHS = ("naive", "trl", "liger", "ours")
EXACT_ROWS = 256  # rows per chunk of the exact fp64 values (256 x V x 8 bytes ~ 0.3 GiB at V = 151936)


@dataclass
class Setting:
    n_tokens: int
    hidden: int
    vocab: int
    dtype: str
    loss_type: str
    beta: float

    @property
    def shape(self) -> tuple[int, int]:
        T = min(self.n_tokens, SEQ_LEN)
        if self.n_tokens % T:
            raise ValueError(f"--tokens must be a multiple of {SEQ_LEN} above it, got {self.n_tokens}")
        return self.n_tokens // T, T


@dataclass
class Row:
    setting: Setting
    path: str
    status: str = "ok"  # "ok", or why the path did not run
    loss_rel_err: Optional[float] = None
    dh_rel_err: Optional[float] = None
    dw_rel_err: Optional[float] = None
    peak_bytes: Optional[int] = None
    seconds: list[float] = field(default_factory=list)

    @property
    def median_s(self) -> Optional[float]:
        return statistics.median(self.seconds) if self.seconds else None


# ---- inputs and the exact fp64 values ----------------------------------------------------------------


def make_inputs(s: Setting, device: str, seed: int = 0) -> dict[str, Tensor]:
    """fp32 leaves (cast per dtype later) and the exact fp64 log-probs the old/ref log-probs sit around."""
    B, T = s.shape
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, s.hidden, generator=g)  # (B, T, H)
    weight = torch.randn(s.vocab, s.hidden, generator=g) * (2.0 / s.hidden**0.5)  # (V, H)
    ids = torch.randint(0, s.vocab, (B, T), generator=g)
    advantages = torch.randn(B, generator=g)
    return {"hidden": hidden.to(device), "weight": weight.to(device), "ids": ids.to(device),
            "advantages": advantages.to(device), "noise_old": 0.3 * torch.randn(B, T, generator=g).to(device),
            "noise_ref": 0.5 * torch.randn(B, T, generator=g).to(device)}


def _row_chunks(n: int):
    for start in range(0, n, EXACT_ROWS):
        yield slice(start, min(start + EXACT_ROWS, n))


def exact_logp(hidden: Tensor, weight: Tensor, ids: Tensor, dtype: torch.dtype = torch.float64) -> Tensor:
    """Log-probs (B, T) of hidden/weight as given (already rounded to the path dtype), computed in `dtype`
    (fp64 for the exact values; fp32 where they only seed old/ref log-probs) in row chunks."""
    B, T, H = hidden.shape
    h, w, flat = hidden.reshape(-1, H).to(dtype), weight.to(dtype), ids.reshape(-1)
    out = torch.empty(B * T, dtype=dtype, device=hidden.device)
    for rows in _row_chunks(B * T):
        out[rows] = torch.log_softmax(h[rows] @ w.T, -1).gather(1, flat[rows, None]).squeeze(1)
    return out.view(B, T)


LOSS_TYPES = ("dapo", "grpo", "bnpo", "dr_grpo", "cispo", "sapo", "luspo", "vespo")
PPO_CLIP = ("dapo", "grpo", "bnpo", "dr_grpo")  # the per-token loss transcribed from TRL below


def reduce_like_trl(per_token: Tensor, mask: Tensor, loss_type: str, max_completion_length: int) -> Tensor:
    """GRPOTrainer._compute_loss's reductions (one micro-batch, no accumulation, one process)."""
    if loss_type in ("grpo", "sapo"):
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token * mask).sum() / (per_token.size(0) * max_completion_length)
    if loss_type in ("dapo", "cispo", "vespo"):
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    if loss_type == "luspo":
        return (per_token * mask).sum(-1).mean()
    raise ValueError(f"unknown loss_type {loss_type!r}; this benchmark runs {', '.join(LOSS_TYPES)}")


def exact_loss_and_grads(hidden, weight, ids, adv, old, ref, logp64, s: Setting):
    """fp64 loss, dh and dW by the chain rule in row chunks (no (N, V) tensor): the per-token loss from the
    spec (kernels.spec.grpo_token_terms) on fp64 log-probs gives dL/dlogp; then per chunk
    dlogits = dL/dlogp * (onehot - softmax), dh = dlogits @ W, dW += dlogits.T @ h."""
    B, T, H = hidden.shape
    x = logp64.clone().requires_grad_()
    mask = torch.ones(B, T, dtype=torch.float64, device=x.device)
    terms = spec.grpo_token_terms(x, adv.double(), old_logp=old.double(), ref_logp=ref.double() if s.beta else None,
                                  epsilon_low=EPSILON, beta=s.beta, loss_type=s.loss_type)
    loss = reduce_like_trl(terms["loss"], mask, s.loss_type, T)
    (g_logp,) = torch.autograd.grad(loss, x)
    h, w, flat, g = hidden.reshape(-1, H).double(), weight.double(), ids.reshape(-1), g_logp.reshape(-1)
    dh, dw = torch.empty_like(h), torch.zeros_like(w)
    for rows in _row_chunks(B * T):
        dlogits = -torch.softmax(h[rows] @ w.T, -1)  # (rows, V)
        dlogits[torch.arange(rows.stop - rows.start), flat[rows]] += 1.0
        dlogits *= g[rows, None]
        dh[rows] = dlogits @ w
        dw += dlogits.T @ h[rows]
    return loss.item(), dh.view(B, T, H), dw


# ---- the four paths ----------------------------------------------------------------------------------


def trl_per_token_loss(logp, old, ref, adv, mask, s: Setting) -> Tensor:
    """GRPOTrainer._compute_loss (TRL 1.16), token-level ratio, no delta / off-policy mask / vLLM correction;
    the other loss types' per-token terms from the spec (spec.grpo_token_terms, TRL's formulas)."""
    if s.loss_type not in PPO_CLIP:
        terms = spec.grpo_token_terms(logp, adv, old_logp=old, ref_logp=ref if s.beta else None, epsilon_low=EPSILON,
                                      beta=s.beta, loss_type=s.loss_type)
        return reduce_like_trl(terms["loss"], mask, s.loss_type, logp.shape[1])
    advantages = adv.unsqueeze(1)
    coef_1 = torch.exp(logp - old)
    coef_2 = torch.clamp(coef_1, 1 - EPSILON, 1 + EPSILON)
    per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    if s.beta != 0.0:
        per_token_loss = per_token_loss + s.beta * (torch.exp(ref - logp) - (ref - logp) - 1)
    return reduce_like_trl(per_token_loss, mask, s.loss_type, logp.shape[1])


def naive_path(s: Setting) -> Callable:
    def run(hidden, weight, ids, adv, old, ref):
        logits = hidden @ weight.T  # (B, T, V) in the input dtype
        logp = torch.log_softmax(logits.float(), -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)  # (B, T)
        return trl_per_token_loss(logp, old, ref, adv, torch.ones_like(logp), s)
    return run


def trl_path(s: Setting) -> Callable:
    from trl.kernels import ChunkedLogProbFunction
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

    def run(hidden, weight, ids, adv, old, ref):
        mask = torch.ones(ids.shape, dtype=torch.bool, device=ids.device)
        logp, *_ = ChunkedLogProbFunction.apply(hidden[mask], weight, None, ids[mask], 1.0,
                                                _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0, ("log_probs",))
        logp = logp.new_zeros(mask.shape).masked_scatter(mask, logp)  # as add_fused_lm_head does
        return trl_per_token_loss(logp, old, ref, adv, mask.float(), s)
    return run


def liger_path(s: Setting, compiled: bool) -> Callable:
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    B, T = s.shape
    module = LigerFusedLinearGRPOLoss(beta=s.beta, compiled=compiled, use_ref_model=s.beta != 0.0,
                                      epsilon_low=EPSILON, epsilon_high=EPSILON, loss_type=s.loss_type,
                                      max_completion_length=T)

    def run(hidden, weight, ids, adv, old, ref):
        mask = torch.ones(ids.shape, dtype=torch.long, device=ids.device)
        loss, _ = module(hidden, weight, ids, mask, adv, ref_per_token_logps=ref if s.beta else None,
                         old_per_token_logps=old)
        return loss
    return run


def ours_path(s: Setting) -> Callable:
    def run(hidden, weight, ids, adv, old, ref):
        loss, _ = linear_grpo_loss(hidden, weight, ids, adv, old_logp=old, ref_logp=ref if s.beta else None,
                                   epsilon_low=EPSILON, beta=s.beta, loss_type=s.loss_type)
        return loss
    return run


def missing_package(path: str) -> Optional[str]:
    module = {"trl": "trl", "liger": "liger_kernel"}.get(path)
    if module and importlib.util.find_spec(module) is None:
        dist = "liger-kernel" if module == "liger_kernel" else module
        return f"not installed (pip install '.[bench]' or {dist})"
    return None


def package_version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


def available_bytes(device: str) -> int:
    if device == "cuda":
        free, _ = torch.cuda.mem_get_info()
        return free
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return info["MemAvailable"]


def naive_bytes(s: Setting) -> int:
    """The naive head's peak: the logits in the input dtype + three fp32 (N, V) tensors in log_softmax's
    backward (saved output, incoming gradient, input gradient)."""
    itemsize = torch.finfo(getattr(torch, s.dtype)).bits // 8
    return s.n_tokens * s.vocab * (itemsize + 12)


# ---- measuring ---------------------------------------------------------------------------------------


def _rel(a: Tensor, b: Tensor) -> float:
    return ((a.double() - b).abs().max() / b.abs().max().clamp(min=1e-300)).item()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(path: str, run: Callable, leaves: dict, consts: tuple, exact64, s: Setting, repeats: int,
            device: str) -> Row:
    row = Row(s, path)
    hidden, weight = leaves["hidden"], leaves["weight"]

    def step():
        hidden.grad = weight.grad = None
        loss = run(hidden, weight, *consts)
        loss.backward()
        return loss

    gc.collect()
    _sync(device)
    start = time.perf_counter()
    with track(device) as tracked:  # the warm-up, measured for memory
        loss = step()
    if repeats == 0:  # --repeats 0 (a long CPU run): the warm-up is the one timed run, profiler on
        row.seconds.append(time.perf_counter() - start)
    row.peak_bytes = tracked.peak_bytes
    if exact64 is not None:
        loss64, dh64, dw64 = exact64
        row.loss_rel_err = abs(loss.item() - loss64) / max(abs(loss64), 1e-300)
        row.dh_rel_err, row.dw_rel_err = _rel(hidden.grad, dh64), _rel(weight.grad, dw64)
    for _ in range(repeats):
        hidden.grad = weight.grad = None
        gc.collect()
        _sync(device)
        start = time.perf_counter()
        step()
        _sync(device)
        row.seconds.append(time.perf_counter() - start)
    hidden.grad = weight.grad = None
    return row


def run_setting(s: Setting, base: dict, logp64: Tensor, paths, repeats: int, device: str, with_exact: bool,
                log, rows: list[Row], save: Callable[[], None]) -> None:
    """Measure every path at setting `s`, appending to `rows` and calling save() after each."""
    dtype = getattr(torch, s.dtype)
    hidden = base["hidden"].to(dtype, copy=True).requires_grad_()
    weight = base["weight"].to(dtype, copy=True).requires_grad_()
    old = (logp64 + base["noise_old"]).float()
    ref = (logp64 + base["noise_ref"]).float()
    consts = (base["ids"], base["advantages"], old, ref)
    exact64 = None
    if with_exact:
        start = time.perf_counter()
        exact64 = exact_loss_and_grads(hidden.detach(), weight.detach(), base["ids"], base["advantages"], old, ref,
                                       logp64, s)
        log(f"    exact fp64 values [{time.perf_counter() - start:.0f} s]")
    for path in paths:
        why = missing_package(path)
        if why is None and path == "naive" and naive_bytes(s) > 0.8 * available_bytes(device):
            why = (f"skipped: needs ~{naive_bytes(s) / 2**30:.1f} GiB, more than 80% of the "
                   f"{available_bytes(device) / 2**30:.1f} GiB available")
        if why is not None:
            rows.append(Row(s, path, status=why))
            log(f"    {path:5s} {why}")
            save()
            continue
        status = "ok"
        if path == "liger":
            run, status = _liger_runner(s, device)
        else:
            run = {"naive": naive_path, "trl": trl_path, "ours": ours_path}[path](s)
        start = time.perf_counter()
        row = measure(path, run, {"hidden": hidden, "weight": weight}, consts, exact64, s, repeats, device)
        row.status = status
        rows.append(row)
        log(f"    {path:5s} {format_row(row)}  [{time.perf_counter() - start:.0f} s]")
        save()  # a long run stopped early keeps what it measured
        gc.collect()


def _liger_runner(s: Setting, device: str):
    """Liger as users get it (compiled=True), if torch.compile handles this (B, T) here: probed on the same
    (B, T) with a tiny H and V after a dynamo reset (a shape seen before makes dynamo mark it dynamic, which
    fails on torch 2.13: "sources must not be empty for symbol"); else its loss math uncompiled."""
    probe = Setting(s.n_tokens, 8, 16, s.dtype, s.loss_type, s.beta)
    t = make_inputs(probe, device)
    h = t["hidden"].to(getattr(torch, s.dtype)).requires_grad_()
    w = t["weight"].to(getattr(torch, s.dtype)).requires_grad_()
    lp = torch.full(probe.shape, -2.0, device=device)
    torch._dynamo.reset()
    try:
        liger_path(probe, compiled=True)(h, w, t["ids"], t["advantages"], lp, lp).backward()
        return liger_path(s, compiled=True), "ok"
    except Exception as err:  # noqa: BLE001 - any compile failure: report it and run uncompiled
        torch._dynamo.reset()
        return liger_path(s, compiled=False), f"compiled=False: torch.compile failed ({type(err).__name__})"


def format_row(r: Row) -> str:
    if r.median_s is None and r.peak_bytes is None:
        return r.status

    def e(x):
        return "-" if x is None else f"{x:.1e}"

    t = "-" if r.median_s is None else f"{r.median_s:.3f} s"
    return (f"loss err {e(r.loss_rel_err)}  dh err {e(r.dh_rel_err)}  dW err {e(r.dw_rel_err)}  "
            f"peak {r.peak_bytes / 2**20:,.0f} MiB  fwd+bwd {t}" + ("" if r.status == "ok" else f"  ({r.status})"))


def markdown(rows: list[Row]) -> str:
    lines = ["| N | H | V | dtype | loss | beta | path | loss err | dh err | dW err | peak (MiB) | fwd+bwd (s) |",
             "|---:|---:|---:|---|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        s = r.setting
        head = f"| {s.n_tokens} | {s.hidden} | {s.vocab} | {s.dtype} | {s.loss_type} | {s.beta} | {r.path} |"
        if r.peak_bytes is None:
            lines.append(head + f" {r.status} | | | | |")
            continue

        def e(x):
            return "-" if x is None else f"{x:.1e}"

        note = "" if r.status == "ok" else f" ({r.status})"
        t = "-" if r.median_s is None else f"{r.median_s:.2f}"
        lines.append(head.rstrip("|") + f"{note} | {e(r.loss_rel_err)} | {e(r.dh_rel_err)} | {e(r.dw_rel_err)} | "
                     f"{r.peak_bytes / 2**20:,.0f} | {t} |")
    return "\n".join(lines)


def main(argv=None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="N=512, H=64, V=4096, both dtypes, dapo, beta 0.04, 1 repeat: seconds")
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--hidden", type=int, nargs="+", default=[896, 1536])
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--loss-types", nargs="+", default=["dapo", "grpo"], choices=LOSS_TYPES)
    parser.add_argument("--betas", type=float, nargs="+", default=[0.0, 0.04])
    parser.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed runs after the warm-up (median reported); 0: time the warm-up itself")
    parser.add_argument("--no-exact", "--no-reference", dest="no_exact", action="store_true",
                        help="skip the exact fp64 values (no error columns); --no-reference is its old name")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", metavar="PATH", help="write the rows here")
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.hidden, args.vocab, args.repeats = [512], [64], 4096, 1
        args.loss_types, args.betas = ["dapo"], [0.04]

    def log(msg):
        print(msg, flush=True)

    log(f"compare_heads: device {args.device}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"load average {os.getloadavg()[0]:.1f} at start")
    for dist in ("trl", "liger-kernel"):
        log(f"  {dist}: {package_version(dist)}")
    rows: list[Row] = []
    for n in args.tokens:
        for H in args.hidden:
            base = make_inputs(Setting(n, H, args.vocab, "float32", "dapo", 0.0), args.device)
            for dtype in args.dtypes:
                d = getattr(torch, dtype)
                start = time.perf_counter()
                logp64 = exact_logp(base["hidden"].to(d), base["weight"].to(d), base["ids"],
                                    torch.float32 if args.no_exact else torch.float64)
                log(f"N={n} H={H} V={args.vocab} {dtype}: exact log-probs [{time.perf_counter() - start:.0f} s]")
                for loss_type in args.loss_types:
                    for beta in args.betas:
                        s = Setting(n, H, args.vocab, dtype, loss_type, beta)
                        log(f"  loss_type={loss_type} beta={beta}")
                        run_setting(s, base, logp64, args.paths, args.repeats, args.device, not args.no_exact,
                                    log, rows, lambda: args.json and write_json(args.json, args, rows))
            del base
            gc.collect()
    log("")
    log(markdown(rows))
    log(f"load average {os.getloadavg()[0]:.1f} at the end")
    if args.json:
        log(f"wrote {args.json}")
    return rows


def write_json(path: str, args, rows: list[Row]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"argv": sys.argv, "device": args.device, "torch": torch.__version__,
                   "trl": package_version("trl"), "liger-kernel": package_version("liger-kernel"),
                   "rows": [dict(asdict(r), median_s=r.median_s) for r in rows]}, f, indent=2)


if __name__ == "__main__":
    main()
