"""Memory accounting on hand-checkable cases."""

import pytest


from lowmem_grpo.config import load_config
from lowmem_grpo.memory.plan import Arch, optimizer_state_bytes, plan
from lowmem_grpo.optim.optimizer_in_backward import LAG_BYTES
from lowmem_grpo.memory.presets import preset
from lowmem_grpo.host_arena import ALIGN, PAGE

MINIMAL = ["model.name_or_path=x", "reward_funcs=[numeric_answer]"]


def test_parameter_counts_of_the_presets():
    assert Arch.from_config(preset("Qwen2.5-0.5B")).params == 494_032_768
    assert Arch.from_config(preset("Qwen/Qwen2.5-1.5B-Instruct")).params == 1_543_714_304


def test_optimizer_state_bytes_per_tensor_size():
    # 8-bit: 2 bytes/element + two fp32 absmax per 256-block; below 4096 elements bitsandbytes keeps fp32 states
    assert optimizer_state_bytes([4096], "adamw_8bit", 4) == 2 * 4096 + 2 * 4 * 16
    assert optimizer_state_bytes([4097], "adamw_8bit", 4) == 2 * 4097 + 2 * 4 * 17
    assert optimizer_state_bytes([100], "adamw_8bit", 4) == 8 * 100
    assert optimizer_state_bytes([100, 4096], "adamw", 4) == 8 * 4196
    assert optimizer_state_bytes([100], "adamw", 2) == 4 * 100


TINY = {"model_type": "llama", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True}


def test_weights_gradients_and_states_by_precision_and_optimizer_mode():
    arch = Arch.from_config(TINY)
    p, embedding = arch.params, 1000 * 64
    assert p == embedding + 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64) + 64  # tied head counted once
    fp32 = plan(load_config(None, MINIMAL), arch, device="cuda").phase_categories
    assert fp32["forward"]["weights"] == 4 * p
    assert fp32["forward"]["gradients"] == 0  # one micro-batch per step: no gradient exists during forward
    assert fp32["optimizer"]["gradients"] == 4 * p  # every gradient at the step
    assert fp32["optimizer"]["optimizer states"] == optimizer_state_bytes(arch.tensor_sizes, "adamw_8bit", 4)
    accumulating = plan(load_config(None, MINIMAL + ["gradient_accumulation_steps=2", "per_device_train_batch_size=4"]),
                        arch).phase_categories
    assert accumulating["forward"]["gradients"] == 4 * p  # kept from the previous micro-batch
    bf16 = plan(load_config(None, MINIMAL + ["precision=bf16_sr", "optimizer_in_backward=true"]), arch)
    cats = bf16.phase_categories
    assert cats["forward"]["weights"] == 2 * p and "optimizer" not in cats  # the step runs inside backward
    others = sorted(s for s in arch.tensor_sizes if s != embedding)
    # tied embedding (alive from the head to the lookup) + the largest other, + the embedding's second
    # gradient (from the lookup) while it is added to the first
    # On CUDA, up to LAG_BYTES more are held while their norms reach the host (all of them, at this size).
    lag = min(LAG_BYTES, 2 * p)
    assert cats["backward"]["gradients"] - lag in (2 * (embedding + others[-1]), 2 * (2 * embedding + others[-1]))
    assert cats["backward"]["optimizer states"] == fp32["optimizer"]["optimizer states"]  # 8-bit: dtype-independent
    torch_adamw = plan(load_config(None, MINIMAL + ["optimizer=adamw"]), arch).phase_categories["optimizer"]
    assert torch_adamw["optimizer states"] == 8 * p + 8 * p  # two fp32 states + foreach temporaries


