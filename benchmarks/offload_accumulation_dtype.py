"""The offloaded optimizer's host accumulation dtype (optim/offload.py): error of summing
micro-batch gradients in bf16 (the weight dtype: one rounding per add, as autograd sums .grad on the
device) or in fp32 (2 more bytes per parameter of host RAM), against the exact sum (fp64), for
gradient_accumulation_steps = 2, 4, 8, 16.

Gradients: the bf16 gradients of a small random Llama (tied embedding, 4 layers) for different
micro-batches of random tokens -- real per-tensor scales and heavy tails, and micro-batches that share a
common direction plus their own noise, as GRPO's do. Each micro-batch's loss is divided by the number of
micro-batches, as the trainer does. Reported per ga: the relative error ||acc - exact|| / ||exact|| over
all parameters, for bf16 and fp32 accumulation; for reference, the error of rounding the exact sum
once to bf16 (the best a bf16 gradient can be), and the sampling noise of the gradient itself: the
relative difference between the exact sums of two disjoint sets of ga micro-batches (two estimates of
the same expected gradient).

    python benchmarks/offload_accumulation_dtype.py [--ga-max 16] [--seed 0]
"""

from __future__ import annotations

import argparse

import torch


def micro_batch_gradients(n: int, seed: int) -> list[list[torch.Tensor]]:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    model = model.to(torch.bfloat16)
    params = [p for p in model.parameters()]
    grads = []
    for i in range(n):
        ids = torch.randint(0, 2048, (4, 64), generator=torch.Generator().manual_seed(seed * 1000 + i))
        logits = model(input_ids=ids).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten()) / n
        grads.append([g.detach().clone() for g in torch.autograd.grad(loss, params)])
    return grads


def relative_error(acc: list[torch.Tensor], exact: list[torch.Tensor]) -> float:
    num = sum(float((a.double() - e).pow(2).sum()) for a, e in zip(acc, exact))
    den = sum(float(e.pow(2).sum()) for e in exact)
    return (num / den) ** 0.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ga-max", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    grads = micro_batch_gradients(2 * args.ga_max, args.seed)
    print(f"{'ga':>3} {'bf16 acc':>10} {'fp32 acc':>10} {'exact->bf16':>11} {'sampling':>10}   "
          "(relative to the fp64 sum)")
    ga = 2
    while ga <= args.ga_max:
        # Each ga's sum of its first ga micro-batches; the gradients are divided by 2 x ga_max, not ga:
        # a common scale, which changes no relative error.
        exact = [sum(g[t].double() for g in grads[:ga]) for t in range(len(grads[0]))]
        other = [sum(g[t].double() for g in grads[ga:2 * ga]) for t in range(len(grads[0]))]
        bf16 = [g.clone() for g in grads[0]]
        fp32 = [g.float() for g in grads[0]]
        for g in grads[1:ga]:
            for a, b, x in zip(bf16, fp32, g):
                a.add_(x)  # bf16 += bf16: one rounding, as autograd's .grad accumulation
                b.add_(x)
        rounded = [e.to(torch.bfloat16) for e in exact]
        print(f"{ga:>3} {relative_error(bf16, exact):>10.2e} {relative_error(fp32, exact):>10.2e} "
              f"{relative_error(rounded, exact):>11.2e} {relative_error(other, exact):>10.2e}")
        ga *= 2


if __name__ == "__main__":
    main()
