"""The optimizer step inside backward: each parameter is updated as soon as its gradient is complete,
then its gradient is freed, so no full-model gradient ever exists (1.5B bf16: saves 2.9 GiB).

Mechanics: a post-accumulate-grad hook on every parameter (torch's `register_post_accumulate_grad_hook`)
runs the parameter's own optimizer (one per parameter, so Adam's per-parameter update is exactly the
same as in a normal step) and sets `.grad = None`. Autograd sums every gradient contribution of a
leaf before its hook fires, so a tied embedding (input embedding + lm head) gets one update with
both contributions.

Consequences, stated plainly:
- One backward = one optimizer step: gradient accumulation is impossible (each micro-batch is an
  optimizer step; GRPO then takes PPO-style mini-batch steps over the generation batch, with stored
  old log-probs).
- Clipping without a global norm: when a tensor's gradient is ready, the others are not, so the
  global norm is unknown. We clip per tensor, each to its share of max_grad_norm:
  cap_p = max_grad_norm * sqrt(numel_p / numel_total). If every tensor sits at its cap, the global
  norm equals max_grad_norm; a tensor is never scaled because of another tensor's gradient. The
  reported grad_norm is the true global norm before clipping (summed as the hooks run).
- A non-finite gradient tensor is not applied (its update is skipped); the step is reported as
  skipped. Tensors updated earlier in the same backward keep their update (the trainer checks the
  loss before backward, which catches the common case).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from ..phases import mark_gradient, scope


NORM_CHUNK = 1 << 20  # elements


def fp32_norm(t: torch.Tensor) -> float:
    """The L2 norm accumulated in fp32, over 1M-element chunks: the CPU widens a bf16 tensor to fp32
    before reducing it, which for the embedding's gradient would be a whole fp32 copy."""
    flat = t.reshape(-1)
    chunks = [torch.linalg.vector_norm(flat[i:i + NORM_CHUNK], dtype=torch.float32)
              for i in range(0, flat.numel(), NORM_CHUNK)]
    return float(torch.linalg.vector_norm(torch.stack(chunks))) if chunks else 0.0


class OptimizerInBackward(torch.optim.Optimizer):
    """Looks like one optimizer to the LR scheduler and checkpoints; steps happen in backward hooks.

    `make_inner(params_groups)` builds the per-parameter optimizer (e.g. bitsandbytes AdamW8bit).
    The outer param_groups hold the learning rate that schedulers set; hooks copy it to the inner one.
    """

    def __init__(self, groups: list[dict], make_inner: Callable[[list[dict]], torch.optim.Optimizer],
                 max_grad_norm: float | None, defaults: dict | None = None):
        super().__init__(groups, dict(defaults or {}))  # defaults (lr, betas, ...) fill each group
        self.params = [p for g in self.param_groups for p in g["params"]]
        total = sum(p.numel() for p in self.params)
        self.inner = {}
        self.caps = {}
        for index, group in enumerate(self.param_groups):
            options = {k: v for k, v in group.items() if k != "params"}
            for p in group["params"]:
                self.inner[p] = make_inner([{"params": [p], **options}])
                self.caps[p] = None if not max_grad_norm else max_grad_norm * math.sqrt(p.numel() / total)
                # By index, not by dict: load_state_dict replaces the group dicts the scheduler writes to.
                p.register_post_accumulate_grad_hook(self._hook(index))
        self.active = False
        self._sq_norm = 0.0
        self.nonfinite_tensors = 0
        self.max_live_grads = 0  # most parameters holding a gradient at once during the last backward
        self.max_live_grad_bytes = 0  # and the most gradient bytes alive at once (memory accounting checks it)

    def _hook(self, group_index: int):
        def hook(p: torch.Tensor) -> None:
            if not self.active:  # a backward outside a training step (e.g. a user's probe): leave .grad
                return
            live = [q.grad for q in self.params if q.grad is not None]
            self.max_live_grads = max(self.max_live_grads, len(live))
            self.max_live_grad_bytes = max(self.max_live_grad_bytes, sum(g.numel() * g.element_size() for g in live))
            mark_gradient(p.grad)  # for a running memory profile (lowmem_grpo.memory.profile); free otherwise
            with scope("optimizer"):
                norm = fp32_norm(p.grad)
                self._sq_norm += norm * norm
                if not math.isfinite(norm):
                    self.nonfinite_tensors += 1
                else:
                    cap = self.caps[p]
                    if cap is not None and norm > cap:
                        p.grad.mul_(cap / (norm + 1e-6))
                    inner = self.inner[p]
                    inner.param_groups[0]["lr"] = self.param_groups[group_index]["lr"]
                    inner.step()
            p.grad = None  # the point of this optimizer: the gradient dies right here
        return hook

    def begin_step(self) -> None:
        self.active, self._sq_norm, self.nonfinite_tensors = True, 0.0, 0
        self.max_live_grads = self.max_live_grad_bytes = 0

    def end_step(self) -> float:
        """Finish the step that the backward just ran; returns the global gradient norm (before clipping)."""
        self.active = False
        return math.sqrt(self._sq_norm)

    def step(self, closure=None):  # the real steps ran in backward
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def state_dict(self) -> dict:
        return {"outer": super().state_dict(), "inner": [self.inner[p].state_dict() for p in self.params]}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state["outer"])
        for p, s in zip(self.params, state["inner"]):
            self.inner[p].load_state_dict(s)

