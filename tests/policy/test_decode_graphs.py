"""The compiled decode step's CUDA graphs, owned by the rollout (policy/decode_graphs.py).

On the CPU the recorder is replaced by one that keeps the captured closure and replays it by calling it
again on the same static buffers: a CUDA graph's contract (nothing runs at capture; a replay reads the
inputs that are in the static buffers then and writes the static output), so the bookkeeping (copy in,
capture once per bucket, replay, reset at the rollout's end) is checked token for token against the eager
static step. The cuda tests run the real capture on a GPU.
"""

import dataclasses
import gc

import pytest
import torch

from lowmem_grpo.config import GenerationConfig
from lowmem_grpo.policy import decode_graphs, decode_slots, sampling, static_decode
from lowmem_grpo.policy.decode_graphs import StepGraphs, live_graphs
from lowmem_grpo.policy.sampling import SamplingStats, sample
from lowmem_grpo.policy.static_decode import StaticKV

from .test_sampling import CPU, PAD, frequent_token, random_prompts, tiny_model
from .test_static_decode import count_graphs


@pytest.fixture(autouse=True)
def sdpa_in_the_eager_step(monkeypatch):
    """The compiled step traces sdpa; the eager step's CPU attention kernel (decode_attention.py) rounds
    otherwise, which under bf16 autocast flips greedy ties of the tiny models: the eager step these tests
    compare the graphs with runs sdpa too."""
    monkeypatch.setattr(decode_slots, "cpu_decode_attention", lambda *args: None)


class ReplayingRecorder:
    """Records `fn` without running it; a replay calls it again (as a CUDA graph reruns its kernels on the
    addresses it was captured with: the same buffer objects here)."""

    def __init__(self, fail: bool = False):
        self.graphs, self.fail = [], fail

    def record(self, fn):
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.graphs.append(_Replay(fn))
        return self.graphs[-1]


class _Replay:
    def __init__(self, fn):
        self.fn, self.replays = fn, 0

    def replay(self):
        assert self.fn is not None, "replayed after reset"
        self.fn()
        self.replays += 1

    def reset(self):
        self.fn = None


@pytest.fixture
def recorders(monkeypatch):
    """Every rollout's recorder (CPU, replaying), in order; the compiled step traced with dynamo's eager
    backend."""
    made = []
    monkeypatch.setattr(static_decode, "COMPILE_BACKEND", "eager")
    monkeypatch.setattr(static_decode, "GRAPH_RECORDER",
                        lambda device: made.append(ReplayingRecorder()) or made[-1])
    torch._dynamo.reset()
    return made


def _spy_graphs(monkeypatch) -> list[StepGraphs]:
    """Each rollout's StepGraphs, kept when the rollout resets them."""
    seen = []
    reset = StepGraphs.reset
    monkeypatch.setattr(StepGraphs, "reset", lambda self: (seen.append(self), reset(self))[1])
    return seen


@pytest.mark.parametrize("arch, G, micro_batch, read_every, autocast_bf16", [
    ("qwen2", 3, 8, None, False), ("llama", 6, 4, 3, False), ("qwen2", 6, 4, 3, True)])
def test_graphed_steps_replay_their_capture_and_match_the_eager_step(recorders, monkeypatch, arch, G,
                                                                     micro_batch, read_every, autocast_bf16):
    """Token for token with the eager static step, through refills, compactions and (read_every 3) finished
    rows decoding past their end: each bucket's first step runs as is and is captured, every later one
    replays it with the step's ids and positions copied into the static buffers (under autocast, with the
    bf16 weight copies it was captured with)."""
    steps = _spy_graphs(monkeypatch)
    model = tiny_model(arch, seed=5)
    distinct = random_prompts([3, 7, 5, 9, 4, 6], 64, seed=6)
    cfg = GenerationConfig(max_completion_length=20, generation_micro_batch_size=micro_batch,
                           max_prompt_length=16)
    eos = frequent_token(model, distinct, cfg)
    kw = dict(eos_ids=[eos], pad_id=PAD, device=CPU, greedy=True, read_every=read_every,
              autocast_bf16=autocast_bf16)
    stats = SamplingStats()
    graphed = sample(model, distinct, G, cfg, decode="compiled", stats=stats, **kw)
    eager = sample(model, distinct, G, cfg, decode="static", **kw)
    assert torch.equal(graphed, eager), f"\n{graphed}\n{eager}"
    assert stats.refills > 0 and (stats.compactions > 0 or micro_batch == 4)
    (graphs,) = steps
    assert graphs.recorded == len(recorders[0].graphs) > 1 and graphs.replays > graphs.recorded
    assert graphs.recorded + graphs.replays == stats.decode_steps  # every step: a capture or a replay
    assert sum(g.replays for g in recorders[0].graphs) == graphs.replays
    assert all(g.fn is None for g in recorders[0].graphs) and live_graphs() == 0  # reset at the rollout's end


