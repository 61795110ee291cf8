"""Continuous refill, the host's stop-flag reads (policy/sampling.py) and the decode step's logits (decode_slots).

Same tiny random models as test_sampling.py; greedy results are compared token for token with
transformers' generate() on the prompts repeated as the trainer repeats them.
"""

from types import SimpleNamespace

import pytest
import torch

from lowmem_grpo.config import GenerationConfig
from lowmem_grpo.policy.decode_slots import last_logits
from lowmem_grpo.policy.rollout import generate
from lowmem_grpo.policy.sampling import SamplingStats, sample

from .test_sampling import CPU, PAD, frequent_token, random_prompts, tiny_model


def generate_completions(model, prompts, cfg, eos):
    """generate()'s greedy completions, right-padded with PAD after EOS: (N, C)."""
    import dataclasses
    batch = generate(model, prompts, dataclasses.replace(cfg, fast_rollout=False), eos_ids=[eos], pad_id=PAD,
                     device=CPU, greedy=True)
    return batch.completion_ids


def test_refill_keeps_the_micro_batch_full():
    """While samples wait, every decode step runs the whole micro-batch (finished slots are refilled at the
    next read); without refill the batch runs ever smaller towards the end of each micro-batch."""
    model = tiny_model("llama", seed=3)
    distinct = random_prompts([3, 7, 5, 9, 4], 64, seed=4)
    cfg = GenerationConfig(max_completion_length=16, generation_micro_batch_size=8)
    eos = frequent_token(model, distinct, cfg)
    runs = {}
    for refill in (True, False):
        stats = SamplingStats()
        torch.manual_seed(0)
        out = sample(model, distinct, 8, cfg, eos_ids=[eos], pad_id=PAD, device=CPU, stats=stats, refill=refill)
        runs[refill] = (out, stats)
        lengths = (out != PAD).sum(1)
        assert out.shape[0] == 40 and lengths.min() < lengths.max()  # sampled rows of a prompt end apart
    on, off = runs[True][1], runs[False][1]
    assert on.refills > 0 and off.refills == 0
    assert on.decode_steps_queued > 0 and on.mean_rows_per_step_queued == 8
    assert off.mean_rows_per_step_queued < 8 and off.micro_batches > on.micro_batches
    assert on.prefill_rows == off.prefill_rows == len(distinct)


def test_refill_edge_cases_match_generate():
    """One-token prompts (no prefix to prefill), a prompt with no samples, uneven counts, a micro-batch that
    splits every prompt's samples over several refills, and later prompts longer than the cache."""
    model = tiny_model("llama", seed=5)
    distinct = random_prompts([1, 6, 2, 1, 11, 4], 64, seed=6)
    counts = [2, 3, 0, 1, 4, 2]
    prompts = [p for p, c in zip(distinct, counts) for _ in range(c)]
    cfg = GenerationConfig(max_completion_length=16, generation_micro_batch_size=3)
    eos = frequent_token(model, distinct, cfg)
    stats = SamplingStats()
    fast = sample(model, distinct, counts, cfg, eos_ids=[eos], pad_id=PAD, device=CPU, greedy=True, stats=stats)
    slow = generate_completions(model, prompts, cfg, eos)
    assert fast.shape == slow.shape and torch.equal(fast, slow), f"\n{fast}\n{slow}"
    assert stats.refills > 0 and stats.prefill_rows == sum(c > 0 for c in counts)


def test_reading_stop_flags_every_k_steps_gives_the_same_tokens():
    """With the host reading the stop flags only every k steps, finished rows decode a few dead steps
    (their tokens go nowhere) and refills come later: the same greedy tokens, k times fewer reads."""
    model, read_every = tiny_model("qwen2", seed=7), 4
    distinct = random_prompts([3, 7, 5, 9, 4, 6], 64, seed=8)
    G = 3
    cfg = GenerationConfig(max_completion_length=20, generation_micro_batch_size=5)
    eos = frequent_token(model, distinct, cfg)
    kw = dict(eos_ids=[eos], pad_id=PAD, device=CPU, greedy=True)
    every, sparse = SamplingStats(), SamplingStats()
    each_step = sample(model, distinct, G, cfg, stats=every, **kw)  # the CPU default: k = 1
    k_steps = sample(model, distinct, G, cfg, stats=sparse, read_every=read_every, **kw)
    slow = generate_completions(model, [p for p in distinct for _ in range(G)], cfg, eos)
    assert torch.equal(each_step, slow) and torch.equal(k_steps, slow)
    # a read after every k samplings; a new batch samples its first tokens from the prefill, not a decode step
    assert every.host_reads == every.decode_steps + every.micro_batches
    assert sparse.host_reads * read_every == sparse.decode_steps + sparse.micro_batches
    assert sparse.host_reads < every.host_reads and sparse.refills > 0
    assert sparse.decode_row_steps > every.decode_row_steps  # the dead steps between reads
    with pytest.raises(ValueError, match="read_every"):
        sample(model, distinct, G, cfg, read_every=0, **kw)


def test_last_logits_are_the_forwards_own_when_they_are_its_fp32_last_column():
    """A decode step's (B, 1, V) fp32 logits are returned as they are (no copy of B x V per step); a longer
    forward's last column is copied (so the whole (B, L, V) tensor can go), and bf16 logits come back fp32."""
    one = torch.randn(4, 1, 32)
    out = last_logits(SimpleNamespace(logits=one))
    assert out.shape == (4, 32) and out.data_ptr() == one.data_ptr()
    many = torch.randn(4, 5, 32)
    out = last_logits(SimpleNamespace(logits=many))
    assert torch.equal(out, many[:, -1]) and out.untyped_storage().nbytes() == 4 * 32 * 4
    low = torch.randn(4, 1, 32, dtype=torch.bfloat16)
    out = last_logits(SimpleNamespace(logits=low))
    assert out.dtype == torch.float32 and torch.equal(out, low[:, 0].float())
