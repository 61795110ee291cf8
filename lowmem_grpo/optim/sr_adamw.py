"""bf16 weights whose optimizer updates land: bitsandbytes 8-bit AdamW with stochastic rounding.

A bf16 parameter is updated chunk by chunk (`CHUNK` elements): widened to fp32, stepped by bitsandbytes'
blockwise 8-bit kernel with the matching slices of its states, and rounded stochastically back to bf16
(E[round(x)] = x). Extra memory: one fp32 chunk. States keep bitsandbytes' format; fp32 parameters take
bitsandbytes' normal path.

Design notes: docs/memory-modes.md ("bf16 weights with stochastic rounding")
"""

from __future__ import annotations

import torch
from torch import Tensor

BLOCK = 256  # bitsandbytes' blockwise quantisation block (elements)
CHUNK = 1 << 20  # elements per fp32 working chunk: 4 MiB of fp32


def stochastic_round_to_bf16(x: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Unbiased rounding of fp32 `x` to bf16 (same shape). Uses the global RNG unless given one."""
    if x.dtype != torch.float32:
        raise TypeError(f"stochastic_round_to_bf16 takes fp32, got {x.dtype}")
    bits = x.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    # Keep the high 16 bits after adding the noise: the result is exactly representable in bf16.
    rounded = (bits + noise) & -65536  # -65536 == 0xFFFF0000 as int32
    return rounded.view(torch.float32).to(torch.bfloat16)


def _bnb():
    import logging
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)  # see optim.build_optimizer
    import bitsandbytes as bnb
    return bnb


def _flat_state(state: Tensor):
    """A function (a, b) -> elements [a, b) of a state buffer, as a view that bitsandbytes accepts.

    Paged states (PagedAdamW8bit on CUDA) are CUDA managed memory wrapped as CPU tensors and marked
    with `is_paged` / `page_deviceid` attributes; a view or slice is a new tensor object without them,
    which bitsandbytes would reject as a CPU tensor mixed with CUDA ones. Copy the marks over."""
    flat = state.view(-1)
    marks = {k: getattr(state, k) for k in ("is_paged", "page_deviceid") if hasattr(state, k)}

    def chunk(a: int, b: int) -> Tensor:
        view = flat[a:b]
        for k, v in marks.items():
            setattr(view, k, v)
        return view

    return chunk


def sr_adamw8bit_class(paged: bool = False):
    """AdamW8bit (or PagedAdamW8bit) with stochastic rounding for bf16 parameters."""
    bnb = _bnb()
    F = bnb.functional
    base = bnb.optim.PagedAdamW8bit if paged else bnb.optim.AdamW8bit

    class AdamW8bitSR(base):
        """bitsandbytes 8-bit AdamW; bf16 parameters get the chunked fp32 update + stochastic rounding."""

        @torch.no_grad()
        def update_step(self, group, p, gindex, pindex):
            if p.dtype != torch.bfloat16:
                return super().update_step(group, p, gindex, pindex)
            p.data = p.data.contiguous()
            grad = p.grad.contiguous()
            state = self.state[p]
            config = self.get_config(gindex, pindex, group)
            state["step"] += 1
            step = state["step"]
            b1, b2 = config["betas"][0], config["betas"][1]
            b3 = config["betas"][2] if len(config["betas"]) >= 3 else 0.0
            flat_p, flat_g = p.data.view(-1), grad.view(-1)
            s1, s2 = (_flat_state(state[k]) for k in ("state1", "state2"))
            eight_bit = state["state1"].dtype == torch.uint8
            for a in range(0, flat_p.numel(), CHUNK):
                b = min(a + CHUNK, flat_p.numel())
                p32 = flat_p[a:b].float()  # exact widening
                g32 = flat_g[a:b].float()
                if eight_bit:  # the chunk starts on a block boundary, so its absmax slice lines up
                    blocks = slice(a // BLOCK, (b + BLOCK - 1) // BLOCK)
                    F.optimizer_update_8bit_blockwise(
                        self.optimizer_name, g32, p32, s1(a, b), s2(a, b), b1, b2, b3, config.get("alpha", 0.0),
                        config["eps"], step, config["lr"], state["qmap1"], state["qmap2"],
                        state["absmax1"][blocks], state["absmax2"][blocks], config["weight_decay"],
                        gnorm_scale=1.0, skip_zeros=config["skip_zeros"])
                else:  # tensors under min_8bit_size keep fp32 states, as in bitsandbytes
                    F.optimizer_update_32bit(
                        self.optimizer_name, g32, p32, s1(a, b), b1, config["eps"], step, config["lr"], s2(a, b), b2,
                        b3, config.get("alpha", 0.0), config["weight_decay"], 1.0, None,
                        max_unorm=0.0, skip_zeros=config["skip_zeros"])
                # the offloaded optimizer's per-step generator (offload.py), else the global RNG
                flat_p[a:b].copy_(stochastic_round_to_bf16(p32, getattr(self, "rounding_generator", None)))

    return AdamW8bitSR
