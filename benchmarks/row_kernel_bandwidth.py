"""Speed of the row kernels (token_logprobs, grpo_token_loss) against the memory-bandwidth roofline.

The log-softmax-gather is memory-bound: per row of V logits the forward reads V elements, the
backward reads V and writes V (in place). So with bf16 logits [N, V]:
    forward  bytes = 2 N V          backward bytes = 4 N V
The roofline is the device's copy bandwidth, measured here with `dst.copy_(src)` on a buffer of
the same size (reads + writes counted), so the ratio needs no spec-sheet number. For comparison the
naive torch version (fp32 log_softmax, gather, autograd) is timed on the same input.

    python benchmarks/row_kernel_bandwidth.py [--tokens 4096] [--vocab 151936] [--json PATH]

On CPU the kernels run their torch path; numbers are then labelled CPU and only compare the two.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from lowmem_grpo.kernels import grpo_token_loss, token_logprobs


def timed(fn, device, repeats):
    fn()  # warm-up: compilation and allocator
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    N, V = args.tokens, args.vocab
    torch.manual_seed(0)
    base = torch.randn(N, V, device=device, dtype=torch.bfloat16)
    ids = torch.randint(0, V, (N,), device=device)
    adv = torch.randn(1, device=device)
    grad = torch.randn(N, device=device)
    elt = base.element_size()

    copy_dst = torch.empty_like(base)
    t_copy = timed(lambda: copy_dst.copy_(base), device, args.repeats)
    roofline = 2 * N * V * elt / t_copy  # bytes/s, read + write

    def ours_fwd():
        with torch.no_grad():
            token_logprobs(base, ids)

    work = base.clone()

    def ours_fwd_bwd():  # a non-leaf logits tensor, so backward writes dlogits into `work` in place
        logits = work.requires_grad_(False).clone().requires_grad_() * 1
        torch.autograd.backward(token_logprobs(logits, ids), grad)

    def fused_loss_fwd_bwd():
        logits = work.clone().requires_grad_() * 1
        out = grpo_token_loss(logits.view(1, N, V), ids.view(1, N), adv)
        out.loss.sum().backward()

    def naive_fwd_bwd():
        logits = work.clone().requires_grad_() * 1
        logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, None])[:, 0]
        torch.autograd.backward(logp, grad)

    t_clone = timed(lambda: work.clone().requires_grad_() * 1, device, args.repeats)  # set-up cost, subtracted
    t_fwd = timed(ours_fwd, device, args.repeats)
    t_fb = timed(ours_fwd_bwd, device, args.repeats) - t_clone
    t_loss = timed(fused_loss_fwd_bwd, device, args.repeats) - t_clone
    t_naive = timed(naive_fwd_bwd, device, args.repeats) - t_clone
    label = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    rows = {
        "copy (roofline)": (t_copy, 2 * N * V * elt),
        "token_logprobs fwd": (t_fwd, N * V * elt),
        "token_logprobs fwd+bwd": (t_fb, 3 * N * V * elt),
        "grpo_token_loss fwd+bwd": (t_loss, 3 * N * V * elt),
        "naive fwd+bwd": (t_naive, 3 * N * V * elt),  # the minimum traffic; naive moves far more
    }
    print(f"{label}: N={N} V={V} bf16 logits; roofline = measured copy bandwidth {roofline / 1e9:.0f} GB/s")
    print(f"{'op':<26}{'time ms':>10}{'GB/s':>10}{'of roofline':>13}")
    result = {"device": label, "tokens": N, "vocab": V, "roofline_GBps": roofline / 1e9, "ops": {}}
    for name, (t, nbytes) in rows.items():
        bw = nbytes / t
        print(f"{name:<26}{t * 1e3:>10.2f}{bw / 1e9:>10.0f}{bw / roofline:>12.0%}")
        result["ops"][name] = {"ms": t * 1e3, "GBps": bw / 1e9, "fraction_of_roofline": bw / roofline}
    print(f"speed-up of fused fwd+bwd over naive: {t_naive / t_fb:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