def test_layer_probe_kv_cache_bytes_are_the_hand_count():
    import torch
    from lowmem_grpo.memory.layer_probe import layer_costs
    kv_width = 2 * 16  # kv heads x head_dim
    assert layer_costs(TINY, torch.float32, False).kv_cache == 2 * kv_width * 4  # keys + values, fp32
    assert layer_costs(TINY, torch.bfloat16, False).kv_cache == 2 * kv_width * 2
    fp32, bf16 = layer_costs(TINY, torch.float32, False), layer_costs(TINY, torch.bfloat16, False)
    assert 0 < bf16.saved < fp32.saved  # what autograd keeps shrinks with the dtype
    assert fp32.saved >= 64 * 4  # at least the layer's output


@pytest.mark.parametrize("dtype_name, autocast", [("bfloat16", False), ("float32", True), ("float16", False)])
def test_layer_probe_counts_the_same_bytes_with_its_16_bit_matmuls_in_fp32(dtype_name, autocast, monkeypatch):
    # The probe computes 16-bit CPU matmuls in fp32 and rounds back (torch's 16-bit CPU matmul runs reference
    # loops on CPUs without AVX-512): every cost equals the probe's with the matmuls as they are.
    import json
    import torch
    from lowmem_grpo.memory import layer_probe
    config = json.dumps(TINY, sort_keys=True)
    widened = []
    real = layer_probe._matmul_in_fp32

    def counting(func, args, kwargs):
        out = real(func, args, kwargs)
        widened.append(out is not None)
        return out
    monkeypatch.setattr(layer_probe, "_matmul_in_fp32", counting)
    fast = layer_probe._probe.__wrapped__(config, dtype_name, autocast)
    assert any(widened)  # the fp32 matmuls did run
    monkeypatch.setattr(layer_probe, "_matmul_in_fp32", lambda func, args, kwargs: None)
    assert layer_probe._probe.__wrapped__(config, dtype_name, autocast) == fast


def test_phase_categories_add_up_and_checkpointing_trades_activations():
    arch = Arch.from_config(preset("SmolLM2-135M"))
    ckpt = plan(load_config(None, MINIMAL), arch)
    full = plan(load_config(None, MINIMAL + ["gradient_checkpointing=false"]), arch)
    for result in (ckpt, full):
        for name, cats in result.phase_categories.items():
            assert sum(cats.values()) == result.phases[name]
        assert result.peak_bytes == max(result.phases.values())
        assert sum(result.categories.values()) == result.peak_bytes
    assert full.phase_categories["forward"]["activations"] > 3 * ckpt.phase_categories["forward"]["activations"]


# Budgets for the allocator peak: 6.5 GiB leaves >= 1 GiB under a desktop's 7.5 GiB; the
# 1024-token variant must fit 7.5 GiB with the margin: (7.5 - 0.5) / 1.05 = 6.67.
@pytest.mark.parametrize("recipe, arch, budget", [("qwen2.5-0.5b_gsm8k_8gb.yaml", "Qwen2.5-0.5B", 6.5),
                                                   ("qwen2.5-1.5b_gsm8k_8gb.yaml", "Qwen2.5-1.5B", 6.5),
                                                   ("qwen2.5-1.5b_gsm8k-1024_8gb.yaml", "Qwen2.5-1.5B", 6.67),
                                                   # reasoning lengths: 4096 tokens in 7.5 GiB
                                                   # with the margin, 8192 in 8 GiB: (8 - 0.5) / 1.05 = 7.14
                                                   ("qwen2.5-1.5b_gsm8k-4096_8gb.yaml", "Qwen2.5-1.5B", 6.67),
                                                   ("qwen2.5-1.5b_gsm8k-8192_8gb.yaml", "Qwen2.5-1.5B", 7.14),
                                                   # 3B must fit 7.5 GiB with the margin too; its one-layer
                                                   # probe takes ~100 s on 2 CPU cores, hence slow
                                                   pytest.param("qwen2.5-3b_gsm8k_8gb.yaml", "Qwen2.5-3B", 6.67,
                                                                marks=pytest.mark.slow)])
def test_8gb_recipes_are_predicted_within_budget(recipe, arch, budget):
    from pathlib import Path
    cfg = load_config(Path(__file__).parents[2] / "recipes" / recipe)
    result = plan(cfg, Arch.from_config(preset(arch)))
    assert result.peak_bytes / 2**30 <= budget, result
    assert "evaluation" in result.phases  # every 8 GB recipe has held-out prompts: evaluation is planned


