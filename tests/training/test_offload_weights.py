"""model.offload_weights: the decoder layers' weights live in the offloaded optimizer's host copy and cross to
the device a layer (a group of layers) at a time. On the CPU the streamer makes real copies here
(`copy_on_cpu`), so a layer computes on its copy as it would on a GPU. The step equals the layer-major step
with the weights resident, bit for bit; each layer crosses twice per step and once per old log-prob pass;
the compact copy and evaluation never need the whole policy on the device; and the setting's rules."""

import functools
import json

import pytest
import torch
from torch import nn

from lowmem_grpo.config import ConfigError
from lowmem_grpo.policy.compact import CompactPolicy
from lowmem_grpo.policy.static_decode import static_decode_problem
from lowmem_grpo.policy.streaming import HostLookup, LayerStreamer, stream_trained_layers
from lowmem_grpo.training import trainer as trainer_module
from lowmem_grpo.training.step_modes import LayerMajorStep, offload_weights
from lowmem_grpo.training.trainer import Trainer

from .conftest import TINY_LLAMA, train_until_stopped

STEP = ["offload_optimizer=true", "per_device_train_batch_size=2", "gradient_accumulation_steps=4", "max_steps=3",
        "rollout_quantization=int8", "layer_major_backward=true"]
THREE_LAYERS = json.dumps({**TINY_LLAMA, "num_hidden_layers": 3, "tie_word_embeddings": False})


@pytest.fixture
def real_copies(monkeypatch):
    """The trainer's streamer copies each layer on the CPU too (what a GPU run does across PCIe)."""
    monkeypatch.setattr(trainer_module, "stream_trained_layers",
                        functools.partial(stream_trained_layers, copy_on_cpu=True))


def _run(toy_config, tmp_path, streamed: bool, *overrides, steps: int = 3):
    cfg = toy_config(*STEP, f"offload_weights={str(streamed).lower()}", *overrides,
                     output_dir=tmp_path / f"run-{streamed}")
    trainer = Trainer(cfg)
    assert isinstance(trainer.step_mode, LayerMajorStep)
    assert (trainer.step_mode.streamer is not None) == streamed
    metrics = [trainer.run_step()[1] for _ in range(steps)]
    trainer.step_mode.synchronize()
    params = {k: v.detach().clone() for k, v in trainer.policy.state_dict().items()}
    return trainer, params, metrics


def _learning(metrics: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.startswith("transfer/") and k != "device_syncs"} for m in metrics]


@pytest.mark.parametrize("overrides", [
    [],
    [f"model.config={THREE_LAYERS}", "layers_per_checkpoint=2", "beta=0.04", "reference_compute=stream"],
    ["offload_activations=true", "head_gradient_once_per_step=true", "loss_type=grpo", "steps_per_generation=8",
     "pack_prompts=true"],
    ["precision=bf16_sr", "optimizer=adamw_8bit", "logprob_micro_batch_size=2", "reference_stream_rows=4"],
], ids=["tied-fp32", "groups-reference", "offload-held-head-two-steps-packed", "bf16-8bit"])
def test_streamed_layers_step_bit_for_bit_as_resident_ones(toy_config, tmp_path, real_copies, overrides):
    if "optimizer=adamw_8bit" in overrides:
        pytest.importorskip("bitsandbytes")
    _, resident, r_metrics = _run(toy_config, tmp_path, False, *overrides)
    trainer, streamed, s_metrics = _run(toy_config, tmp_path, True, *overrides)
    for name, value in resident.items():
        assert torch.equal(streamed[name], value), name
    assert _learning(s_metrics) == _learning(r_metrics)
    optimizer = trainer.optimizer
    for layer in trainer.head.decoder.layers:  # at rest each layer's weight is its host copy, nothing installed
        for p in layer.parameters():
            assert p.data_ptr() == optimizer.host[p].data_ptr()
    assert not trainer.rollout.streamer.ready and not trainer.rollout.streamer._installed


def test_each_layer_crosses_twice_per_step_and_once_per_old_log_prob_pass(toy_config, tmp_path, real_copies):
    # rewards that differ within every group: a batch whose advantages are all zero trains nothing, and its
    # layers would not cross at all
    trainer, _, metrics = _run(toy_config, tmp_path, True, "steps_per_generation=8", "logprob_micro_batch_size=2",
                               "reward_funcs=[tests.training.conftest:spread_reward]")
    layers = trainer.head.decoder.layers
    layer_bytes = sum(p.numel() * p.element_size() for p in layers.parameters())
    passes = [m["transfer/h2d/policy layers"] / layer_bytes for m in metrics]
    # step 1: the generation batch's old log-prob pass (8 micro-batches, layer-major) + forward + backward
    assert passes == [3, 2, 3]  # steps_per_generation=8 with 4 micro-batches per step: a batch every 2 steps
    assert all(m.get("transfer/h2d/weights", 0) < layer_bytes for m in metrics)  # no layer uploaded after its update


