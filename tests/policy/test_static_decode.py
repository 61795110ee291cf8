"""The static-shape decode step (policy/static_decode.py): preallocated cache, buckets, compiled.

Greedy tokens are compared with transformers' generate() (through rollout.generate with
fast_rollout=false) on the tiny random models of test_sampling.py, with refill and compaction active;
the compiled step with the eager static step. Compiled tests on the CPU use Inductor only where the
test is about what Inductor produces (weights read at run time); counting compilations is dynamo's
business, so that test traces with the "eager" backend (seconds, not a minute of C++ compiles).
"""

import dataclasses

import pytest
import torch

from lowmem_grpo.config import ConfigError, GenerationConfig, load_config
from lowmem_grpo.policy import static_decode
from lowmem_grpo.policy.sampling import SamplingStats, decode_mode, sample
from lowmem_grpo.policy.static_decode import (SPARE_COLUMNS, StaticKV, bucket_for, buckets, length_bucket_for,
                                              length_buckets, static_decode_problem)

from .test_refill import generate_completions
from .test_sampling import CPU, PAD, frequent_token, random_prompts, tiny_model

# max_prompt_length sets the static cache's length (prompt limit + completion limit): kept small here
CFG = dict(max_prompt_length=16)


def test_buckets():
    assert buckets(64) == [8, 16, 32, 64] and buckets(16) == [2, 4, 8, 16]
    assert buckets(3) == [1, 2, 3] and buckets(1) == [1]
    assert [bucket_for(n, 64) for n in (1, 8, 9, 33, 64)] == [8, 8, 16, 64, 64]
    assert length_buckets(1280) == [160, 320, 640, 1280] and length_buckets(139) == [24, 40, 72, 139]
    assert length_buckets(22) == [8, 16, 22] and length_buckets(5) == [5]
    assert [length_bucket_for(n, 139) for n in (0, 24, 25, 73, 139, 150)] == [24, 24, 40, 139, 139, 139]


@pytest.mark.parametrize("arch, attn, autocast_bf16, G, micro_batch, read_every", [
    ("llama", "sdpa", False, 3, 8, None), ("qwen2", "sdpa", False, 3, 8, None),  # whole prompts per batch
    ("llama", "eager", False, 6, 4, 3), ("qwen2", "sdpa", True, 6, 4, 3)])  # split prompts, reads every 3
def test_static_greedy_matches_generate(arch, attn, autocast_bf16, G, micro_batch, read_every):
    """Token for token with generate(), with refills (prefix K/V copied into a static row), compaction into
    smaller buckets, and (read_every 3) finished rows decoding past their end until the host reads."""
    model = tiny_model(arch)
    model.set_attn_implementation(attn)
    distinct = random_prompts([3, 7, 5, 9, 4, 6], 64)
    cfg = GenerationConfig(max_completion_length=20, generation_micro_batch_size=micro_batch, **CFG)
    eos = frequent_token(model, distinct, cfg)
    slow = generate(model, [p for p in distinct for _ in range(G)], cfg, eos, autocast_bf16)
    stats = SamplingStats()
    fast = sample(model, distinct, G, cfg, eos_ids=[eos], pad_id=PAD, device=CPU, greedy=True, stats=stats,
                  autocast_bf16=autocast_bf16, read_every=read_every, decode="static")
    assert fast.shape == slow.shape and torch.equal(fast, slow), f"\n{fast}\n{slow}"
    lengths = (slow != PAD).sum(1)
    assert lengths.min() < lengths.max()
    assert stats.refills > 0 and stats.prefill_rows == len(distinct)
    assert stats.compactions > 0 or micro_batch == 4  # (at 4 the last rows end together here)
    # every decode step ran a whole bucket
    assert stats.decode_row_steps % min(buckets(micro_batch)) == 0


def generate(model, prompts, cfg, eos, autocast_bf16=False):
    """generate()'s greedy completions (rollout.generate, fast_rollout false): (N, C)."""
    from lowmem_grpo.policy.rollout import generate as rollout_generate
    return rollout_generate(model, prompts, dataclasses.replace(cfg, fast_rollout=False), eos_ids=[eos], pad_id=PAD,
                            device=CPU, greedy=True, autocast_bf16=autocast_bf16).completion_ids