def test_graphs_do_not_pile_up_over_rollouts(recorders, monkeypatch):
    """Five rollouts: each captures the buckets it meets, once each, and resets them all when it ends, so
    after five rollouts as many graphs live (none) as after one, and the compiled step is compiled only in
    the first. Nothing of the graphs stays: their static buffers go with them."""
    steps = _spy_graphs(monkeypatch)
    model = tiny_model("qwen2", seed=7)
    distinct = random_prompts([3, 6, 2, 5], 64, seed=8)
    cfg = GenerationConfig(max_completion_length=12, generation_micro_batch_size=4, max_prompt_length=8)
    kw = dict(eos_ids=[frequent_token(model, distinct, cfg)], pad_id=PAD, device=CPU, greedy=True)
    live, outs = [], []
    for i in range(5):
        graphs, _ = count_graphs(lambda: outs.append(sample(model, distinct, 3, cfg, decode="compiled",
                                                            **kw)))
        live.append(live_graphs())
        assert (graphs > 0) == (i == 0), f"rollout {i} compiled {graphs} graphs"
    assert live == [0] * 5 and all(torch.equal(o, outs[0]) for o in outs)
    assert len({s.recorded for s in steps}) == 1 and steps[0].recorded > 1  # the same buckets, captured anew
    assert all(s.out is None and not s.graphs for s in steps)


def test_a_failed_capture_falls_back_to_the_dynamic_step(monkeypatch, caplog):
    """A capture that raises (here a RuntimeError, as CUDA raises it) becomes a GraphCaptureError, which falls
    back to the dynamic step even after compiled rollouts have succeeded (a bucket first met later is
    captured then); the tokens are the dynamic step's and the reason is logged once."""
    import logging

    from lowmem_grpo.policy.rollout import generate
    monkeypatch.setattr(static_decode, "COMPILE_BACKEND", "eager")
    monkeypatch.setattr(static_decode, "GRAPH_RECORDER", lambda device: ReplayingRecorder(fail=True))
    monkeypatch.setattr(sampling, "_compile_failures", [])
    monkeypatch.setattr(sampling, "_compiled_rollouts", 3)
    torch._dynamo.reset()
    model = tiny_model("llama", seed=3)
    prompts = [p for p in random_prompts([3, 6], 64) for _ in range(2)]
    cfg = GenerationConfig(max_completion_length=6, compile_decode=True, max_prompt_length=8)
    kw = dict(eos_ids=[], pad_id=PAD, device=CPU, greedy=True)
    plain = generate(model, prompts, dataclasses.replace(cfg, compile_decode=False), **kw).completion_ids
    with caplog.at_level(logging.WARNING, logger="lowmem_grpo.policy.sampling"):
        assert torch.equal(generate(model, prompts, cfg, **kw).completion_ids, plain)
    logged = [r.getMessage() for r in caplog.records if "compile_decode" in r.getMessage()]
    assert len(logged) == 1 and "GraphCaptureError" in logged[0] and "stream is capturing" in logged[0]
    assert live_graphs() == 0


# ---- on a GPU: real captures ---------------------------------------------------------------------------


def _near_best(model32, prompt: list[int], prefix: list[int], token: int) -> bool:
    """Whether `token` scores within bf16 rounding of the best token after prompt + prefix, by the model in
    fp32: a bf16 run may pick it. (The graphed step's token is judged, not the eager one's: eager bf16 rounds
    every intermediate and can itself leave the fp32 order.)"""
    ids = torch.tensor([prompt + prefix], device=next(model32.parameters()).device)
    with torch.no_grad():
        logits = model32(ids).logits[0, -1].float()  # (V,)
    top = logits.max()
    return bool(top - logits[token] <= 0.02 * top.abs() + 0.02)