def test_the_streamer_computes_on_copies_and_fetches_a_group_ahead():
    torch.manual_seed(0)
    layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(4)])
    host = [layer.weight.data for layer in layers]
    waited, seen = [], []
    streamer = LayerStreamer(layers, torch.device("cpu"), kind="policy layers", wait=waited.append, copy_on_cpu=True)
    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda m, a, i=i: seen.append(m.weight.data_ptr() != host[i].data_ptr()))
    x = torch.randn(2, 4)
    with streamer.resident([2, 3], following=[0, 1]):
        for _ in range(2):  # two micro-batches: each layer of the group copied once
            layers[3](layers[2](x))
        assert waited == [2, 3, 0, 1]  # the group, then the group that follows, each after its update
        assert sorted(streamer.ready) == [0, 1]
    assert all(seen) and streamer.copies == 4 and not streamer._installed
    assert all(layer.weight.data_ptr() == h.data_ptr() for layer, h in zip(layers, host))  # released
    plain = layers[0](x)  # outside `resident`: copied for the call (already fetched), the next one fetched
    assert torch.equal(plain, x @ host[0].T + layers[0].bias)


def test_the_compact_copy_keeps_its_own_copies_of_what_is_elsewhere():
    """The policy's layers in host RAM, the copy on another device (here `meta`, which needs no GPU): every
    tensor the copy computes with is on its device; the int8 weights and the copied norms count as its own."""
    from transformers import AutoConfig, AutoModelForCausalLM
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY_LLAMA))
    compact = CompactPolicy(model, "int8", device=torch.device("meta"))
    kept = list(compact.model.parameters()) + list(compact.model.buffers())
    assert kept and all(t.device.type == "meta" for t in kept)
    norms = (sum(p.numel() * 4 for n, p in model.named_parameters() if "norm" in n or "embed" in n)
             + sum(b.numel() * b.element_size() for b in model.buffers()))  # and the rotary table
    linears = sum(m.weight.numel() + m.weight.shape[0] * 4 for n, m in model.named_modules()
                  if isinstance(m, nn.Linear) and m is not model.get_output_embeddings())
    assert compact.nbytes() == linears + norms  # (tied: the head is the embedding, copied once)
    on_device = CompactPolicy(model, "int8")
    assert on_device.nbytes() == linears  # everything else shared with the policy


@pytest.mark.parametrize("overrides, message", [
    (["offload_weights=true", "rollout_quantization=int8"], "set optim.offload_optimizer=true"),
    (["offload_weights=true", "offload_optimizer=true"], "generation.rollout_quantization=int8"),
    (["offload_weights=true", "offload_optimizer=true", "rollout_quantization=int8", "layer_major_backward=false"],
     "takes the layer-major backward"),
    (["offload_weights=true", "offload_optimizer=true", "rollout_quantization=int8", "precision=bf16_sr",
      "optimizer=adamw"], "set optim.optimizer=adamw_8bit"),
])
def test_the_settings_it_needs_are_named(toy_config, overrides, message):
    with pytest.raises(ConfigError, match=message):
        toy_config(*overrides)


def test_under_torchrun_it_is_refused_by_the_step_mode(toy_config):
    cfg = toy_config("offload_weights=true", "offload_optimizer=true", "rollout_quantization=int8")
    assert offload_weights(cfg, 1)
    with pytest.raises(ValueError, match="model.offload_weights needs the layer-major backward"):
        offload_weights(cfg, 2)


def test_evaluation_decodes_with_the_compact_copy(toy_config, tmp_path, real_copies, monkeypatch):
    trainer = Trainer(toy_config(*STEP, "offload_weights=true", "max_steps=1", output_dir=tmp_path / "eval"))
    used = []
    monkeypatch.setattr(trainer_module, "evaluate", lambda ctx, *a, **k: used.append(ctx.policy) or {})
    trainer.run_step()
    trainer.evaluate()
    assert used == [trainer.rollout.compact.model] and trainer.compact_step == trainer.step
    assert trainer.rollout.compact.released  # and freed again for training


