"""The compiled decode step among the trainer's other machinery (policy/static_decode.py, sampling.py):
the offloaded optimizer's forward pre-hooks, and the fallback to the dynamic step when compiling fails.

Compiled on the CPU with dynamo's "eager" backend: what is counted (graphs, graph breaks) is dynamo's
business, and Inductor's C++ compiles would cost a minute per test.
"""

import logging

import pytest
import torch

from lowmem_grpo.config import GenerationConfig, OptimConfig
from lowmem_grpo.policy import sampling, static_decode
from lowmem_grpo.policy.sampling import sample
from lowmem_grpo.policy.static_decode import StaticKV

from .test_sampling import CPU, PAD, random_prompts
from .test_static_decode import count_graphs


def layered_qwen2(layers: int, seed: int = 0):
    """A tiny random Qwen2 (sdpa) with `layers` decoder layers."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True, initializer_range=0.2, bos_token_id=None,
                         eos_token_id=None, pad_token_id=PAD)
    return Qwen2ForCausalLM(config).eval()


def test_the_offloaded_optimizers_waits_stay_out_of_the_compiled_step(monkeypatch):
    """The offloaded optimizer puts a pre-hook on every module that waits for that module's update
    (optim/offload.py, wait_in_forward). Traced into the compiled step, it split the step of a
    12-layer model into 25 graphs with 28 breaks (and on a GPU the trace crashed). The step must stay one
    graph; the waits happen in the rollout's prefill, which runs eagerly before any decode step: every
    parameter of the model has been waited for before the first compiled step runs."""
    from lowmem_grpo.optim.offload import OffloadedOptimizer
    from lowmem_grpo.optim.optimizers import build_optimizer
    monkeypatch.setattr(static_decode, "COMPILE_BACKEND", "eager")
    events = []
    real_wait = OffloadedOptimizer._wait_for
    monkeypatch.setattr(OffloadedOptimizer, "_wait_for", lambda self, indices: (
        events.append(("wait", tuple(indices))), real_wait(self, indices))[1])
    real_call = StaticKV.__call__
    monkeypatch.setattr(StaticKV, "__call__", lambda self, *a, **k: (
        events.append(("step",)), real_call(self, *a, **k))[1])
    torch._dynamo.reset()
    model = layered_qwen2(12)
    opt = build_optimizer(model, OptimConfig(optimizer="adamw", offload_optimizer=True, learning_rate=1e-3))
    assert isinstance(opt, OffloadedOptimizer)
    opt.wait_in_forward(model)
    cfg = GenerationConfig(max_completion_length=6, generation_micro_batch_size=1, max_prompt_length=8)
    prompts = random_prompts([5, 3], 64, seed=2)
    kw = dict(eos_ids=[], pad_id=PAD, device=CPU, greedy=True)
    out = []
    graphs, breaks = count_graphs(lambda: out.append(sample(model, prompts, 1, cfg, decode="compiled", **kw)))
    assert not breaks, f"graph breaks split the step: {breaks}"
    assert graphs == 1  # one bucket (micro-batch 1): one graph
    assert torch.equal(out[0], sample(model, prompts, 1, cfg, decode="static", **kw))
    first_step = events.index(("step",))
    waited = {i for e in events[:first_step] if e[0] == "wait" for i in e[1]}
    assert waited == set(range(len(opt.params))), "the prefill did not wait for every parameter"
    opt.release_host_memory()


def test_the_15b_recipes_compiled_rollout_runs_under_the_offloaded_optimizer(tmp_path, monkeypatch):
    """The shipped 1.5B recipe as a GPU runs it (compile_decode auto = the compiled step on CUDA; the
    offloaded optimizer's waits on every module) on a 12-layer stand-in on the CPU: its rollouts decode
    with the compiled step, with no graph break and no fallback to the dynamic step, and training goes on."""
    import json
    from pathlib import Path

    from lowmem_grpo.config import load_config
    from lowmem_grpo.training.trainer import Trainer
    from tests.training.conftest import toy_rows, write_jsonl
    monkeypatch.setattr(static_decode, "COMPILE_BACKEND", "eager")
    monkeypatch.setattr(sampling, "_compile_failures", [])
    steps = []
    real_call = StaticKV.__call__
    monkeypatch.setattr(StaticKV, "__call__", lambda self, *a, **k: (
        steps.append(self.compiled), real_call(self, *a, **k))[1])
    torch._dynamo.reset()
    stand_in = {"model_type": "qwen2", "vocab_size": 32, "hidden_size": 32, "intermediate_size": 64,
                "num_hidden_layers": 12, "num_attention_heads": 4, "num_key_value_heads": 2,
                "max_position_embeddings": 64, "tie_word_embeddings": True, "bos_token_id": None,
                "eos_token_id": 1, "pad_token_id": 0}
    recipe = Path(__file__).parents[2] / "recipes" / "qwen2.5-1.5b_gsm8k_8gb.yaml"
    cfg = load_config(recipe, [
        "model.name_or_path=null", f"model.config={json.dumps(stand_in)}", "model.tokenizer=none",
        f"data.train_file={write_jsonl(tmp_path / 'train.jsonl', toy_rows(16))}", "data.eval_file=null",
        "reward_funcs=[tests.training.conftest:label_reward]", "reward_weights=null",
        "max_prompt_length=8", "max_completion_length=6", "max_steps=2", "compile_decode=true",
        f"output_dir={tmp_path / 'run'}", "progress_bar=false", "save_steps=0", "device=cpu"])
    assert cfg.optim.offload_optimizer and cfg.generation.generation_micro_batch_size == 32
    trainer = Trainer(cfg)
    graphs, breaks = count_graphs(trainer.train)
    assert steps and all(steps), "the rollouts did not decode with the compiled step"
    assert not sampling._compile_failures and not breaks, (sampling._compile_failures, breaks)
    assert graphs <= len(static_decode.buckets(32))


def _broken_compile(monkeypatch, error: Exception, after: int = 0) -> list:
    """The compiled step raises `error` from its `after`-th call on (a failed compile: 0; later: a failed
    step mid-rollout). Returns the list of its calls."""
    calls = []

    def compiled_step(backend="inductor"):
        def step(*args, **kwargs):
            calls.append(1)
            if len(calls) > after:
                raise error
            return static_decode.decode_step(*args, **kwargs)
        return step
    monkeypatch.setattr(static_decode, "compiled_step", compiled_step)
    return calls


@pytest.mark.parametrize("after", [0, 3], ids=["at_compile", "mid_rollout"])
def test_any_error_of_the_first_compiled_rollout_falls_back_to_the_dynamic_step(monkeypatch, caplog, after):
    """A plain RuntimeError (not one of torch.compile's own exceptions: a CUDA graph's capture or replay, a
    kernel) in the process's first compiled rollout: the rollout is sampled again with the dynamic step, the
    reason logged once, and later rollouts use the dynamic step without trying again."""
    import dataclasses

    from lowmem_grpo.policy.rollout import generate as rollout_generate
    monkeypatch.setattr(sampling, "_compile_failures", [])
    monkeypatch.setattr(sampling, "_compiled_rollouts", 0, raising=False)
    calls = _broken_compile(monkeypatch, RuntimeError("capture failed: operation not permitted"), after)
    model = layered_qwen2(2, seed=3)
    prompts = [p for p in random_prompts([3, 6], 64) for _ in range(2)]
    cfg = GenerationConfig(max_completion_length=6, compile_decode=True, max_prompt_length=8)
    kw = dict(eos_ids=[], pad_id=PAD, device=CPU, greedy=True)
    dynamic = dataclasses.replace(cfg, compile_decode=False)
    plain = rollout_generate(model, prompts, dynamic, **kw).completion_ids
    with caplog.at_level(logging.WARNING, logger="lowmem_grpo.policy.sampling"):
        first = rollout_generate(model, prompts, cfg, **kw).completion_ids
        second = rollout_generate(model, prompts, cfg, **kw).completion_ids
    assert torch.equal(first, plain) and torch.equal(second, plain)
    assert len(calls) == after + 1 and sampling.decode_mode(model, cfg, CPU) == "dynamic"
    logged = [r.getMessage() for r in caplog.records if "compile_decode" in r.getMessage()]
    assert len(logged) == 1 and "RuntimeError: capture failed" in logged[0], logged


def test_after_a_compiled_rollout_has_succeeded_a_plain_error_is_raised(monkeypatch):
    """Once the compiled step has run a whole rollout in this process, an error that is not torch.compile's
    (nor a graph capture's) is not the compiler's doing: it stops the run, as it would on the dynamic step."""
    from lowmem_grpo.policy.rollout import generate as rollout_generate
    monkeypatch.setattr(sampling, "_compile_failures", [])
    monkeypatch.setattr(sampling, "_compiled_rollouts", 1, raising=False)
    _broken_compile(monkeypatch, RuntimeError("CUDA error: an illegal memory access was encountered"))
    cfg = GenerationConfig(max_completion_length=6, compile_decode=True, max_prompt_length=8)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        rollout_generate(layered_qwen2(2), [[5, 6, 7]] * 2, cfg, eos_ids=[], pad_id=PAD, device=CPU,
                         greedy=True)


def _weight_casts(monkeypatch) -> list:
    """Trace the compiled step through AOTAutograd (where autocast's casts become ops) and list the shapes of
    the 2-D fp32 graph inputs (weights) that its graph casts to bf16."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    casts = []

    def record(gm, example_inputs):
        for node in gm.graph.nodes:
            if node.target is torch.ops.aten._to_copy.default and node.kwargs.get("dtype") == torch.bfloat16:
                src = node.args[0]
                val = src.meta.get("val") if hasattr(src, "meta") else None
                weight = val is not None and val.dim() == 2 and val.dtype == torch.float32
                if src.op == "placeholder" and weight:
                    casts.append(tuple(val.shape))
        return make_boxed_func(gm.forward)
    monkeypatch.setattr(static_decode, "COMPILE_BACKEND", aot_autograd(fw_compiler=record))
    return casts


def test_under_autocast_the_compiled_step_decodes_from_bf16_copies_of_the_fp32_weights(monkeypatch):
    """fp32 master weights decoding under bf16 autocast (the 0.5B recipes): the compiled graph has no cache of
    autocast's casts, so it cast every 2-D weight on every step (15 of 15 here). It decodes from bf16 copies
    made once per rollout instead: no weight cast in the graph, the tokens of the eager static step (whose
    autocast casts the same weights the same way), and the copies (2 bytes per Linear parameter, the tied
    head's once) go when the rollout ends. The next rollout's new copies compile nothing new."""
    casts = _weight_casts(monkeypatch)
    made = []
    real = StaticKV.__init__
    monkeypatch.setattr(StaticKV, "__init__", lambda self, *a, **k: (
        real(self, *a, **k), made.append(self))[0])
    torch._dynamo.reset()
    model = layered_qwen2(2, seed=9)
    cfg = GenerationConfig(max_completion_length=8, generation_micro_batch_size=2, max_prompt_length=8)
    prompts = random_prompts([5, 3, 6], 64, seed=10)
    kw = dict(eos_ids=[], pad_id=PAD, device=CPU, greedy=True, autocast_bf16=True)
    compiled = sample(model, prompts, 2, cfg, decode="compiled", **kw)
    assert torch.equal(compiled, sample(model, prompts, 2, cfg, decode="static", **kw))
    assert casts == [], f"the compiled step casts weights on every step: {casts}"
    again = []  # the next rollout's copies are new tensors: the same graphs serve them
    assert count_graphs(lambda: again.append(sample(model, prompts, 2, cfg, decode="compiled", **kw)))[0] == 0
    assert torch.equal(again[0], compiled)
    linear = {id(p): p for m in model.modules() if isinstance(m, torch.nn.Linear) for p in m.parameters()}
    assert made[0].weight_bytes == 2 * sum(p.numel() for p in linear.values()) and made[0].weights == {}
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the model's own weights untouched


def test_planner_counts_the_bf16_copy_of_the_output_head_under_autocast(monkeypatch):
    """A rollout under autocast with fp32 weights holds a bf16 copy of every layer's weights and of the output
    head (V x H): autocast caches the head's cast too (eager), and the compiled step decodes from its own
    copy. Measured by holding the layer costs fixed and turning autocast on."""
    from lowmem_grpo.config import load_config
    from lowmem_grpo.memory import plan as planner
    from lowmem_grpo.memory.layer_probe import layer_costs
    tiny = {"model_type": "llama", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "tie_word_embeddings": True}
    arch = planner.Arch.from_config(tiny)
    costs = layer_costs(tiny, torch.float32, False)
    monkeypatch.setattr(planner, "layer_costs", lambda config, dtype, autocast: costs)
    cfg = load_config(None, ["model.name_or_path=x", "reward_funcs=[numeric_answer]", "max_prompt_length=100",
                             "max_completion_length=28"])

    def kv(autocast):
        phases = planner.plan(cfg, arch, autocast=autocast, device="cpu").phase_categories
        return phases["rollout"]["KV cache"]
    copies = 2 * (arch.layers * arch.layer_params() + arch.vocab * arch.hidden)
    assert kv(True) - kv(False) == copies