def test_the_bf16_check_judges_the_graphed_token_by_the_fp32_model_not_by_eager_bf16():
    """The case an H200 met (the model with a weight x4, row 16 at token 6): eager bf16 picks the fp32 model's
    second token, 0.155 below its best (more than bf16 rounding of the best), the graphed step the best."""
    model32 = tiny_model("qwen2", seed=21)
    model16 = tiny_model("qwen2", seed=21).to(torch.bfloat16)
    prompt, prefix = [38, 8, 55, 43], [54, 0, 42, 48, 7, 56]
    with torch.no_grad():
        for m in (model32, model16):
            m.model.layers[1].mlp.down_proj.weight.mul_(4.0)
        eager = model16(torch.tensor([prompt + prefix])).logits[0, -1].argmax().item()
        best = model32(torch.tensor([prompt + prefix])).logits[0, -1].argmax().item()
    assert (best, eager) == (19, 10)
    assert _near_best(model32, prompt, prefix, best) and not _near_best(model32, prompt, prefix, eager)
    assert not _near_best(model32, prompt, prefix, 55)  # the fourth: 0.51 below


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graphed_step_matches_eager_on_cuda(dtype, monkeypatch):
    """The captured step on the GPU: greedy tokens of the eager static step and of generate() through refills
    and compactions (fp32: equal; bf16: a row may part from the eager one only where the graphed token is
    near-best by the fp32 model, since Inductor rounds bf16 intermediates otherwise, and a refilled row's first
    token comes from the compiled step). Five rollouts (a weight changed in place after the first): each
    captures its buckets once and resets them, so as many graphs live after five as after one (none), device
    memory returns to where it was, torch's cudagraph trees are unused, and compilations stay one per batch
    bucket (guard failures, if any, are in the message)."""
    from torch._dynamo.utils import counters
    from torch._inductor import cudagraph_trees

    from lowmem_grpo.policy.rollout import generate as rollout_generate
    torch._dynamo.reset()
    steps = _spy_graphs(monkeypatch)
    batches = set()  # the batch buckets the compiled step has met
    views = StaticKV.bucket_views
    monkeypatch.setattr(StaticKV, "bucket_views", lambda self, B, L: (
        self.compiled and batches.add(B)) or views(self, B, L))
    cuda = torch.device("cuda")
    model32 = tiny_model("qwen2", seed=21).to(cuda)
    model = tiny_model("qwen2", seed=21).to(cuda, dtype)
    distinct = random_prompts([3, 7, 5, 9, 4, 6], 64, seed=22)
    G = 4
    cfg = GenerationConfig(max_completion_length=24, generation_micro_batch_size=8, max_prompt_length=16)
    kw = dict(eos_ids=[], pad_id=PAD, device=cuda, greedy=True)
    plain = dataclasses.replace(cfg, fast_rollout=False)
    free = rollout_generate(model, distinct, plain, **kw).completion_ids
    from collections import Counter  # an EOS among the common greedy tokens: rows end at different steps
    for token, _ in Counter(free.flatten().tolist()).most_common(8):  # the first whose eager rollout refills
        probe = SamplingStats()  # and compacts (which token does depends on the device's arithmetic)
        sample(model, distinct, G, cfg, decode="static", stats=probe, **{**kw, "eos_ids": [token]})
        if probe.refills and probe.compactions:
            kw["eos_ids"] = [token]
            break
    assert kw["eos_ids"], "no common greedy token makes the rollout refill and compact"
    prompts = [p for p in distinct for _ in range(G)]
    skips = counters["inductor"]["cudagraph_skips"]
    failures = getattr(torch._dynamo.utils, "guard_failures", {})  # why dynamo recompiled, if it did

    def rollout():
        stats = SamplingStats()
        out = sample(model, distinct, G, cfg, decode="compiled", stats=stats, **kw)
        torch.cuda.synchronize()
        gc.collect()  # (the rollout's objects, cycles included)
        return out, stats, live_graphs(), torch.cuda.memory_allocated()

    def assert_matches(graphed, eager):
        if dtype == torch.float32:
            assert torch.equal(graphed, eager), f"\n{graphed}\n{eager}"
            return
        for row, (g, e) in enumerate(zip(graphed.tolist(), eager.tolist())):
            t = next((i for i, (x, y) in enumerate(zip(g, e)) if x != y), None)
            assert t is None or _near_best(model32, prompts[row], e[:t], g[t]), (row, t, g, e)

    compiled = []
    graphs, breaks = count_graphs(lambda: compiled.append(rollout()))
    graphed, stats, live, allocated = compiled[0]
    assert_matches(graphed, sample(model, distinct, G, cfg, decode="static", **kw))
    assert_matches(graphed, rollout_generate(model, prompts, plain, **kw).completion_ids)
    assert stats.refills > 0 and stats.compactions > 0 and steps[-1].replays > steps[-1].recorded > 1
    assert not breaks and 1 <= graphs <= len(batches), (graphs, sorted(batches), dict(failures))
    seen = set(batches)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(4.0)
        model32.model.layers[1].mlp.down_proj.weight.mul_(4.0)
    graphs, _ = count_graphs(lambda: [compiled.append(rollout()) for _ in range(4)])
    assert graphs <= len(batches - seen), (graphs, sorted(seen), sorted(batches), dict(failures))
    assert not torch.equal(compiled[1][0], graphed)  # the changed weight is seen
    assert_matches(compiled[1][0], sample(model, distinct, G, cfg, decode="static", **kw))
    assert all(torch.equal(c[0], compiled[1][0]) for c in compiled[2:])
    assert [c[2] for c in compiled] == [0] * 5  # as many graphs live after five rollouts as after one: none
    assert [c[3] for c in compiled[2:]] == [compiled[1][3]] * 3  # no memory kept from rollout to rollout
    assert len({s.recorded for s in steps[1:]}) == 1
    container = cudagraph_trees.get_container(cuda.index or 0)
    assert container.tree_manager is None or not any(container.tree_manager.roots.values())
    assert counters["inductor"]["cudagraph_skips"] == skips
    assert decode_graphs.live_graphs() == 0