def _plan_json(capsys, *argv):
    import json
    from lowmem_grpo.cli import main
    capsys.readouterr()
    if "--gpu-memory" not in argv:  # on a GPU machine plan's default is the card's free memory
        argv = (*argv, "--gpu-memory", "8GiB")
    status = main(["plan", *argv, "--json", "--host-memory", "64GiB"])  # this machine's RAM may be smaller
    out = json.loads(capsys.readouterr().out)
    assert status == (0 if out["fits"] and out["host_fits"] else 1)  # the exit status says whether it fits
    return out


def test_plan_cli_json_for_presets_by_short_name_and_hub_id(capsys):
    short = _plan_json(capsys, "--model", "Qwen2.5-1.5B")
    hub = _plan_json(capsys, "--model", "Qwen/Qwen2.5-1.5B-Instruct")
    assert short["peak_bytes"] == hub["peak_bytes"] and short["params"] == 1_543_714_304
    assert {"peak_bytes", "fits", "phases", "categories", "margin_bytes", "suggestions"} <= short.keys()
    assert set(short["phases"]) == {"rollout", "forward", "backward", "optimizer"}
    assert sum(short["categories"].values()) == short["peak_bytes"]  # the categories at the peak
    # fp32 master weights, full gradients: 1.5B does not fit 8 GiB, and the suggestions find a combination that does
    assert not short["fits"]
    assert any(s.get("combined") and s["fits"] for s in short["suggestions"])


def test_plan_cli_for_the_8gb_recipes_and_overrides(capsys, monkeypatch):
    from pathlib import Path
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no network: presets and the layer probe only
    recipes = Path(__file__).parents[2] / "recipes"
    for recipe in ("qwen2.5-0.5b_expected-string_8gb.yaml", "qwen2.5-0.5b_gsm8k_8gb.yaml"):
        assert _plan_json(capsys, str(recipes / recipe))["fits"], recipe
    big = _plan_json(capsys, str(recipes / "qwen2.5-1.5b_gsm8k_8gb.yaml"))
    assert big["fits"] and big["peak_bytes"] / 2**30 <= 6.5
    assert big["host_categories"]["optimizer states"] > 2**30  # offload_optimizer: the 8-bit states in host RAM
    longer = _plan_json(capsys, str(recipes / "qwen2.5-1.5b_gsm8k_8gb.yaml"), "max_completion_length=4096")
    assert longer["phases"]["backward"] > big["phases"]["backward"]
    assert longer["phases"]["rollout"] > big["phases"]["rollout"]
    small = _plan_json(capsys, "--model", "SmolLM2-135M", "--gpu-memory", "24GiB")
    assert small["fits"] and small["gpu_memory_bytes"] == 24 * 2**30


def test_plan_cli_errors(capsys):
    from lowmem_grpo.cli import main
    assert main(["plan", "--model", "Qwen2.5-1.5B", "--gpu-memory", "lots"]) == 2
    assert "give a size such as 8GiB" in capsys.readouterr().err
    assert main(["plan", "--model", "NoSuchModel-7B"]) == 2
    assert "neither a local config.json" in capsys.readouterr().err


def test_plan_names_an_architecture_it_cannot_read(tmp_path, capsys):
    import json
    from lowmem_grpo.cli import main
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4}))
    assert main(["plan", "--model", str(tmp_path / "config.json")]) == 2
    assert "has no intermediate_size" in capsys.readouterr().err