def test_static_edge_cases_match_generate():
    """One-token prompts (nothing to copy into the row), a prompt with no samples, uneven counts, prompts
    longer than max_prompt_length (the cache is widened for the call), fewer rows than the micro-batch."""
    model = tiny_model("llama", seed=5)
    distinct = random_prompts([1, 6, 2, 1, 11, 4], 64, seed=6)
    counts = [2, 3, 0, 1, 4, 2]
    prompts = [p for p, c in zip(distinct, counts) for _ in range(c)]
    for micro_batch in (3, 16):
        cfg = GenerationConfig(max_completion_length=16, generation_micro_batch_size=micro_batch, max_prompt_length=8)
        eos = frequent_token(model, distinct, cfg)
        fast = sample(model, distinct, counts, cfg, eos_ids=[eos], pad_id=PAD, device=CPU, greedy=True,
                      decode="static")
        slow = generate_completions(model, prompts, cfg, eos)
        assert fast.shape == slow.shape and torch.equal(fast, slow), f"micro_batch {micro_batch}\n{fast}\n{slow}"


def test_the_step_attends_over_the_length_bucket_of_the_longest_row(monkeypatch):
    """Each step reads the K/V columns of the smallest length bucket that holds every row's position (known on
    the host: no device read), not the whole preallocated length; the tokens stay generate()'s."""
    attended = []

    def recording(model, input_ids, positions, keys, values, **kw):
        attended.append((keys[0].shape[2], int(positions.max())))
        return decode_step(model, input_ids, positions, keys, values, **kw)
    decode_step = static_decode.decode_step
    monkeypatch.setattr(static_decode, "decode_step", recording)
    model = tiny_model("qwen2", seed=7)
    distinct = random_prompts([3, 6, 2, 5], 64, seed=8)
    cfg = GenerationConfig(max_completion_length=40, generation_micro_batch_size=4, max_prompt_length=24)
    eos = frequent_token(model, distinct, cfg)
    fast = sample(model, distinct, 3, cfg, eos_ids=[eos], pad_id=PAD, device=CPU, greedy=True, decode="static")
    assert torch.equal(fast, generate(model, [p for p in distinct for _ in range(3)], cfg, eos))
    length = 24 + 40
    for columns, last in attended:
        assert columns == length_bucket_for(last + 1, length), (columns, last)
    assert len({c for c, _ in attended}) > 1 and sum(c for c, _ in attended) < 0.75 * length * len(attended)


def test_static_cache_bytes_are_the_planned_preallocation():
    """The buffers are micro-batch rows x (max_prompt_length + completion limit) x layers x K and V, allocated
    once (memory/plan.py's "KV cache" term); fewer rows than the micro-batch take the bucket that holds them.
    They are freed when the rollout ends, even where something still refers to them."""
    model = tiny_model("qwen2")
    cfg = GenerationConfig(max_completion_length=12, generation_micro_batch_size=16, max_prompt_length=10)
    made = []
    real = StaticKV.__init__

    def spy(self, *args, **kwargs):
        real(self, *args, **kwargs)
        made.append(self)
        held.append(self.keys[0])  # a reference that outlives the rollout (as compile-time records can)
    held = []
    c = model.config
    per_row_token = c.num_hidden_layers * 2 * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 4
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(StaticKV, "__init__", spy)
        for prompts, G, rows in (([[5, 6, 7]] * 1, 40, 16), ([[5, 6, 7], [8, 9]], 3, 8)):
            sample(model, prompts, G, cfg, eos_ids=[1], pad_id=PAD, device=CPU, decode="static")
            assert made[-1].rows == rows and made[-1].nbytes == rows * (10 + 12 + SPARE_COLUMNS) * per_row_token
    assert len(made) == 2  # one allocation per rollout
    assert [t.untyped_storage().nbytes() for t in held] == [0, 0]  # freed when the rollout ended all the same


