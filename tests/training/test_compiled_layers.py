"""model.torch_compile (training/compiled_layers.py): the compiled decoder layers train like the eager ones
(parameters after several steps, within fp32 rounding), only inside the training passes, and a compile
failure falls back to the eager layers without losing the step; the settings TRL's way."""

import contextlib
import copy
import logging
import threading
import time

import pytest
import torch

from lowmem_grpo.config import ConfigError
from lowmem_grpo.training.compiled_layers import torch_compile_wanted
from lowmem_grpo.training.trainer import Trainer


def _steps(trainer: Trainer, batch, steps: int) -> dict:
    """`steps` optimizer steps on the same micro-batches of `batch`; the parameters after them."""
    for _ in range(steps):
        batch.steps_done = 0
        trainer.generation = batch
        metrics = trainer.optimizer_step()
        assert not metrics["skipped"] and metrics["grad_norm"] > 0
    trainer.step_mode.synchronize()  # the offload mode's last update lands on its thread
    return {k: v.detach().clone() for k, v in trainer.policy.named_parameters()}


def _train_alike(toy_config, settings: tuple, monkeypatch, rtol: float, atol: float) -> None:
    """Eager and compiled trainers of `settings`, 3 steps on the same batch: the same parameters."""
    torch._dynamo.reset()  # a graph of its own for this model, whatever ran before
    if "offload_optimizer=true" in settings:  # updates slowed on their thread: a forward must wait for them
        from lowmem_grpo.optim.offload import OffloadedOptimizer
        update = OffloadedOptimizer._update
        monkeypatch.setattr(OffloadedOptimizer, "_update", lambda self, *a, **k: (
            time.sleep(0.01) if threading.current_thread() is not threading.main_thread() else None,
            update(self, *a, **k))[1])
    eager = Trainer(toy_config(*settings))
    assert eager.compiled is None
    batch = eager.new_generation_batch()
    compiled = Trainer(toy_config(*settings, "torch_compile=true"))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    want = _steps(eager, copy.deepcopy(batch), 3)
    got = _steps(compiled, copy.deepcopy(batch), 3)
    assert compiled.compiled.failed is None and compiled.compiled.calls > 0
    if "layer_major_backward=true" in settings:  # both passes compiled: the no-grad one and the recomputation,
        assert compiled.compiled.calls == 3 * 2 * 2 * 2  # per step, micro-batch and layer
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs  # this model's layers were compiled
    for k, v in got.items():  # 3 steps of lr 1e-3 move a weight by up to ~3e-3
        torch.testing.assert_close(v, want[k], rtol=rtol, atol=atol, msg=k)
    # outside the training passes the layers are the eager ones again (the rollout, evaluation)
    assert all("forward" not in layer.__dict__ for layer in compiled.policy.model.layers)


OFFLOADED = ["offload_optimizer=true", "gradient_accumulation_steps=2", "steps_per_generation=2"]  # host update
# each layer recomputed and back-propagated for every micro-batch in turn (LayerMajorStep.finish)
LAYER_MAJOR = [*OFFLOADED, "gradient_checkpointing=true", "layer_major_backward=true"]
# Adam's eps at 1e-4: at 1e-8 an entry whose gradient is rounding noise moves by up to lr either way
SETTINGS = ("gradient_checkpointing=false", "adam_epsilon=1e-4")


@pytest.mark.parametrize("overrides", [[], ["gradient_checkpointing=true"], ["optimizer_in_backward=true"], OFFLOADED,
                                       LAYER_MAJOR, [*LAYER_MAJOR, "head_gradient_once_per_step=true"]])
def test_compiled_layers_train_like_the_eager_ones(toy_config, overrides, monkeypatch):
    _train_alike(toy_config, (*SETTINGS, *overrides), monkeypatch, rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run by benchmarks/gpu_session.sh)")
