"""The planner against the profiler's tracked bytes on real trainer steps: the long-completion recipes' modes.

A small version of `benchmarks/plan_accuracy.py --only qwen1.5b-long-modes` that CI can afford: the
4096-token recipe's settings (bf16_sr, the offloaded optimizer with accumulation, checkpointing with
activation offload, the streamed reference, a generation micro-batch smaller than the generation batch,
dapo) on a narrow Qwen2 with many layers and a small vocabulary, so that the layer inputs activation
offload moves are a large share of the peak, and each is over activation offload's 1 MiB minimum. Long
prompts and short completions keep the decode loop short (rows unpacked, so every row keeps its prompt).
"""

import json
import random
from pathlib import Path

import pytest
import torch

from lowmem_grpo.config import load_config
from lowmem_grpo.memory.plan import Arch, plan
from lowmem_grpo.memory.profile import device_equivalent, profile_trainer
from lowmem_grpo.training.trainer import Trainer

RECIPES = Path(__file__).parents[2] / "recipes"
MiB = 2**20
# hidden 512 in bf16: a layer input of 4 rows x 320 positions is 1.25 MiB (over the 1 MiB minimum)
ARCH = dict(model_type="qwen2", vocab_size=2048, hidden_size=512, intermediate_size=512, num_hidden_layers=10,
            num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
            eos_token_id=2047, bos_token_id=2047, pad_token_id=2047)  # EOS: an id the random model rarely samples
PROMPT, COMPLETION = 288, 32


def _long_modes_trainer(tmp_path) -> Trainer:
    rng = random.Random(0)
    train = tmp_path / "prompts.jsonl"  # prompts of exactly PROMPT tokens (the planner's full lengths)
    train.write_text("".join(json.dumps({"prompt_ids": [rng.randrange(2047) for _ in range(PROMPT)], "label": 3}) + "\n"
                             for _ in range(16)))
    cfg = load_config(RECIPES / "qwen2.5-1.5b_gsm8k-4096_8gb.yaml", [
        f"model.config={json.dumps(ARCH)}", "model.name_or_path=''", "model.tokenizer=none",
        f"data.train_file={train}", "data.eval_file=null", "eval_on_start=false", "eval_on_end=false",
        f"max_prompt_length={PROMPT}", f"max_completion_length={COMPLETION}",
        "reward_funcs=[tests.training.conftest:label_reward]", "reward_weights=null",
        # 8 completions per generation batch, generated 4 rows at a time; 2 micro-batches of 4 per update
        "num_generations=4", "per_device_train_batch_size=4", "gradient_accumulation_steps=2",
        "steps_per_generation=2", "generation_micro_batch_size=4", "pack_prompts=false",
        "device=cpu", f"output_dir={tmp_path / 'run'}", "progress_bar=false"])
    assert (cfg.model.offload_activations and cfg.optim.offload_optimizer and cfg.model.precision == "bf16_sr"
            and cfg.train.reference_compute == "stream" and cfg.train.beta > 0)  # the recipe's mix, as shipped
    return Trainer(cfg)


def test_long_completion_modes_tracked_bytes_agree_with_the_plan_within_10_percent(tmp_path):
    pytest.importorskip("bitsandbytes")  # the offloaded optimizer's 8-bit states
    trainer = _long_modes_trainer(tmp_path)
    prof, _, widths = profile_trainer(trainer, steps=1)
    assert widths == (PROMPT, COMPLETION)  # full lengths, as the planner counts them
    assert trainer.loss_module.offload_copy_on_cpu is False  # real copies while profiling only
    _, measured = device_equivalent(prof, trainer)
    predicted = plan(trainer.cfg, Arch.from_config(trainer.policy.config), autocast=trainer.autocast, device="cpu")

    # Activation offload really moved the layer inputs (and the final norm's saves) to host copies, which a
    # CPU profile counts apart, as the planner's host RAM: one micro-batch's at a time.
    host = prof.result.devices["host"].summary()
    offloaded = host["category_max"]["activations (offloaded)"]
    assert offloaded == pytest.approx(predicted.host_categories["activations (offloaded)"], rel=0.01)
    layer_inputs = ARCH["num_hidden_layers"] * 4 * (PROMPT + COMPLETION) * ARCH["hidden_size"] * 2
    assert offloaded > layer_inputs  # every layer's input, and the norm's
    assert "activations (offloaded)" not in measured["categories"]  # the device-equivalent figure leaves them out

    # The device-equivalent peak, and each training phase's, as the planner predicts them. (Offload is a
    # no-op on a CPU outside profiling: before, the layer inputs stayed, 10% of this peak and more.)
    assert layer_inputs > 0.1 * predicted.peak_bytes
    assert measured["peak_bytes"] == pytest.approx(predicted.peak_bytes, rel=0.10), (
        measured["peak_bytes"] / MiB, predicted.peak_bytes / MiB)
    for phase in ("rollout", "forward", "backward"):
        assert measured["phases"][phase]["peak_bytes"] == pytest.approx(predicted.phases[phase], rel=0.10), phase


@pytest.mark.parametrize("n", [896, 384], ids=["recomputed", "kept"])
def test_cpu_loss_head_bytes_are_the_profiled_ones_forward_and_backward(n):
    # The fused head's torch fallback at Qwen's vocabulary (two or more vocab slices, row chunks in each):
    # three fp32 row-chunk copies in the forward, one in the backward (the gradient is written into the
    # chunk's own copy). 896 rows of logits are over the CPU's keep bound, 384 are kept from the forward
    # for the backward. The planner's figure includes the hidden states in the compute dtype, made outside
    # the op here.
    from lowmem_grpo.kernels import linear_grpo_loss
    from lowmem_grpo.kernels.linear import keep_logits_fits
    from lowmem_grpo.memory.head_bytes import loss_head_bytes
    from lowmem_grpo.memory.profile import MemoryProfile
    from lowmem_grpo.phases import phase
    h, v = 64, 151_936
    assert keep_logits_fits(n, v, 2, "cpu") == (n == 384)
    torch.manual_seed(0)
    weight = torch.randn(v, h, dtype=torch.bfloat16, requires_grad=True)
    hidden = torch.randn(2, n // 2, h, dtype=torch.bfloat16, requires_grad=True)
    ids = torch.randint(0, v, (2, n // 2))
    with MemoryProfile([weight]) as prof:
        with phase("forward"):
            loss, _ = linear_grpo_loss(hidden * 1, weight, ids, torch.tensor([1.0, -1.0]),
                                       mask=torch.ones(2, n // 2, dtype=torch.bool), loss_type="dapo",
                                       num_items_in_batch=n)
        with phase("backward"):
            loss.backward()
    phases = prof.result.devices["host"].summary()["phases"]
    arch = Arch(vocab=v, hidden=h, intermediate=0, layers=0, heads=1, kv_heads=1, head_dim=h, tied=True)
    for name, backward in (("forward", False), ("backward", True)):
        planned = loss_head_bytes(n, arch, 2, 2, backward, "cpu", differentiated=True) - n * h * 2
        measured = phases[name]["categories"]["loss head"]
        assert measured == pytest.approx(planned, rel=0.05), (name, measured / MiB, planned / MiB)