def test_planner_counts_the_static_cache_of_the_bucket():
    """With the compiled static step (auto: on CUDA) the rollout holds the bucket's rows of cache,
    allocated whole: 40 rows decoding at micro-batch 64 hold 64 rows (buckets 8, 16, 32, 64); the dynamic
    step (the CPU, or compile_decode=false) 40. A micro-batch that is a bucket plans as before. On CUDA the
    rollout's graphs add their static logits buffer (rows x V fp32) and pool (rows x V in the compute dtype,
    bf16 under autocast), the rollout's alone: the other phases are the same with and without them."""
    from lowmem_grpo.memory.layer_probe import layer_costs
    from lowmem_grpo.memory.plan import Arch, plan
    tiny = {"model_type": "llama", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True}
    arch = Arch.from_config(tiny)
    common = ["model.name_or_path=x", "reward_funcs=[numeric_answer]", "generation_micro_batch_size=64",
              "per_device_train_batch_size=8", "steps_per_generation=5", "max_prompt_length=100",
              "max_completion_length=28"]  # a generation batch of 40 rows, sequences of 128

    def phases(device, *more):
        return plan(load_config(None, common + list(more)), arch, device=device).phase_categories

    def kv(device, *more):
        return phases(device, *more)["rollout"]["KV cache"]
    per_column = 2 * layer_costs(tiny, torch.float32, True).kv_cache  # a row's column: layers x K, V
    per_row = 128 * per_column  # (prompt + completion) columns
    spare = 64 * SPARE_COLUMNS * per_column  # the static buffers' columns past the length
    graphs = (4 + 2) * 64 * 1000  # 64 rows x V: the fp32 logits buffer, the pool's bf16 logits
    assert kv("cuda") - kv("cuda", "compile_decode=false") == (64 - 40) * per_row + spare + graphs
    assert kv("cpu") == kv("cuda", "compile_decode=false")
    assert kv("cpu", "compile_decode=true") == kv("cuda") - graphs
    spg8 = "steps_per_generation=8"
    assert kv("cuda", spg8) == kv("cuda", spg8, "compile_decode=false") + spare + graphs
    on, off = phases("cuda"), phases("cuda", "compile_decode=false")
    assert {k: v for k, v in on.items() if k not in ("rollout", "evaluation")} == {
        k: v for k, v in off.items() if k not in ("rollout", "evaluation")}


def test_profiler_counts_the_static_cache_as_the_rollouts_kv_cache(tmp_path, monkeypatch):
    """A trainer step with generation.compile_decode=true on the CPU: the preallocated buffers are
    made in the rollout phase and counted there as "KV cache", whole (not grown)."""
    import json
    from lowmem_grpo.memory.profile import profile_trainer
    from lowmem_grpo.training.trainer import Trainer
    from tests.training.conftest import TINY_LLAMA, toy_rows, write_jsonl
    monkeypatch.setattr(static_decode, "COMPILE_BACKEND", "eager")  # the compiled path, without Inductor's wait
    made = []
    real = StaticKV.__init__
    monkeypatch.setattr(StaticKV, "__init__", lambda self, *a, **k: (real(self, *a, **k), made.append(self))[0])
    train = write_jsonl(tmp_path / "train.jsonl", toy_rows(16))
    cfg = load_config(None, [
        f"model.config={json.dumps(TINY_LLAMA)}", "model.tokenizer=none", f"data.train_file={train}",
        "num_generations=4", "max_prompt_length=8", "max_completion_length=6", "per_device_train_batch_size=4",
        "steps_per_generation=2", "generation_micro_batch_size=8", "compile_decode=true", "optimizer=adamw",
        "reward_funcs=[tests.training.conftest:label_reward]", f"output_dir={tmp_path / 'run'}",
        "progress_bar=false", "device=cpu"])
    prof, _, _ = profile_trainer(Trainer(cfg), steps=1)
    assert len(made) == 1 and made[0].rows == 8
    # rows x columns x layers x (K, V) x heads x dim x fp32
    assert made[0].nbytes == 8 * (8 + 6 + SPARE_COLUMNS) * 2 * 2 * 2 * 16 * 4
    kv = prof.result.devices["host"].summary()["phases"]["rollout"]["categories"]["KV cache"]
    assert kv >= made[0].nbytes


def count_graphs(fn):
    """dynamo's compiled graphs and graph breaks while fn runs (the counters are process-wide: an earlier
    test's compilations, e.g. tests/kernels/test_library.py's, are in them already)."""
    from torch._dynamo.utils import counters
    graphs, breaks = counters["stats"]["unique_graphs"], dict(counters["graph_break"])
    fn()
    new_breaks = {k: n - breaks.get(k, 0) for k, n in counters["graph_break"].items() if n > breaks.get(k, 0)}
    return counters["stats"]["unique_graphs"] - graphs, new_breaks


