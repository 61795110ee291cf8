"""Our trainer's loss (training/loss.py PolicyLoss, the fused head) against TRL 1.16's GRPOTrainer._compute_loss on
the same tiny fp32 model and the same batch, two steps: the first on-policy, then one identical SGD update,
then the second with the first step's log-probs as the old ones, so the ratios leave 1 and the clip regions
are reached. Every loss type, delta, top_entropy_quantile, beta > 0 with and without the bias-corrected KL:
losses and gradients within 1e-5 relative. Needs TRL (the `bench` extra; make test-compare)."""

import importlib.util
import json

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="needs trl (pip install '.[bench]')")

B, P, C = 6, 5, 7  # completions, prompt and completion lengths
MAX_COMPLETION_LENGTH = 9  # dr_grpo's denominator, longer than the batch's completions


@pytest.fixture(scope="module")
def trl_trainer(tmp_path_factory):
    """One TRL GRPOTrainer on a tiny random Qwen2 (fp32); each case sets the loss settings it reads."""
    from datasets import Dataset
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from lowmem_grpo.policy.char_tokenizer import char_tokenizer

    tokenizer = char_tokenizer()
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                                         eos_token_id=tokenizer.eos_token_id))
    args = GRPOConfig(output_dir=str(tmp_path_factory.mktemp("trl")), per_device_train_batch_size=B,
                      num_generations=B, max_completion_length=MAX_COMPLETION_LENGTH, report_to="none",
                      use_cpu=True, bf16=False, seed=0)
    trainer = GRPOTrainer(model=model, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)], args=args,
                          train_dataset=Dataset.from_dict({"prompt": ["1+1="] * B}), processing_class=tokenizer)
    trainer.current_gradient_accumulation_steps = 1
    return trainer


CASES = {  # name: our train.* settings (TRL's names and meanings)
    **{t: dict(loss_type=t) for t in ("grpo", "bnpo", "dapo", "dr_grpo", "cispo", "sapo", "vespo")},
    "luspo": dict(loss_type="luspo", importance_sampling_level="sequence"),
    "dapo_sequence": dict(loss_type="dapo", importance_sampling_level="sequence"),
    "dapo_delta": dict(loss_type="dapo", delta=1.05, epsilon_high=0.01),
    "grpo_top_entropy": dict(loss_type="grpo", top_entropy_quantile=0.3),
    "dapo_beta": dict(loss_type="dapo", beta=0.1, use_bias_correction_kl=False),
    "dapo_beta_bias_kl": dict(loss_type="dapo", beta=0.1, use_bias_correction_kl=True),
    "cispo_beta_bias_kl": dict(loss_type="cispo", beta=0.1, epsilon_high=1.02),
    "sapo_temperatures": dict(loss_type="sapo", sapo_temperature_pos=0.5, sapo_temperature_neg=2.0),
}


def _set_trl(trainer, settings: dict) -> None:
    s = {**dict(epsilon=0.2, epsilon_high=0.2, beta=0.0, importance_sampling_level="token", delta=None,
                top_entropy_quantile=1.0, use_bias_correction_kl=True, sapo_temperature_pos=1.0,
                sapo_temperature_neg=1.05, vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0,
                vespo_lambda_neg=2.0), **settings}
    trainer.loss_type, trainer.beta = s["loss_type"], s["beta"]
    trainer.epsilon_low, trainer.epsilon_high = s["epsilon"], s["epsilon_high"]
    trainer.importance_sampling_level, trainer.top_entropy_quantile = s["importance_sampling_level"], \
        s["top_entropy_quantile"]
    for name in ("delta", "use_bias_correction_kl", "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos",
                 "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
        setattr(trainer.args, name, s[name])


def _our_loss(model, settings: dict):
    from lowmem_grpo.config import load_config
    from lowmem_grpo.policy.packing import Packing
    from lowmem_grpo.training.loss import PolicyLoss

    items = [f"train.{k}={json.dumps(v) if v is not None else 'null'}" for k, v in settings.items()]
    base = ['model.config={"model_type": "qwen2"}', "reward_funcs=[tests.training.conftest:label_reward]",
            f"max_completion_length={MAX_COMPLETION_LENGTH}"]
    cfg = load_config(None, base + items)
    return PolicyLoss(model, cfg, autocast=False, pack=Packing.OFF)


def _batch(vocab: int, seed: int = 0):
    from lowmem_grpo.policy.batch import Batch

    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(3, vocab, (B, P), generator=g)
    prompt_mask = torch.ones(B, P, dtype=torch.bool)
    prompt_mask[:2, :2] = False  # left padding
    completion_ids = torch.randint(3, vocab, (B, C), generator=g)
    lengths = torch.tensor([C, C - 2, 3, C, 1, C - 1])
    completion_mask = torch.arange(C)[None] < lengths[:, None]
    advantages = torch.tensor([1.2, -0.7, 0.4, -1.5, 0.9, -0.3])
    return Batch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                 completion_mask=completion_mask, is_truncated=torch.zeros(B, dtype=torch.bool), advantages=advantages)


