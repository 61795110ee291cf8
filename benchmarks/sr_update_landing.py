"""Do lr-1e-6 AdamW updates land in bf16 weights? fp32 vs bf16 + stochastic rounding vs bf16 + plain cast.

    python benchmarks/sr_update_landing.py [--steps 100] [--lr 1e-6]

A tiny random Llama (hidden 128, 2 layers) takes `steps` 8-bit AdamW steps on fixed random
gradients (the same for every mode; every mode starts from the same bf16-representable weights).
Reported per mode: mean |delta w| and the fraction of elements changed, for the attention/MLP
matrices and for the RMSNorm gains. The CPU test tests/optim/test_sr_adamw.py asserts the same contrast.
"""

import argparse

import torch


def run(dtype, cls, steps, lr):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    model = model.to(torch.bfloat16).to(dtype)
    start = {k: p.detach().float().clone() for k, p in model.named_parameters()}
    g = torch.Generator().manual_seed(1)
    grads = {k: (0.01 * torch.randn(p.shape, generator=g)).to(torch.bfloat16).to(dtype)
             for k, p in model.named_parameters()}
    opt = cls(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    torch.manual_seed(2)
    for _ in range(steps):
        for k, p in model.named_parameters():
            p.grad = grads[k].clone()
        opt.step()
    out = {}
    for group, keep in (("matrices", lambda k: k.endswith("proj.weight")), ("norm gains", lambda k: "norm" in k)):
        d = torch.cat([(p.detach().float() - start[k]).flatten() for k, p in model.named_parameters() if keep(k)])
        out[group] = (d.abs().mean().item(), (d != 0).float().mean().item())
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--lr", type=float, default=1e-6)
    args = ap.parse_args()
    from lowmem_grpo.optim.optimizers import build_optimizer  # noqa: F401  (quiets bitsandbytes' CPU probe warning)
    from lowmem_grpo.optim.sr_adamw import _bnb, sr_adamw8bit_class
    bnb = _bnb()
    modes = {"fp32 weights, AdamW8bit": (torch.float32, bnb.optim.AdamW8bit),
             "bf16 weights, AdamW8bit + stochastic rounding": (torch.bfloat16, sr_adamw8bit_class()),
             "bf16 weights, AdamW8bit (plain cast)": (torch.bfloat16, bnb.optim.AdamW8bit)}
    print(f"{args.steps} steps at lr {args.lr:g}, fixed gradients")
    print(f"{'mode':<48} {'matrices mean|dw|':>18} {'changed':>8} {'norms mean|dw|':>15} {'changed':>8}")
    for name, (dtype, cls) in modes.items():
        r = run(dtype, cls, args.steps, args.lr)
        print(f"{name:<48} {r['matrices'][0]:>18.3e} {r['matrices'][1]:>8.1%} {r['norm gains'][0]:>15.3e} "
              f"{r['norm gains'][1]:>8.1%}")


if __name__ == "__main__":
    main()