def test_compilations_bounded_by_buckets(monkeypatch):
    """Prompts of other lengths, other numbers of samples (batch sizes), sampled and greedy, and
    repeated rollouts compile the step at most once per batch bucket, with no graph break: its attended
    length is dynamic, so the length buckets share their batch bucket's graph."""
    # dynamo and AOT tracing (its guards), no Inductor
    monkeypatch.setattr(static_decode, "COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()
    model = tiny_model("llama", seed=11)
    cfg = GenerationConfig(max_completion_length=10, generation_micro_batch_size=8, **CFG)
    calls = [(random_prompts([3, 9], 64, seed=1), 4, True), (random_prompts([12, 2, 5], 64, seed=2), 3, False),
             (random_prompts([7], 64, seed=3), 2, True), (random_prompts([4, 4, 6, 1, 16], 64, seed=4), 5, False),
             (random_prompts([3, 9], 64, seed=1), 4, True)]

    shapes = set()  # (batch, length) buckets the step ran at
    views = StaticKV.bucket_views
    monkeypatch.setattr(StaticKV, "bucket_views", lambda self, B, L: shapes.add((B, L)) or views(self, B, L))

    def rollouts(calls):
        torch.manual_seed(0)
        for prompts, G, greedy in calls:
            sample(model, prompts, G, cfg, eos_ids=[7, 11, 13], pad_id=PAD, device=CPU, greedy=greedy,
                   decode="compiled")
    graphs, breaks = count_graphs(lambda: rollouts(calls))
    assert not breaks, f"graph breaks split the step: {breaks}"
    assert 1 < graphs <= len(buckets(8)), f"{graphs} compilations for buckets {buckets(8)}"
    assert len(shapes) > graphs + 2, f"the length buckets were not exercised: {sorted(shapes)}"  # one graph each
    assert count_graphs(lambda: rollouts(calls[1:3]))[0] == 0  # and none on later steps


def test_compiled_step_sees_weights_changed_in_place():
    """Items 2 and 4 with Inductor on the CPU: greedy tokens identical to the eager static step; a weight
    changed in place (as the optimizers update them) changes the next rollout, which again equals eager,
    without compiling again. One bucket (micro-batch 1) keeps it to a single compilation."""
    torch._dynamo.reset()
    model = tiny_model("qwen2", seed=13)
    cfg = GenerationConfig(max_completion_length=8, generation_micro_batch_size=1, **CFG)
    prompts = random_prompts([5, 3], 64, seed=14)
    kw = dict(eos_ids=[], pad_id=PAD, device=CPU, greedy=True)

    def both():
        return sample(model, prompts, 1, cfg, decode="static", **kw), sample(model, prompts, 1, cfg, decode="compiled",
                                                                             **kw)
    results = []
    graphs, _ = count_graphs(lambda: results.append(both()))
    eager, compiled = results[0]
    assert graphs == 1 and torch.equal(compiled, eager), f"\n{compiled}\n{eager}"
    with torch.no_grad():  # in place, inside the decoder (an optimizer step's kind of change, only larger)
        model.model.layers[1].mlp.down_proj.weight.mul_(4.0)
    graphs, _ = count_graphs(lambda: results.append(both()))
    eager2, compiled2 = results[1]
    assert graphs == 0 and torch.equal(compiled2, eager2), f"\n{compiled2}\n{eager2}"
    assert not torch.equal(eager2, eager), "the change should move the greedy tokens"


def test_compile_decode_setting():
    """auto: compiled on CUDA, the dynamic step on the CPU; true/false; anything else is an error naming the words."""
    model = tiny_model("llama")
    cuda, gen = torch.device("cuda"), GenerationConfig
    assert decode_mode(model, gen(), CPU) == "dynamic" and decode_mode(model, gen(), cuda) == "compiled"
    assert decode_mode(model, gen(compile_decode=True), CPU) == "compiled"
    assert decode_mode(model, gen(compile_decode=False), cuda) == "dynamic"
    assert load_config(None, ["compile_decode=true"], check=False).generation.compile_decode is True
    assert load_config(None, ["generation.compile_decode=auto"], check=False).generation.compile_decode == "auto"
    with pytest.raises(ConfigError, match="compile_decode must be one of auto, true, false; got 'yes'"):
        load_config(None, ["compile_decode=yes"], check=False)
    model.config._attn_implementation = "flash_attention_2"  # takes no ready mask: the dynamic step, logged
    assert "flash_attention_2" in static_decode_problem(model)
    assert decode_mode(model, gen(compile_decode=True), cuda) == "dynamic"
    with pytest.raises(ValueError, match="decode='static'.*flash_attention_2"):
        sample(model, [[1, 2]], 1, gen(), eos_ids=[], pad_id=PAD, device=CPU, decode="static")


def test_a_step_that_fails_to_compile_falls_back_to_the_dynamic_step(monkeypatch, caplog):
    """generation.compile_decode must not stop a run where torch.compile cannot compile the step: the rollout
    is sampled with the dynamic step, the reason logged once, and later rollouts skip the attempt."""
    import logging
    import torch._dynamo.exc
    from lowmem_grpo.policy import sampling
    from lowmem_grpo.policy.rollout import generate as rollout_generate
    calls = []

    def broken(self, *args, **kwargs):
        calls.append(1)
        raise torch._dynamo.exc.TorchDynamoException("no backend for this step")
    monkeypatch.setattr(StaticKV, "__call__", broken)
    monkeypatch.setattr(sampling, "_compile_failures", [])
    model = tiny_model("llama", seed=3)
    prompts = [p for p in random_prompts([3, 6], 64) for _ in range(2)]
    cfg = GenerationConfig(max_completion_length=6, compile_decode=True, **CFG)
    kw = dict(eos_ids=[], pad_id=PAD, device=CPU, greedy=True)
    plain = rollout_generate(model, prompts, dataclasses.replace(cfg, compile_decode=False), **kw).completion_ids
    with caplog.at_level(logging.WARNING, logger="lowmem_grpo.policy.sampling"):
        first = rollout_generate(model, prompts, cfg, **kw).completion_ids
        second = rollout_generate(model, prompts, cfg, **kw).completion_ids
    assert torch.equal(first, plain) and torch.equal(second, plain)
    assert len(calls) == 1 and decode_mode(model, cfg, CPU) == "dynamic"
    assert sum("compiled decode step failed" in r.getMessage() for r in caplog.records) == 1


def test_compiled_step_reads_each_kv_head_without_copies(monkeypatch):
    """The compiled step's graph holds no tensor with a K/V head per query head: transformers' sdpa path
    repeats the cache heads / kv_heads times under torch.compile (repeat_kv), the grouped attention does
    not. And its tokens stay the eager static step's."""
    shapes = []

    def recording(gm, example_inputs):  # a dynamo backend that keeps the traced shapes and runs the graph
        shapes.extend(tuple(n.meta["example_value"].shape) for n in gm.graph.nodes
                      if isinstance(n.meta.get("example_value"), torch.Tensor))
        return gm.forward
    monkeypatch.setattr(static_decode, "COMPILE_BACKEND", recording)
    torch._dynamo.reset()
    model = tiny_model("qwen2", seed=17)  # 4 query heads, 2 K/V heads
    assert model.config._attn_implementation == "sdpa"
    cfg = GenerationConfig(max_completion_length=6, generation_micro_batch_size=2, **CFG)
    prompts = random_prompts([5, 3], 64, seed=18)
    kw = dict(eos_ids=[], pad_id=PAD, device=CPU, greedy=True)
    compiled = sample(model, prompts, 1, cfg, decode="compiled", **kw)
    assert torch.equal(compiled, sample(model, prompts, 1, cfg, decode="static", **kw))
    assert model.config._attn_implementation == "sdpa"  # restored after each step
    heads, kv_heads, head_dim = 4, 2, 16
    cache = [s for s in shapes if len(s) == 4 and s[:2] == (2, kv_heads) and s[3] == head_dim
             and not isinstance(s[2], int)]
    assert cache, "the cache was not traced, or its length was not dynamic (one graph for all length buckets)"
    length = str(cache[0][2])  # the attended length's symbol
    repeated = [s for s in shapes if len(s) == 4 and s[1] == heads and str(s[2]) == length and s[3] == head_dim]
    assert not repeated, f"K/V heads repeated per query head: {repeated[:3]}"