def test_the_planner_keeps_the_layers_off_the_device_but_two(toy_config, tmp_path):
    from lowmem_grpo.memory.plan import Arch, compact_copy_bytes, plan
    cfg = toy_config(*STEP, f"model.config={THREE_LAYERS}", "layers_per_checkpoint=2", "offload_weights=true",
                     output_dir=tmp_path / "plan")
    trainer = Trainer(cfg)
    arch = Arch.from_config(trainer.policy.config)
    layer = 4 * arch.layer_params()
    assert compact_copy_bytes(arch, 4, True) == trainer.rollout.compact.nbytes()  # with its own norms
    streamed = plan(cfg, arch, autocast=False, device="cpu").phase_categories
    resident = plan(toy_config(*STEP, f"model.config={THREE_LAYERS}", "layers_per_checkpoint=2"), arch,
                    autocast=False, device="cpu").phase_categories
    table = 4 * arch.vocab * arch.hidden  # untied: the input embedding's table stays in host RAM too
    for phase, cats in streamed.items():
        assert cats["weights"] == resident[phase]["weights"] - arch.layers * layer - table, phase
    assert streamed["forward"]["streamed layers"] == 2 * layer  # one computing, the next on its way
    assert streamed["backward"]["streamed layers"] == 2 * 2 * layer  # a group of two and the next group
    assert streamed["old log-probs"]["streamed layers"] == 2 * layer
    assert "streamed layers" not in streamed["rollout"]  # the compact copy samples
    with_copy = {phase for phase, cats in streamed.items() if "rollout copy" in cats}
    assert with_copy == {"rollout", "sampler log-probs", "evaluation"}  # freed for the rest


def test_an_untied_table_stays_in_host_ram_and_only_its_rows_cross(toy_config, tmp_path, real_copies):
    """The input embedding's table is the optimizer's host copy, looked up there by the policy and by the
    compact copy (which shares it), once its update is done; the rows read cross, and the weights sent up after
    an update leave it out. A tied table is the head's, and stays on the device."""
    trainer, _, metrics = _run(toy_config, tmp_path, True, f"model.config={THREE_LAYERS}", steps=2)
    embedding = trainer.policy.get_input_embeddings()
    assert isinstance(embedding, HostLookup) and isinstance(embedding, nn.Embedding)
    assert embedding.weight.data_ptr() == trainer.optimizer.host[embedding.weight].data_ptr()
    assert trainer.rollout.compact.model.get_input_embeddings().weight is embedding.weight  # shared, no copy
    assert "looked up in host RAM" in static_decode_problem(trainer.rollout.compact.model)
    layers = sum(p.numel() for p in trainer.head.decoder.layers.parameters())
    resident = sum(p.numel() for p in trainer.policy.parameters()) - layers - embedding.weight.numel()
    for m in metrics:
        assert m["transfer/h2d/weights"] == 4 * resident  # the final norm and the head, after their update
        assert 0 < m["transfer/h2d/embedding rows"]
    waited = []
    real = trainer.optimizer.wait_for_update
    trainer.optimizer.wait_for_update = lambda params: waited.append(params) or real(params)
    trainer.run_step()
    assert [embedding.weight] in waited  # each lookup only after the table's update
    tied, _, _ = _run(toy_config, tmp_path, True, steps=1)
    assert not isinstance(tied.policy.get_input_embeddings(), HostLookup)


def test_the_streamer_never_reads_a_layer_before_its_update(toy_config, tmp_path, real_copies, monkeypatch):
    """The update thread writes the very host tensor a layer is copied from: with every update slowed down,
    a copy of the last layer asked for right after the step is made from its updated weights. (The trainer
    waits for every update before each step and generation batch today; the streamer does not rely on it.)"""
    import time
    from lowmem_grpo.optim.offload import OffloadedOptimizer
    update = OffloadedOptimizer._update
    monkeypatch.setattr(OffloadedOptimizer, "_update", lambda self, *a, **k: (time.sleep(0.02), update(self, *a, **k)))
    trainer = Trainer(toy_config(*STEP, "offload_weights=true", output_dir=tmp_path / "slow"))
    trainer.run_step()
    assert trainer.optimizer._ready  # its updates are still on the update thread
    streamer, last = trainer.rollout.streamer, len(trainer.head.decoder.layers) - 1
    streamer._fetch(last)
    copies, _ = streamer.ready.pop(last)
    trainer.step_mode.synchronize()
    for (_, host), copy in zip(streamer.host[last], copies):
        assert torch.equal(copy, host)


