"""The layer-major backward (train.layer_major_backward) against the offloaded optimizer's per-micro-batch
path it replaces: the same parameters and metrics after several steps, bit for bit on an untied model (across
loss types, the streamed reference, packing, activation offload, bf16 with the 8-bit optimizer); with a tied
embedding, whose head and lookup gradients are summed in another order, within fp32 rounding. Each layer's
gradient reaches the host once per step; and the setting's rules."""

import json

import pytest
import torch

from lowmem_grpo.config import ConfigError
from lowmem_grpo.optim.offload import OffloadedOptimizer
from lowmem_grpo.training.layer_inputs import LayerInputStore
from lowmem_grpo.training.step_modes import LayerMajorStep, OffloadStep, layer_major_wanted, layers_per_checkpoint
from lowmem_grpo.training.trainer import Trainer
from lowmem_grpo.transfers import TRANSFERS

from tests.policy.test_architectures import CONFIGS

from .conftest import TINY_LLAMA

STEP = ["offload_optimizer=true", "per_device_train_batch_size=2", "gradient_accumulation_steps=4", "max_steps=3"]
UNTIED = json.dumps({**TINY_LLAMA, "tie_word_embeddings": False})


def _run(toy_config, tmp_path, layer_major: bool, *overrides, steps: int = 3):
    cfg = toy_config(*STEP, f"layer_major_backward={str(layer_major).lower()}", *overrides,
                     output_dir=tmp_path / f"run-{layer_major}")
    trainer = Trainer(cfg)
    assert isinstance(trainer.step_mode, LayerMajorStep if layer_major else OffloadStep)
    metrics = [trainer.run_step()[1] for _ in range(steps)]
    trainer.step_mode.synchronize()
    return {k: v.detach().clone() for k, v in trainer.policy.state_dict().items()}, metrics


def _learning(metrics: list[dict]) -> list[dict]:
    """The step metrics but the transfer counts (which differ: that is the point)."""
    return [{k: v for k, v in m.items() if not k.startswith("transfer/") and k != "device_syncs"} for m in metrics]


def _same(plain, layer_major) -> None:
    (p_params, p_metrics), (l_params, l_metrics) = plain, layer_major
    for name, value in p_params.items():
        assert torch.equal(l_params[name], value), name
    assert _learning(l_metrics) == _learning(p_metrics)
    for p, lm in zip(p_metrics, l_metrics):  # the layers' gradients once per step, not once per micro-batch
        assert lm.get("transfer/d2h/gradients", 0) <= p.get("transfer/d2h/gradients", 0)


@pytest.mark.parametrize("overrides", [
    [],
    ["beta=0.04", "reference_compute=stream", "loss_type=cispo", "max_grad_norm=0.1"],
    ["pack_prompts=true", "loss_type=sapo"],
    ["loss_type=grpo", "importance_sampling_level=sequence", "steps_per_generation=8"],
    ["offload_activations=true", "loss_type=bnpo"],
    ["precision=bf16_sr", "optimizer=adamw_8bit"],
], ids=["dapo", "reference-cispo-clip", "packed-sapo", "sequence-two-steps", "offload-bnpo", "bf16-8bit"])
def test_an_untied_model_steps_bit_for_bit_as_the_per_micro_batch_path(toy_config, tmp_path, overrides):
    """Head gradients leave once per micro-batch as before, the layers' and the embedding lookup's once per
    step, summed on the device with the roundings the host made, in the same order."""
    if "optimizer=adamw_8bit" in overrides:
        pytest.importorskip("bitsandbytes")
    _same(*(_run(toy_config, tmp_path, lm, f"model.config={UNTIED}", *overrides) for lm in (False, True)))


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_qwen3_and_gemma3_step_bit_for_bit(toy_config, tmp_path, family):
    """Qwen3's q/k norms; Gemma 3's per-layer masks and rotary tables (a sliding window shorter than the rows),
    its embedding scale (untied here, so every sum is in the same order)."""
    config = {**CONFIGS[family], **{k: TINY_LLAMA[k] for k in ("vocab_size", "eos_token_id", "pad_token_id")},
              "tie_word_embeddings": False, "sliding_window": 6} if family == "gemma3" else {
        **CONFIGS[family], **{k: TINY_LLAMA[k] for k in ("vocab_size", "eos_token_id", "pad_token_id")}}
    _same(*(_run(toy_config, tmp_path, lm, f"model.config={json.dumps(config)}", "beta=0.04", steps=2)
            for lm in (False, True)))


