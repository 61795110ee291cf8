"""The planner's host RAM equals what a run pins, to the byte: the real offloaded optimizer and the
streamed reference built on tiny models (CPU), against `plan` for the same architecture and settings."""

import json

import pytest
import torch

import lowmem_grpo.host_arena as host_arena
from lowmem_grpo.config import load_config
from lowmem_grpo.memory.plan import Arch, optimizer_state_bytes, plan
from lowmem_grpo.host_arena import PAGE
from lowmem_grpo.optim.optimizers import build_optimizer

from .test_plan import MINIMAL, TINY

UNTIED = {**TINY, "vocab_size": 999, "tie_word_embeddings": False}  # an odd vocabulary: (V, H) not 64-aligned


def _model(config: dict, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM
    conf = dict(config)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(conf.pop("model_type"), **conf)).to(dtype)


@pytest.mark.parametrize("config", [TINY, UNTIED], ids=["tied", "untied"])
@pytest.mark.parametrize("precision,optimizer", [("bf16_sr", "adamw_8bit"), ("bf16_sr", "adamw"),
                                                 ("fp32", "adamw_8bit"), ("fp32", "adamw")])
@pytest.mark.parametrize("accumulation", [1, 4])
def test_pinned_host_bytes_equal_the_plan(config, precision, optimizer, accumulation):
    pytest.importorskip("bitsandbytes")
    cfg = load_config(None, MINIMAL + [f"precision={precision}", f"optimizer={optimizer}", "offload_optimizer=true",
                                       f"gradient_accumulation_steps={accumulation}", "beta=0"])
    model = _model(config, torch.bfloat16 if precision == "bf16_sr" else torch.float32)
    opt = build_optimizer(model, cfg.optim, stochastic_rounding=precision == "bf16_sr", in_backward=True)
    opt.split_tied_head(model)  # the trainer's call
    blocks = [opt.arena] + ([opt.head_arena] if opt.head_arena is not None else [])
    assert (opt.head_arena is not None) == config["tie_word_embeddings"]
    pinned = sum(b.nbytes for b in blocks)  # what a GPU run page-locks (here: plain memory, the same layout)
    assert all(b.nbytes % PAGE == 0 for b in blocks)
    if accumulation > 1:  # micro-batches after the first send their gradients through the staging ring
        pinned += opt.staging_ring().nbytes

    planned = plan(cfg, Arch.from_config(config))  # device cuda: what the plan is for
    host = planned.host_categories
    assert planned.host_pinned_bytes == pinned
    assert sum(host[c] for c in planned.host_pinned) == pinned
    block = next(iter(opt.host_grad.values())).untyped_storage().data_ptr()
    masters = [h for p, h in opt.host.items() if h.dtype != p.dtype]
    if optimizer == "adamw" and precision == "bf16_sr":  # fp32 masters: ordinary memory, outside the block
        assert planned.host_pinned == ["gradient buffer"]
        assert host["weights copy"] == sum(4 * h.numel() for h in masters) == 4 * sum(p.numel() for p in opt.host)
        assert all(h.untyped_storage().data_ptr() != block for h in masters)
    else:  # the weight copy is in the weight dtype: it crosses PCIe, so it is in the block
        assert not masters and planned.host_pinned == ["weights copy", "gradient buffer"]
        assert all(h.untyped_storage().data_ptr() == block for h in opt.host.values())
    # The states (ordinary memory, made at the first step) are what the start-up check was told.
    sizes = [p.numel() for p in model.parameters()]
    assert host["optimizer states"] == optimizer_state_bytes(sizes, optimizer, 4 if optimizer == "adamw" else 2)


def test_streamed_reference_block_equals_the_plan(monkeypatch):
    # The reference streamed on a GPU lives in one pinned block (policy/reference.py); the CUDA
    # registration is faked here, the block and its bytes are real.
    from lowmem_grpo.policy.reference import pinned_copies
    registered = []
    monkeypatch.setattr(host_arena, "_register", lambda base: registered.append(base.numel()))
    monkeypatch.setattr(host_arena, "_unregister", lambda base: registered.append("unregistered"))
    model = _model(TINY, torch.bfloat16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    arena = pinned_copies(list(model.parameters()))
    assert registered == [arena.nbytes]  # registered once, after the copies
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k  # the same values, now in the block
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # still tied
    cfg = load_config(None, MINIMAL + ["precision=bf16_sr", "beta=0.04", "reference_compute=stream"])
    planned = plan(cfg, Arch.from_config(TINY))
    assert planned.host_pinned == ["reference model"]
    assert planned.host_categories["reference model"] == arena.nbytes == planned.host_pinned_bytes
    arena.release()
    assert registered[-1] == "unregistered"


def test_plan_prints_the_pinned_total_apart_from_the_rest(capsys):
    from lowmem_grpo.cli.plan import run
    args = ["precision=bf16_sr", "optimizer_in_backward=true", "offload_optimizer=true", "beta=0",
            "max_completion_length=64"]
    assert run(None, "Qwen2.5-0.5B", "8GiB", args, True, host_memory="64GiB") == 0
    out = json.loads(capsys.readouterr().out)
    host = out["host_categories"]
    assert out["host_pinned"] == ["weights copy", "gradient buffer"]
    assert out["host_pinned_bytes"] == host["weights copy"] + host["gradient buffer"]
    assert out["host_bytes"] - out["host_pinned_bytes"] == host["optimizer states"]
    assert run(None, "Qwen2.5-0.5B", "8GiB", args, False, host_memory="64GiB") == 0
    text = capsys.readouterr().out
    line = next(x for x in text.splitlines() if "pinned (page-locked" in x)
    assert f"{out['host_pinned_bytes'] / 2**30:.3f} GiB (weights copy, gradient buffer)" in line
    assert f"not pinned: {host['optimizer states'] / 2**30:.3f} GiB" in line
