"""PolicyLoss binds the loss's settings once, at construction: its forward reads no config field, and the
settings object it built is the one the fused head gets."""

import dataclasses

import pytest
import torch

from lowmem_grpo.config import Config
from lowmem_grpo.kernels import GRPOLossSettings
from lowmem_grpo.policy.batch import Batch
from lowmem_grpo.policy.packing import Packing
from lowmem_grpo.training import loss as loss_module
from lowmem_grpo.training.loss import PolicyLoss, loss_settings

N, P, C, V = 4, 3, 6, 40
SETTINGS = dict(loss_type="grpo", beta=0.04, epsilon=0.15, epsilon_high=0.3, delta=1.5, top_entropy_quantile=0.8,
                use_bias_correction_kl=True, gradient_accumulation_steps=3)


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                        pad_token_id=0, eos_token_id=1)).float()


def _config() -> Config:
    cfg = Config()
    cfg.generation.max_completion_length, cfg.generation.temperature = C, 0.9
    for k, v in SETTINGS.items():
        setattr(cfg.train, k, v)
    return cfg


def _batch() -> Batch:
    g = torch.Generator().manual_seed(1)
    prompt_mask = torch.ones(N, P, dtype=torch.bool)
    completion_mask = torch.arange(C)[None, :] < torch.tensor([6, 4, 2, 5])[:, None]
    completion_ids = torch.randint(2, V, (N, C), generator=g) * completion_mask
    return Batch(torch.randint(2, V, (N, P), generator=g), prompt_mask, completion_ids, completion_mask,
                 torch.zeros(N, dtype=torch.bool), advantages=torch.tensor([1.2, -0.4, 0.7, -1.0]),
                 old_logp=-torch.rand(N, C, generator=g) * 4, ref_logp=-torch.rand(N, C, generator=g) * 4)


class _Tripwire:
    """Wraps a config; once armed, reading any attribute (of it or of a section read before) raises."""

    def __init__(self, obj, armed: list):
        object.__setattr__(self, "_obj", obj)
        object.__setattr__(self, "_armed", armed)

    def __getattr__(self, name):
        if self._armed:
            raise AssertionError(f"config field {name!r} read after construction")
        value = getattr(self._obj, name)
        return _Tripwire(value, self._armed) if dataclasses.is_dataclass(value) else value


def _run(policy_loss: PolicyLoss):
    mb = _batch()
    loss, metrics = policy_loss(mb, num_items=int(mb.completion_mask.sum()), scale=0.7,
                                tokens=int(mb.completion_mask.sum()))
    loss.backward()
    grads = [p.grad.clone() for p in policy_loss.policy.parameters()]
    return loss.detach(), metrics, grads


def test_forward_reads_no_config_field():
    armed = []
    policy_loss = PolicyLoss(_model(), _Tripwire(_config(), armed), autocast=False, pack=Packing.OFF)
    armed.append(True)
    loss, metrics, _ = _run(policy_loss)  # raises if forward reads the config
    assert torch.isfinite(loss) and "entropy_mask_ratio" in metrics


def test_config_changed_after_construction_changes_nothing():
    reference = _run(PolicyLoss(_model(), _config(), autocast=False, pack=Packing.OFF))
    cfg = _config()
    policy_loss = PolicyLoss(_model(), cfg, autocast=False, pack=Packing.OFF)
    for name, value in dict(loss_type="dapo", beta=0.5, epsilon=0.05, epsilon_high=0.05, delta=None,
                            top_entropy_quantile=1.0, use_bias_correction_kl=False,
                            gradient_accumulation_steps=1).items():
        setattr(cfg.train, name, value)
    cfg.generation.temperature, cfg.model.offload_activations = 2.0, True
    loss, metrics, grads = _run(policy_loss)
    assert torch.equal(loss, reference[0]) and metrics.keys() == reference[1].keys()
    assert all(torch.equal(metrics[k], reference[1][k]) for k in metrics)
    assert all(torch.equal(a, b) for a, b in zip(grads, reference[2]))


def test_the_settings_it_built_are_the_ones_the_fused_head_gets(monkeypatch):
    cfg = _config()
    policy_loss = PolicyLoss(_model(), cfg, autocast=False, pack=Packing.OFF)
    assert policy_loss.settings == loss_settings(cfg) == GRPOLossSettings(
        loss_type="grpo", beta=0.04, epsilon_low=0.15, epsilon_high=0.3, delta=1.5, top_entropy_quantile=0.8,
        use_bias_correction_kl=True, temperature=0.9, max_completion_length=C)
    seen = []
    original = loss_module.linear_grpo_loss
    monkeypatch.setattr(loss_module, "linear_grpo_loss", lambda *a, **kw: seen.append(kw) or original(*a, **kw))
    _run(policy_loss)
    assert len(seen) == 1 and seen[0]["settings"] is policy_loss.settings
    tensors_and_counts = {"bias", "softcap", "mask", "old_logp", "ref_logp", "importance_sampling_ratio",
                          "num_items_in_batch", "mask_count", "settings"}
    assert set(seen[0]) == tensors_and_counts  # no loss hyper-parameter passed per call


def test_a_bad_setting_fails_at_construction():
    cfg = _config()
    cfg.train.delta = -1.0
    with pytest.raises(ValueError, match="delta must be > 0, got -1"):
        PolicyLoss(_model(), cfg, autocast=False, pack=Packing.OFF)