def test_a_tied_embedding_stays_within_fp32_rounding(toy_config, tmp_path):
    """Its head gradients arrive before its lookup gradients (today: summed per micro-batch): another order of
    the same fp32 sum, whose last-bit differences then reach every weight through the next steps."""
    (p_params, p_metrics), (l_params, l_metrics) = (_run(toy_config, tmp_path, lm, "beta=0.04") for lm in (False, True))
    for name, value in p_params.items():
        torch.testing.assert_close(l_params[name], value, rtol=1e-5, atol=1e-7, msg=name)
    for p, lm in zip(p_metrics, l_metrics):
        assert lm["loss"] == pytest.approx(p["loss"], rel=1e-5, abs=1e-8)
        assert lm["grad_norm"] == pytest.approx(p["grad_norm"], rel=1e-5)


@pytest.mark.parametrize("overrides", [["beta=0.04", "loss_type=dr_grpo"], ["precision=bf16_sr", "optimizer=adamw_8bit"]],
                         ids=["reference-dr-grpo", "bf16-8bit"])
def test_the_head_gradient_summed_on_the_device_steps_bit_for_bit(toy_config, tmp_path, overrides):
    """train.head_gradient_once_per_step: autograd's sum in .grad, one rounding per add as the host's."""
    if "optimizer=adamw_8bit" in overrides:
        pytest.importorskip("bitsandbytes")
    plain = _run(toy_config, tmp_path / "plain", False, f"model.config={UNTIED}", *overrides)
    held = _run(toy_config, tmp_path / "held", True, f"model.config={UNTIED}", "head_gradient_once_per_step=true",
                *overrides)
    _same(plain, held)


def test_a_tied_head_summed_on_the_device_stays_within_fp32_rounding(toy_config, tmp_path):
    """The head's sum meets the lookup's rows on the host once, not once per micro-batch: another order."""
    (p_params, p_metrics), (l_params, l_metrics) = (
        _run(toy_config, tmp_path / name, lm, "beta=0.04", *extra)
        for name, lm, extra in (("plain", False, []), ("held", True, ["head_gradient_once_per_step=true"])))
    for name, value in p_params.items():
        torch.testing.assert_close(l_params[name], value, rtol=1e-5, atol=1e-7, msg=name)
    for p, lm in zip(p_metrics, l_metrics):
        assert lm["grad_norm"] == pytest.approx(p["grad_norm"], rel=1e-5)
        assert lm["transfer/d2h/gradients"] < p["transfer/d2h/gradients"]


