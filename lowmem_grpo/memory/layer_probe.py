"""Per-token activation costs of one decoder layer, measured once per architecture and dtype setting.

The planner cannot count what autograd saves by reading a config: it depends on the layer's code
(Qwen3's q/k norms, GQA), on autocast (which ops cast, which copies it keeps: with fp32 weights the
residual stream stays fp32 while matmuls output bf16) and on the attention kernel. So it measures:
a one-layer model of the architecture, random weights (no download), is run forward and backward on
the CPU at 64 and 128 tokens, and a dispatch-level tracker records the bytes of every tensor the ops
return, live at once. The difference between the two lengths is the cost per token (fixed costs
such as autocast's weight copies cancel; the planner counts those itself). A few hundred ms.

Design notes: docs/planner.md ("The layer probe")
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..config import ConfigError
from ..policy.decode_slots import returned_cache

PROBE_LEN = 64


@dataclass(frozen=True)
class LayerCosts:
    """Bytes per token of one decoder layer."""

    saved: float  # kept for backward after the layer's forward (its output included)
    forward_peak: float  # most alive during the layer's forward (saved + transient)
    backward_peak: float  # most alive during its backward above what the forward left (input grads only)
    kv_cache: float  # the KV cache it keeps when generating
    no_grad_peak: float  # most alive during a no-grad forward that fills the KV cache (cache included)
    norm_saved: float  # what the final RMSNorm keeps for backward (output included)
    # under model.offload_activations: what the final norm's saves send to the host (a tensor saved twice
    # goes once), and what of norm_saved stays on the device (its output)
    norm_offloaded: float = 0.0
    norm_left_offloaded: float = 0.0


class _LiveBytes(TorchDispatchMode):
    """Bytes of the storages that ops returned and that are still alive; and their peak."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def current(self) -> int:
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            del self.live[key]
        return sum(n for _, n in self.live.values())

    def reset_peak(self) -> None:
        self.peak = self.current()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = _matmul_in_fp32(func, args, kwargs or {})
        if out is None:
            out = func(*args, **(kwargs or {}))
        self.current()  # drop what was freed, so a reused address is a new storage
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                s = t.untyped_storage()
                if s.data_ptr() not in self.live and s.nbytes():
                    self.live[s.data_ptr()] = (StorageWeakRef(s), s.nbytes())
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


_MATMULS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
                       torch.ops.aten.baddbmm.default})
_HALF = (torch.bfloat16, torch.float16)


def _matmul_in_fp32(func, args, kwargs):
    """A 16-bit CPU matmul computed in fp32 and rounded back: the same shape, dtype and bytes, which is all the
    probe reads. On a CPU without AVX-512, torch runs 16-bit matmuls in its reference loops (no oneDNN kernel),
    which took minutes per 7-8B layer. None where `func` is not one (the op runs as it is)."""
    if func not in _MATMULS:
        return None
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not tensors or any(t.device.type != "cpu" or t.dtype not in _HALF for t in tensors):
        return None
    dtype = tensors[0].dtype
    widened = [a.float() if isinstance(a, torch.Tensor) else a for a in args]
    return func(*widened, **kwargs).to(dtype)


def _cache_bytes(cache) -> int:
    tensors = []
    for layer in getattr(cache, "layers", []):  # transformers >= 4.56 DynamicCache
        tensors += [getattr(layer, "keys", None), getattr(layer, "values", None)]
    if not tensors and hasattr(cache, "key_cache"):
        tensors = list(cache.key_cache) + list(cache.value_cache)
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _measure(decoder, norm, hidden: int, batch: int, dtype: torch.dtype, autocast: bool) -> tuple[int, ...]:
    x = torch.randn(batch, PROBE_LEN, hidden, dtype=dtype, requires_grad=True)
    with _LiveBytes() as probe:
        base = probe.current()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = decoder(inputs_embeds=x, use_cache=False).last_hidden_state
        saved, fwd_peak = probe.current() - base, probe.peak - base
        grad_out = torch.ones_like(out)
        probe.reset_peak()
        start = probe.current()
        torch.autograd.grad(out, x, grad_out)
        bwd_peak = probe.peak - start
    del out
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), _LiveBytes() as probe:
        kv = _cache_bytes(returned_cache(decoder(inputs_embeds=x.detach(), use_cache=True)))
        no_grad_peak = probe.peak
    with _LiveBytes() as probe, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        normed = norm(x)
        norm_saved = probe.current()
        del normed
    # The same under activation offload's hooks, every saved tensor moved (the host copies are live tensors
    # here too: told apart by the bytes the hooks moved)
    from ..training.activation_offload import offload_activations
    hooks = offload_activations(min_bytes=0, copy_on_cpu=True)
    with _LiveBytes() as probe, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), hooks:
        normed = norm(x)
        norm_offloaded, norm_left = hooks.offloaded_bytes, probe.current() - hooks.offloaded_bytes
        del normed
    return saved, fwd_peak, bwd_peak, kv, no_grad_peak, norm_saved, norm_offloaded, norm_left


@functools.lru_cache(maxsize=64)
def _probe(config_json: str, dtype_name: str, autocast: bool) -> LayerCosts:
    from transformers import AutoConfig, AutoModelForCausalLM
    conf = json.loads(config_json)
    conf.update(num_hidden_layers=1, vocab_size=256, tie_word_embeddings=False, pad_token_id=None,
                bos_token_id=None, eos_token_id=None)
    conf.pop("layer_types", None)  # per-layer lists sized for the full depth
    config = AutoConfig.for_model(conf.pop("model_type"), **conf)
    dtype = getattr(torch, dtype_name)
    with torch.random.fork_rng(devices=[]):  # the caller's random stream is left as it was
        torch.manual_seed(0)
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
            decoder = model.model.train()
            norm, decoder.norm = decoder.norm, torch.nn.Identity()  # the layer alone; the final norm apart
            small = _measure(decoder, norm, config.hidden_size, 1, dtype, autocast)
            large = _measure(decoder, norm, config.hidden_size, 2, dtype, autocast)
        except Exception as e:  # an architecture whose decoder is not the usual model.model / inputs_embeds
            raise ConfigError(f"the planner could not measure one {config.model_type} layer ({type(e).__name__}: "
                              f"{e}); it supports decoder-only models with model.model.norm, as transformers' "
                              "Llama/Qwen/SmolLM families") from e
    per_token = [(b - a) / PROBE_LEN for a, b in zip(small, large)]
    return LayerCosts(*per_token)


def layer_costs(config: dict, weight_dtype: torch.dtype, autocast: bool) -> LayerCosts:
    """Per-token costs of one decoder layer of `config` (a transformers config dict with model_type)."""
    keep = {k: v for k, v in config.items() if not k.startswith("_") and k not in ("architectures", "torch_dtype",
                                                                                 "dtype", "transformers_version")}
    return _probe(json.dumps(keep, sort_keys=True, default=str), str(weight_dtype).split(".")[-1], bool(autocast))