def test_offloaded_optimizer_moves_states_to_the_host_and_counts_host_ram():
    arch = Arch.from_config(TINY)
    p = arch.params
    common = MINIMAL + ["precision=bf16_sr", "optimizer_in_backward=true", "beta=0.04"]
    on_device = plan(load_config(None, common), arch)
    offloaded = plan(load_config(None, common + ["offload_optimizer=true"]), arch)
    states = optimizer_state_bytes(arch.tensor_sizes, "adamw_8bit", 2)
    embedding = 1000 * 64  # the tied (V, H) weight: its head gradient goes to its own host buffer (offload.py)
    for phase, cats in offloaded.phase_categories.items():
        assert cats["optimizer states"] == 0, phase  # no state and no update temporaries on the device
        if phase != "backward":
            assert cats.get("gradients", 0) == on_device.phase_categories[phase].get("gradients", 0), phase
    # Pinned on a GPU, in blocks laid out as host_arena.py lays them out: each tensor starts
    # on a 64-byte boundary, each block is whole pages (tests/memory/test_host_ram_plan.py checks them
    # against the real buffers). Every tensor of this model is a multiple of 64 bytes in bf16.
    assert all(2 * n % ALIGN == 0 for n in arch.tensor_sizes)
    pages = lambda n: -(-n // PAGE) * PAGE  # noqa: E731
    ref = pages(2 * p)  # the streamed reference: one block
    copy_and_grads = pages(2 * p + 2 * p + 4 * len(arch.tensor_sizes))  # + one fp32 norm slot per tensor
    assert on_device.host_categories == {"reference model": ref}  # beta > 0: the frozen copy in CPU RAM
    assert offloaded.host_categories == {"reference model": ref, "optimizer states": states,
                                            "weights copy": 2 * p,
                                            "gradient buffer": copy_and_grads - 2 * p + pages(2 * embedding)}
    assert offloaded.host_bytes == ref + copy_and_grads + pages(2 * embedding) + states
    assert offloaded.host_pinned_bytes == offloaded.host_bytes - states  # all but the states
    masters = plan(load_config(None, common + ["offload_optimizer=true", "optimizer=adamw"]), arch)
    assert masters.host_categories == {"reference model": ref, "optimizer states": 8 * p,  # fp32 m and v
                                          "weights copy": 4 * p,  # fp32 master (not pinned), bf16 grads
                                          "gradient buffer": pages(2 * p + 4 * len(arch.tensor_sizes))
                                          + pages(2 * embedding)}
    assert masters.host_pinned == ["reference model", "gradient buffer"]
    on_cpu = plan(load_config(None, common + ["offload_optimizer=true", "reference_compute=cpu"]), arch)
    assert on_cpu.host_categories["reference model"] == 2 * p  # run on the CPU: plain tensors, not pinned
    assert on_cpu.host_pinned == ["weights copy", "gradient buffer"]


def test_offloaded_accumulation_keeps_the_gradients_on_the_host():
    # gradient_accumulation_steps=4 offloaded (no optimizer_in_backward setting): the device holds the
    # gradients of the hooks in flight only (as with one micro-batch per step), never a whole gradient;
    # the host holds the staging ring on top of the buffers of one micro-batch per step.
    from lowmem_grpo.optim.offload import staging_bytes
    arch = Arch.from_config(TINY)
    common = MINIMAL + ["precision=bf16_sr", "steps_per_generation=4", "offload_optimizer=true"]
    one = plan(load_config(None, common + ["gradient_accumulation_steps=1"]), arch)
    four = plan(load_config(None, common + ["gradient_accumulation_steps=4"]), arch)
    plain = plan(load_config(None, MINIMAL + ["precision=bf16_sr", "steps_per_generation=4",
                                              "gradient_accumulation_steps=4"]), arch)
    for phase in four.phase_categories:
        assert four.phase_categories[phase].get("gradients", 0) == one.phase_categories[phase].get("gradients", 0)
    assert four.phase_categories["forward"].get("gradients", 0) == 0  # plain: every gradient, from micro-batch 2
    assert plain.phase_categories["forward"]["gradients"] == 2 * arch.params
    assert four.host_categories["gradient buffer"] == one.host_categories["gradient buffer"] + staging_bytes()
    # no optimizer phase holding every gradient on the device: the update runs on the host, whether or not
    # optimizer_in_backward is also set (it is implied)
    assert "optimizer" not in four.phases and "optimizer" not in one.phases
    in_backward = plan(load_config(None, common + ["gradient_accumulation_steps=1", "optimizer_in_backward=true"]),
                       arch)
    assert one.phase_categories == in_backward.phase_categories


def test_offload_splits_the_tied_embedding_gradients_at_the_lookup(monkeypatch):
    # Qwen2.5-3B, bf16, batch 1 x 128-token completions, no reference: at the end of backward (the
    # embedding lookup) the device holds, besides the weights: on the device optimizer, the head's (V, H)
    # gradient + the lookup's (V, H) gradient + the largest other tensor's + the gradients whose norms are
    # on their way (LAG_BYTES); offloaded, the head's went to the host at once: one (V, H) fewer.
    import lowmem_grpo.memory.plan as planner
    from lowmem_grpo.memory.layer_probe import layer_costs
    # gradients do not depend on the layer's activation costs: a tiny layer's stand in (the 3B probe takes ~100 s)
    monkeypatch.setattr(planner, "layer_costs", lambda config, dtype, autocast: layer_costs(TINY, dtype, autocast))
    arch = Arch.from_config(preset("Qwen2.5-3B"))
    vh = 151936 * 2048  # 311,164,928 elements: 0.580 GiB in bf16
    mlp = 2048 * 11008  # the largest other tensor
    assert max(s for s in arch.tensor_sizes if s != vh) == mlp
    common = MINIMAL + ["precision=bf16_sr", "optimizer_in_backward=true", "per_device_train_batch_size=1",
                        "max_completion_length=128", "num_generations=8", "steps_per_generation=8"]
    grads = {}
    for offload in (False, True):
        cats = plan(load_config(None, common + [f"offload_optimizer={offload}"]), arch).phase_categories
        grads[offload] = cats["backward"]["gradients"]
    assert grads[False] == 2 * (2 * vh + mlp) + LAG_BYTES  # 1.232 GiB
    assert grads[True] == 2 * (vh + mlp) + LAG_BYTES  # 0.653 GiB
    assert grads[False] - grads[True] == 2 * vh


def test_plan_suggests_the_offload_and_checks_host_ram(capsys):
    from lowmem_grpo.cli.plan import run
    # Qwen2.5-1.5B in bf16 with the optimizer in backward needs ~7.1 GiB: over a 6 GiB card until the
    # optimizer states leave it.
    args = ["precision=bf16_sr", "optimizer_in_backward=true", "max_completion_length=256"]
    assert run(None, "Qwen2.5-1.5B", "6GiB", args, False, host_memory="64GiB") == 1  # a script can tell
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out
    line = next(x for x in out.splitlines() if x.strip().startswith("offload_optimizer=true"))
    assert "(fits, host RAM" in line
    assert run(None, "Qwen2.5-1.5B", "8GiB", args + ["offload_optimizer=true"], False, host_memory="4GiB") == 1
    assert "error: the run keeps" in capsys.readouterr().out


def _eval_config(*overrides):
    # generation batch of 8 completions (per_device_train_batch_size 8, one step per batch): 8 rows at once
    return load_config(None, MINIMAL + ["generation_micro_batch_size=16", "max_completion_length=256",
                                        *overrides])


def test_evaluation_is_a_phase_where_there_are_held_out_prompts():
    # evaluation (training/evaluate.py) decodes eval_batch_size held-out prompts per greedy generate call,
    # between steps: the weights and states stay, no gradient exists; its rows cost what rollout rows cost
    from lowmem_grpo.memory.plan import evaluation_rows
    arch = Arch.from_config(preset("SmolLM2-135M"))
    assert "evaluation" not in plan(_eval_config(), arch).phases  # no held-out prompts: no evaluation
    assert evaluation_rows(_eval_config()) == 0
    assert evaluation_rows(_eval_config("eval_file=x.jsonl")) == 64  # the default eval_batch_size
    assert evaluation_rows(_eval_config("eval_file=x.jsonl", "eval_max_samples=20")) == 20
    assert evaluation_rows(_eval_config("eval_holdout=10")) == 10  # only 10 prompts to evaluate
    same = plan(_eval_config("eval_file=x.jsonl", "eval_batch_size=8"), arch).phase_categories
    assert same["evaluation"] == same["rollout"]  # as many rows as the rollout's generation micro-batch
    wide = plan(_eval_config("eval_file=x.jsonl"), arch).phase_categories["evaluation"]
    assert wide["weights"] == same["evaluation"]["weights"] and "gradients" not in wide
    kv16 = plan(_eval_config("eval_file=x.jsonl", "eval_batch_size=16"),
                arch).phase_categories["evaluation"]["KV cache"]
    kv8, kv64 = same["evaluation"]["KV cache"], wide["KV cache"]
    # per row: the cache and the logits (or the prefill); once: autocast's weight copies
    assert kv64 - kv8 == pytest.approx(7 * (kv16 - kv8), abs=8) and kv16 > kv8


def test_3b_recipe_plans_its_evaluation_and_plan_names_the_eval_batch_as_the_fix():
    from pathlib import Path
    # (the 3B one-layer probe: 3.2 s on this 2-core CPU, shared with the slow budget test's)
    from lowmem_grpo.memory.plan import margin_bytes
    from lowmem_grpo.memory.suggest import suggestions
    recipe = Path(__file__).parents[2] / "recipes" / "qwen2.5-3b_gsm8k_8gb.yaml"
    arch, budget = Arch.from_config(preset("Qwen2.5-3B")), int(7.5 * 2**30)
    shipped = plan(load_config(recipe), arch)
    assert "evaluation" in shipped.phases and shipped.peak_bytes + margin_bytes(shipped.peak_bytes) <= budget
    wide_cfg = load_config(recipe, ["eval_batch_size=64"])  # the default: 64 generation rows of 640 tokens
    wide = plan(wide_cfg, arch)
    assert wide.peak_phase == "evaluation" and wide.peak_bytes + margin_bytes(wide.peak_bytes) > budget
    first = suggestions(wide_cfg, arch, budget)[0]
    assert first.change == "eval_batch_size=16" and first.fits  # the cheapest: evaluation time only


def test_padding_mask_and_sdpas_copy_of_it_are_counted_as_a_tracked_run_measures_them():
    # Unpacked rows with padding: transformers makes one bool (B, 1, L, L) mask per decoder forward, kept
    # (as a checkpointed layer input) until backward is over, and sdpa makes an additive copy in the query
    # dtype in every attention call. A checkpointed forward + backward, tracked on the CPU, with and
    # without padding (an all-ones mask gets no 4D mask): the difference is those two, to the byte here.
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from lowmem_grpo import memory
    from lowmem_grpo.memory.plan import decoder_positions
    from lowmem_grpo.policy.model import enable_checkpointing, position_ids_for
    B, P, C = 4, 16, 240
    L = P + C
    config = dict(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1)
    cfg = load_config(None, MINIMAL + [f"per_device_train_batch_size={B}", "num_generations=4",
                                       f"max_prompt_length={P}", f"max_completion_length={C}", "pack_prompts=false"])
    arch = Arch.from_config(config)
    positions, held, per_call = decoder_positions(cfg, arch, B, query_bytes=4)  # fp32: no autocast on the CPU
    assert (positions, held, per_call) == (B * L, B * L * L, 4 * B * L * L)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), attn_implementation="sdpa")
        ids = torch.randint(0, 64, (B, L))
    enable_checkpointing(model)
    model.train()

    def peak(mask):
        with memory.track(device="cpu") as t:
            hidden = model.model(input_ids=ids, attention_mask=mask, position_ids=position_ids_for(mask),
                                 use_cache=False).last_hidden_state
            hidden.float().pow(2).sum().backward()
            del hidden
        model.zero_grad(set_to_none=True)
        return t.peak_bytes

    full = torch.ones(B, L, dtype=torch.long)
    padded = full.clone()
    padded[0, :3] = 0  # a shorter prompt, left-padded
    padded[1, -50:] = 0  # a completion that ended early
    measured = peak(padded) - peak(full)
    assert measured == pytest.approx(held + per_call, rel=0.1), (measured, held, per_call)
    # and plan() adds them where a layer runs: the mask all step, one copy per layer at work
    sdpa = plan(cfg, arch, autocast=False, device="cpu").phase_categories
    flex = plan(load_config(None, MINIMAL + [f"per_device_train_batch_size={B}", "num_generations=4",
                                             f"max_prompt_length={P}", f"max_completion_length={C}",
                                             "pack_prompts=false", "attn_implementation=flex_attention"]),
                arch, autocast=False, device="cpu").phase_categories
    assert sdpa["backward"]["activations"] - flex["backward"]["activations"] == held + per_call