def test_each_layer_gradient_reaches_the_host_once_per_step_and_the_lookup_as_its_rows(toy_config, tmp_path,
                                                                                        monkeypatch):
    arrivals: dict[int, int] = {}  # whole gradients, by parameter index
    rows_sent: list[tuple[int, int]] = []  # (distinct ids, tokens) of each lookup sent as its rows
    receive, receive_rows = OffloadedOptimizer._receive, OffloadedOptimizer.receive_rows

    def counting(self, index, grad):
        arrivals[index] = arrivals.get(index, 0) + 1
        return receive(self, index, grad)

    def counting_rows(self, p, ids, rows):
        assert rows.shape == (ids.numel(), p.shape[1]) and torch.equal(ids, ids.unique())
        rows_sent.append(ids.numel())
        return receive_rows(self, p, ids, rows)
    monkeypatch.setattr(OffloadedOptimizer, "_receive", counting)
    monkeypatch.setattr(OffloadedOptimizer, "receive_rows", counting_rows)
    for layer_major, hold_head in ((False, False), (True, False), (True, True)):
        arrivals.clear()
        rows_sent.clear()
        trainer = Trainer(toy_config(*STEP, f"layer_major_backward={str(layer_major).lower()}", "max_steps=1",
                                     f"head_gradient_once_per_step={str(hold_head).lower()}", "beta=0.04",
                                     f"model.config={UNTIED}", output_dir=tmp_path / f"once-{layer_major}-{hold_head}"))
        metrics = trainer.run_step()[1]
        name_of = {id(p): n for n, p in trainer.policy.named_parameters()}
        per_name = {name_of[id(p)]: arrivals.get(i, 0) for i, p in enumerate(trainer.optimizer.params)}
        layers = {n: c for n, c in per_name.items() if ".layers." in n}
        assert set(layers.values()) == {1 if layer_major else 4}, per_name
        assert per_name.pop("model.embed_tokens.weight") == (0 if layer_major else 4)
        heads = {c for n, c in per_name.items() if n not in layers}  # the head and the final norm
        assert heads == ({1} if hold_head else {4}), per_name
        assert len(rows_sent) == (4 if layer_major else 0)  # one lookup per micro-batch, each its rows
        table = trainer.policy.get_input_embeddings().weight
        assert all(0 < n < table.shape[0] for n in rows_sent)
        row_bytes = 8 + table.shape[1] * table.element_size()  # an int64 id and its row
        assert metrics.get("transfer/d2h/lookup gradients", 0) == sum(n * row_bytes for n in rows_sent)


def test_each_layer_runs_over_every_micro_batch_at_once_forward_and_backward(toy_config, tmp_path):
    """The forward goes layer-major too (LayerMajorStep.begin): layer i over all 4 micro-batches, then
    layer i + 1; the backward recomputes last to first the same way. Each layer's weights are read in two
    runs per step, which a streamed layer needs (two copies per step, not one per micro-batch)."""
    trainer = Trainer(toy_config(*STEP, "layer_major_backward=true", "max_steps=1", "skip_zero_advantage=false",
                                 output_dir=tmp_path / "order"))
    layers = trainer.step_mode.layers
    calls: list[int] = []
    for i in range(len(layers)):
        layers.layers[i].register_forward_pre_hook(lambda module, args, i=i: calls.append(i))
    trainer.generation = trainer.new_generation_batch()  # (the rollout and log-prob passes: not the step's)
    calls.clear()
    trainer.optimizer_step()
    n, k = len(layers), 4
    assert calls == [i for i in range(n) for _ in range(k)] + [i for i in reversed(range(n)) for _ in range(k)]
    trainer.step_mode.begin([])
    with pytest.raises(RuntimeError, match="takes the losses given to begin"):
        trainer.step_mode.forward(lambda: (torch.zeros(()), {}))


FIVE_LAYERS = json.dumps({**TINY_LLAMA, "tie_word_embeddings": False, "num_hidden_layers": 5})


def test_layers_recomputed_in_groups_step_bit_for_bit_as_one_at_a_time(toy_config, tmp_path):
    """model.layers_per_checkpoint: a group's inner inputs are recomputed, not kept; the same operations in the
    same order, so the same bits (groups of 2 and 3 over 5 layers: the last group shorter)."""
    runs = [_run(toy_config, tmp_path / f"group-{g}", True, f"model.config={FIVE_LAYERS}", "beta=0.04",
                 "offload_activations=true", f"layers_per_checkpoint={g}") for g in (1, 2, 3)]
    for other in runs[1:]:
        _same(runs[0], other)


def test_a_group_keeps_its_first_input_only_and_runs_its_layers_together(toy_config, tmp_path):
    trainer = Trainer(toy_config(*STEP, "layer_major_backward=true", "layers_per_checkpoint=2", "max_steps=1",
                                 "skip_zero_advantage=false", f"model.config={FIVE_LAYERS}",
                                 output_dir=tmp_path / "groups"))
    mode = trainer.step_mode
    kept: list[tuple[int, int]] = []
    put = mode.store.put
    mode.store.put = lambda key, hidden: (kept.append(key), put(key, hidden))[1]
    calls: list[int] = []
    for i in range(5):
        mode.layers.layers[i].register_forward_pre_hook(lambda module, args, i=i: calls.append(i))
    trainer.generation = trainer.new_generation_batch()
    calls.clear()
    trainer.optimizer_step()
    k = 4
    assert kept == [(i, m) for i in (0, 2, 4) for m in range(k)]
    backward = [i for first in (4, 2, 0) for _ in range(k) for i in range(first, min(first + 2, 5))]
    assert calls == [i for i in range(5) for _ in range(k)] + backward