def _trl_inputs(batch, old, ref):
    inputs = {"prompt_ids": batch.prompt_ids, "prompt_mask": batch.prompt_mask.long(),
              "completion_ids": batch.completion_ids, "completion_mask": batch.completion_mask.long(),
              "advantages": batch.advantages, "num_items_in_batch": batch.completion_mask.sum()}
    if old is not None:
        inputs["old_per_token_logps"] = old
    if ref is not None:
        inputs["ref_per_token_logps"] = ref
    return inputs


def _logps(model, batch):
    """Per-token log-probs of the completions under `model` (no gradient), (B, C), 0 on padding."""
    from lowmem_grpo.kernels import linear_token_logprobs
    from lowmem_grpo.policy.logprobs import completion_hidden
    from lowmem_grpo.policy.model import Head

    with torch.no_grad():
        head = Head(decoder=model.model, output=model.get_output_embeddings())
        hidden = completion_hidden(head, batch)
        return linear_token_logprobs(hidden, head.weight, batch.completion_ids) * batch.completion_mask


@pytest.mark.parametrize("name", list(CASES))
def test_two_steps_give_trls_losses_and_gradients(trl_trainer, name):
    settings = CASES[name]
    model = trl_trainer.model
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    try:
        _set_trl(trl_trainer, settings)
        ours = _our_loss(model, settings)
        batch = _batch(model.config.vocab_size)
        ref = _logps(model, batch) + 0.3 * torch.randn(B, C, generator=torch.Generator().manual_seed(1)) \
            if settings.get("beta") else None
        batch.ref_logp = ref
        old = None
        model.train()
        for step in range(2):
            params = [p for p in model.parameters() if p.requires_grad]
            trl_loss = trl_trainer._compute_loss(model, _trl_inputs(batch, old, ref))
            trl_grads = torch.autograd.grad(trl_loss, params)
            batch.old_logp = old
            our_loss, metrics = ours(batch, num_items=int(batch.completion_mask.sum()))
            our_grads = torch.autograd.grad(our_loss, params)
            torch.testing.assert_close(our_loss, trl_loss, rtol=1e-5, atol=1e-7, msg=f"step {step + 1} loss")
            for p_name, a, b in zip([n for n, p in model.named_parameters() if p.requires_grad], our_grads, trl_grads):
                err = (a - b).abs().max() / b.abs().max().clamp(min=1e-12)
                assert err <= 1e-5, f"step {step + 1}, {p_name}: gradient differs by {err:.2e} of its largest entry"
            if step == 1 and settings["loss_type"] in ("grpo", "dapo", "bnpo", "dr_grpo", "cispo", "luspo"):
                assert metrics["clip_ratio"] > 0, "the second step should reach a clip region"
            if step == 0:
                old = _logps(model, batch)
                with torch.no_grad():  # one identical SGD update, big enough to move the ratios off 1
                    for p, g in zip(params, trl_grads):
                        p -= 3.0 * g / max(float(torch.cat([x.flatten() for x in trl_grads]).norm()), 1e-12)
    finally:
        model.load_state_dict(initial)


def test_our_trainer_logs_trls_names_for_each_loss_type():
    from lowmem_grpo.training.metrics import trl_names

    base = {"clip_ratio": 0.1, "clip_ratio_low": 0.04, "clip_ratio_high": 0.06, "kl": 0.0}
    assert set(trl_names(dict(base), "dapo")) == {"kl", "clip_ratio/region_mean", "clip_ratio/low_mean",
                                                  "clip_ratio/high_mean"}
    assert trl_names(dict(base), "cispo") == {"kl": 0.0, "cispo_clip_ratio": 0.06}
    assert trl_names(dict(base, vespo_phi_mean=0.8), "vespo") == {"kl": 0.0, "vespo/phi_seq_mean": 0.8}
    assert trl_names(dict(base), "sapo") == {"kl": 0.0}