def test_activation_offload_moves_layer_inputs_and_the_norms_saves_over_its_minimum_to_the_host():
    # model.offload_activations: the layer inputs checkpointing keeps and the final norm's saves (all but its
    # output; a tensor saved twice goes once) are host RAM, one micro-batch's; tensors under activation
    # offload's 1 MiB minimum stay on the device (training/activation_offload.py), so a plan with
    # layer inputs under it is the plan without offload.
    import torch
    from lowmem_grpo.memory.layer_probe import layer_costs
    from lowmem_grpo.training.activation_offload import MIN_BYTES
    arch = Arch.from_config(TINY)  # hidden 64 in bf16: a layer input is 128 bytes per position
    length = 2048

    def planned(rows, offload):
        return plan(load_config(None, MINIMAL + [
            "precision=bf16_sr", f"per_device_train_batch_size={rows}", "num_generations=2", "max_prompt_length=64",
            f"max_completion_length={length - 64}", "pack_prompts=false", f"offload_activations={offload}"]),
            arch, autocast=False)

    small = 2 * length * 64 * 2  # 2 rows: 0.5 MiB per layer input
    assert small < MIN_BYTES
    assert planned(2, "true").phase_categories == planned(2, "false").phase_categories
    assert "activations (offloaded)" not in planned(2, "true").host_categories
    T = 4 * length  # 4 rows: 1 MiB per layer input, moved
    on, off = planned(4, "true"), planned(4, "false")
    costs = layer_costs(arch.config, torch.bfloat16, False)
    # each saved tensor moves once (the fp32 input too, which pow and mul both save); its output stays
    assert costs.norm_offloaded + costs.norm_left_offloaded == costs.norm_saved and costs.norm_left_offloaded > 0
    layer_io = T * 64 * 2
    assert on.host_categories["activations (offloaded)"] == int(2 * layer_io + costs.norm_offloaded * T)
    assert "activations (offloaded)" not in off.host_categories
    # forward: two layer inputs kept, against the one on its way to the host; backward: its end (the last
    # layer's input back, every gradient made) is the same either way
    assert off.phases["forward"] - on.phases["forward"] >= layer_io
    assert on.phases["backward"] <= off.phases["backward"]


def test_plan_exits_1_when_the_run_does_not_fit_and_refuses_an_empty_card(capsys):
    from lowmem_grpo.cli import main
    args = ["plan", "--model", "Qwen2.5-1.5B", "precision=bf16_sr", "max_completion_length=256", "--host-memory",
            "64GiB"]
    assert main([*args, "--gpu-memory", "2GiB"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out
    assert main([*args, "--gpu-memory", "2GiB", "--json"]) == 1
    assert main([*args, "--gpu-memory", "80GiB", "--json"]) == 0
    capsys.readouterr()
    for size in ("0", "0GiB", "0.0001MiB"):
        assert main([*args, "--gpu-memory", size]) == 2
        err = capsys.readouterr().err
        assert f"--gpu-memory {size!r}: a memory size must be at least 1MiB" in err and "8GiB" in err