def test_the_setting_is_refused_where_it_cannot_run(toy_config):
    with pytest.raises(ConfigError, match="layer_major_backward=true needs optim.offload_optimizer=true"):
        toy_config("layer_major_backward=true")
    with pytest.raises(ConfigError, match="model.gradient_checkpointing=true"):
        toy_config("layer_major_backward=true", "offload_optimizer=true", "gradient_checkpointing=false")
    cfg = toy_config(*STEP, "layer_major_backward=true")
    with pytest.raises(ValueError, match="runs in one process"):
        layer_major_wanted(cfg, world_size=2)
    with pytest.raises(ConfigError, match="layers_per_checkpoint=2 groups the layers"):
        toy_config(*STEP, "layer_major_backward=false", "layers_per_checkpoint=2")
    with pytest.raises(ConfigError, match="head_gradient_once_per_step sums the head's gradient"):
        toy_config(*STEP, "layer_major_backward=false", "head_gradient_once_per_step=true")
    with pytest.raises(ValueError, match="head_gradient_once_per_step needs the layer-major backward"):
        Trainer(toy_config(*STEP, "head_gradient_once_per_step=true"))
    with pytest.raises(ConfigError, match="layers_per_checkpoint=2 groups the layers"):
        toy_config(*STEP, "gradient_checkpointing=false", "layers_per_checkpoint=2")
    unset = toy_config(*STEP, "layers_per_checkpoint=2")  # unset, and off here: no offload_activations
    with pytest.raises(ValueError, match="layers_per_checkpoint=2 needs the layer-major backward"):
        layers_per_checkpoint(unset, world_size=1)
    with pytest.raises(ValueError, match="layers_per_checkpoint=2 needs the layer-major backward"):
        Trainer(unset)


def test_unset_it_is_on_where_the_layer_inputs_wait_in_host_ram(toy_config):
    assert layer_major_wanted(toy_config(*STEP, "offload_activations=true"), 1)
    assert not layer_major_wanted(toy_config(*STEP), 1)  # on the device they would cost 4 micro-batches' inputs
    assert not layer_major_wanted(toy_config(*STEP, "offload_activations=true"), 2)  # torchrun
    assert not layer_major_wanted(toy_config(*STEP, "offload_activations=true", "gradient_accumulation_steps=1",
                                             "per_device_train_batch_size=4"), 1)
    assert not layer_major_wanted(toy_config("offload_activations=true", "gradient_accumulation_steps=2"), 1)


def test_the_store_copies_to_the_host_and_back_and_counts_what_a_gpu_moves():
    TRANSFERS.take()
    big = torch.randn(4, 256, 512)  # 2 MiB: over activation offload's minimum
    small = torch.randn(2, 3)
    store = LayerInputStore(offload=True, copy_on_cpu=True)
    store.put((0, 0), big)
    store.put((0, 1), small)  # too small to move, as activation offload
    store.prefetch((0, 0))
    back = store.take((0, 0))
    assert torch.equal(back, big) and back.data_ptr() != big.data_ptr()
    assert store.take((0, 1)).data_ptr() == small.data_ptr()
    moved = TRANSFERS.take()
    assert moved["transfer/d2h/activations"] == moved["transfer/h2d/activations"] == big.numel() * 4
    counted_only = LayerInputStore(offload=True)  # a CPU run: nothing copied, the same bytes counted
    counted_only.put((0, 0), big)
    assert counted_only.take((0, 0)).data_ptr() == big.data_ptr()
    assert TRANSFERS.take()["transfer/h2d/activations"] == big.numel() * 4