def test_the_nf4_copy_is_planned_to_the_byte_and_samples(toy_config, tmp_path):
    pytest.importorskip("bitsandbytes")
    from lowmem_grpo.memory.plan import Arch, compact_copy_bytes
    from lowmem_grpo.policy.compact import NF4Linear
    trainer = Trainer(toy_config(*STEP, f"model.config={THREE_LAYERS}", "offload_weights=true",
                                 "rollout_quantization=nf4", "max_steps=2", output_dir=tmp_path / "nf4"))
    compact = trainer.rollout.compact
    assert isinstance(compact.model.model.layers[0].mlp.down_proj, NF4Linear)
    arch = Arch.from_config(trainer.policy.config)
    assert compact.nbytes() == compact_copy_bytes(arch, 4, True, "nf4")
    assert compact.nbytes() < 0.6 * compact_copy_bytes(arch, 4, True, "int8")
    packed = compact.model.model.layers[0].mlp.down_proj.packed.clone()
    generation, _, _ = trainer.run_step()
    assert 0 < generation.info["sampling/importance_sampling_ratio/mean"] < 2
    assert compact.released and compact.nbytes() == 0  # freed after its rollout: training needs the room
    trainer.run_step()  # a new generation batch: quantized again from the updated host copy first
    assert compact.released
    trainer._refresh_compact()
    assert compact.nbytes() == compact_copy_bytes(arch, 4, True, "nf4")
    assert not torch.equal(packed, compact.model.model.layers[0].mlp.down_proj.packed)


def test_the_planner_suggests_the_mode_where_nothing_cheaper_fits(monkeypatch):
    """The 3B recipe on a 5 GiB budget: only streaming its layers (with a compact rollout copy) fits."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from pathlib import Path
    from lowmem_grpo.config import load_config
    from lowmem_grpo.memory.plan import Arch
    from lowmem_grpo.memory.presets import preset
    from lowmem_grpo.memory.suggest import suggestions
    cfg = load_config(str(Path(__file__).parents[2] / "recipes" / "qwen2.5-3b_gsm8k_8gb.yaml"), [])
    found = {s.change.split(" (")[0]: s for s in suggestions(cfg, Arch.from_config(preset("Qwen2.5-3B")), 5 * 2**30)}
    mode = found["offload_weights=true rollout_quantization=int8"]
    assert mode.fits and not any(s.fits for change, s in found.items() if "offload_weights" not in change)


def test_out_of_memory_in_training_names_the_mode_last():
    """When nothing cheaper is left in the training phases, the runtime's advice names the mode."""
    from pathlib import Path
    from lowmem_grpo.config import load_config
    from lowmem_grpo.training.stopping import _cheapest_fix
    recipe = str(Path(__file__).parents[2] / "recipes" / "qwen2.5-3b_gsm8k_8gb.yaml")
    assert _cheapest_fix("backward", load_config(recipe, ["train.device=cuda"])).startswith("offload_weights=true")
    streamed = load_config(recipe, ["train.device=cuda", "offload_weights=true", "rollout_quantization=nf4"])
    assert _cheapest_fix("backward", streamed) == "shorter completions or a smaller batch"


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gemma3"])
def test_each_supported_family_streams_bit_for_bit(toy_config, tmp_path, real_copies, family):
    """Qwen2's q/k/v biases (the compact copy's own bias copies), Qwen3's q/k norms, Gemma 3's per-layer masks
    and rotary tables (a sliding window shorter than the rows) and its four norms per layer."""
    from tests.policy.test_architectures import CONFIGS
    shared = {k: TINY_LLAMA[k] for k in ("vocab_size", "eos_token_id", "pad_token_id")}
    config = ({**CONFIGS["qwen3"], "model_type": "qwen2", "head_dim": None, **shared} if family == "qwen2" else
              {**CONFIGS[family], **shared, "tie_word_embeddings": False, "sliding_window": 6} if family == "gemma3"
              else {**CONFIGS[family], **shared})
    overrides = (f"model.config={json.dumps({k: v for k, v in config.items() if v is not None})}", "beta=0.04")
    _, resident, _ = _run(toy_config, tmp_path, False, *overrides, steps=2)
    trainer, streamed, _ = _run(toy_config, tmp_path, True, *overrides, steps=2)
    for name, value in resident.items():
        assert torch.equal(streamed[name], value), name
    assert trainer.rollout.streamer.copies > 0


def test_a_resumed_run_continues_exactly(toy_config, tmp_path, real_copies):
    """The checkpoint is saved from the host copies (save_pretrained reads the layers where they live) and
    the resumed run's layers become the host copies of the loaded weights."""
    pytest.importorskip("bitsandbytes")
    common = [*STEP, "max_steps=4", "offload_weights=true", "precision=bf16_sr", "optimizer=adamw_8bit",
              "save_steps=1"]
    straight = Trainer(toy_config(*common, output_dir=tmp_path / "a"))
    straight.train()
    interrupted = Trainer(toy_config(*common, output_dir=tmp_path / "b"))
    train_until_stopped(interrupted, 2)
    resumed = Trainer(toy_config(*common, "resume_from=latest", output_dir=tmp_path / "b"))
    for layer in resumed.head.decoder.layers:
        for p in layer.parameters():
            assert p.data_ptr() == resumed.optimizer.host[p].data_ptr()
    resumed.train()
    a, b = straight.policy.state_dict(), resumed.policy.state_dict()
    for k in a:
        assert torch.equal(a[k], b[k]), k