@pytest.mark.parametrize("overrides", [[], ["gradient_checkpointing=true"], OFFLOADED, LAYER_MAJOR])
def test_cuda_compiled_layers_train_like_the_eager_ones(toy_config, overrides, monkeypatch):
    # Inductor's fused kernels reduce in another order than eager's on the GPU: 1e-5 of a ~3e-3 move
    _train_alike(toy_config, (*SETTINGS, "device=cuda", *overrides), monkeypatch, rtol=1e-4, atol=1e-5)


def test_a_compile_failure_falls_back_to_the_eager_layers(toy_config, caplog):
    def refusing_backend(graph, example_inputs):
        raise RuntimeError("no compiler here")

    torch._dynamo.reset()
    from torch._dynamo.backends.registry import register_backend
    if "lowmem_test_refusing" not in torch._dynamo.list_backends(exclude_tags=()):  # once per process
        register_backend(refusing_backend, name="lowmem_test_refusing")
    eager = Trainer(toy_config("gradient_checkpointing=false"))
    batch = eager.new_generation_batch()
    compiled = Trainer(toy_config("gradient_checkpointing=false", "torch_compile_backend=lowmem_test_refusing"))
    with caplog.at_level(logging.WARNING, logger="lowmem_grpo.training.compiled_layers"):
        got = _steps(compiled, copy.deepcopy(batch), 2)
    want = _steps(eager, copy.deepcopy(batch), 2)
    assert "no compiler here" in compiled.compiled.failed and compiled.compiled.calls == 0
    assert sum("run eagerly from here on" in r.getMessage() for r in caplog.records) == 1
    assert all(torch.equal(v, want[k]) for k, v in got.items())  # the eager layers: the same bits


def test_a_checkpointed_layer_recomputation_may_stop_early_through_the_compiled_forward():
    """torch's non-reentrant checkpoint ends a recomputation early by raising through the layer's forward once
    it has what backward needs: the compiled layer lets that pass (not a compile failure, not an eager retry,
    which broke the checkpoint's state under transformers 5.17) and the gradients are the eager ones."""
    from lowmem_grpo.training.compiled_layers import CompiledLayers
    torch._dynamo.reset()
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.SiLU(), torch.nn.Linear(32, 16))
                                 for _ in range(2))
    x = torch.randn(3, 5, 16)

    def grads(compiled=None):
        for p in layers.parameters():
            p.grad = None
        with compiled.active() if compiled else contextlib.nullcontext(), \
                torch.utils.checkpoint.set_checkpoint_early_stop(True):
            h = x
            for layer in layers:
                h = torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=False)
            (h.square().sum() + h.sum()).backward()
        return [p.grad.clone() for p in layers.parameters()]

    want = grads()
    compiled = CompiledLayers(layers)
    got = grads(compiled)
    assert compiled.failed is None and compiled.calls == 2  # the forwards; each recomputation stopped early
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_torch_compile_settings_as_in_trl(toy_config):
    assert not torch_compile_wanted(toy_config().model)
    assert torch_compile_wanted(toy_config("torch_compile_mode=max-autotune-no-cudagraphs").model)
    assert torch_compile_wanted(toy_config("torch_compile_backend=eager").model)
    with pytest.raises(ConfigError, match="torch_compile_mode must be one of"):
        toy_config("torch_compile_mode=fastest")
    with pytest.raises(ConfigError, match="'no-such' is not a torch.compile backend: one of .*inductor"):
        Trainer(toy_config("torch_compile_backend=no-such"))


@pytest.mark.parametrize("overrides, match", [
    (["gradient_checkpointing=true", "offload_activations=true"], "offload_activations"),
    ([*LAYER_MAJOR, "offload_weights=true"], "offload_weights"),
])
def test_runs_it_is_not_built_for_are_refused_naming_the_setting(toy_config, overrides, match):
    with pytest.raises(ConfigError, match=match):
        Trainer(toy_config("torch_compile=true", *overrides))
