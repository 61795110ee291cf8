"""policy/sampling.py against transformers' generate(): greedy token for token, sampling in distribution.

Models are tiny random Llama / Qwen2 decoders with untied, wide-initialised heads (initializer_range
0.2), so logits are spread out (a near-uniform random model would hide an ignored temperature) and
greedy choices are not near-ties that batch-shape rounding could flip.
"""

import dataclasses
import logging
import math
from collections import Counter

import pytest
import torch

from lowmem_grpo.config import GenerationConfig
from lowmem_grpo.policy.batch import Batch, eos_mask, left_pad
from lowmem_grpo.policy.rollout import generate
from lowmem_grpo.policy.sampling import (DRAW_BLOCK, SamplingStats, draw, fast_sampling_problem, group_runs,
                                         repetition_penalty_problem, sample)

CPU = torch.device("cpu")
PAD = 0


def tiny_model(arch: str, vocab: int = 64, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    kw = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
              initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=PAD)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**kw)) if arch == "llama" else Qwen2ForCausalLM(Qwen2Config(**kw))
    return model.eval()


def random_prompts(lengths, vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]  # no pad id inside


def both_paths(model, prompts, cfg, **kw):
    slow = generate(model, prompts, dataclasses.replace(cfg, fast_rollout=False), device=CPU, **kw)
    fast = generate(model, prompts, dataclasses.replace(cfg, fast_rollout=True), device=CPU, **kw)
    return slow, fast


def assert_same_batch(a, b):
    for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "is_truncated"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.shape == y.shape and torch.equal(x, y), f"{name} differs:\n{x}\n{y}"


def frequent_token(model, prompts, cfg) -> int:
    """An EOS id the greedy model emits at varying depths: the second most common greedy token."""
    free = generate(model, prompts, dataclasses.replace(cfg, fast_rollout=False), eos_ids=[], pad_id=PAD,
                    device=CPU, greedy=True)
    return Counter(free.completion_ids.flatten().tolist()).most_common(2)[1][0]


# ---- greedy: token for token ----------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("autocast_bf16", [False, True])
@pytest.mark.parametrize("G, micro_batch", [(3, 8), (6, 4)])  # whole prompts per micro-batch; split prompts
def test_greedy_matches_generate(arch, autocast_bf16, G, micro_batch):
    model = tiny_model(arch)
    distinct = random_prompts([3, 7, 5, 9, 4, 6], 64)  # left padding of 0..6 tokens
    prompts = [p for p in distinct for _ in range(G)]
    cfg = GenerationConfig(max_completion_length=20, generation_micro_batch_size=micro_batch)
    eos = frequent_token(model, distinct, cfg)
    kw = dict(eos_ids=[eos], pad_id=PAD, greedy=True, autocast_bf16=autocast_bf16)
    slow, fast = both_paths(model, prompts, cfg, **kw)
    assert_same_batch(slow, fast)
    lengths = fast.completion_mask.sum(1)
    assert lengths.min() < lengths.max() and (~fast.is_truncated).any()  # rows end at different steps

    stats = SamplingStats()
    sample(model, distinct, G, cfg, eos_ids=[eos], pad_id=PAD, device=CPU, greedy=True,
           autocast_bf16=autocast_bf16, stats=stats)
    assert stats.refills > 0, "prompts' rows finished at different steps while others waited: slots were refilled"
    assert stats.compactions > 0, "rows finished at different steps, so the batch must have been compacted"
    assert stats.prefill_rows == len(distinct)  # a prompt split over refills is still prefilled once
    assert stats.generated_tokens == int(lengths.sum())
    # finished rows stopped costing compute: fewer row-steps than every row decoding to the longest
    assert stats.decode_row_steps < len(prompts) * (fast.completion_ids.shape[1] - 1)


@pytest.mark.parametrize("implementation, grouped", [("sdpa", True), ("eager", False)])
def test_dynamic_decode_steps_attend_grouped_under_sdpa(implementation, grouped, monkeypatch):
    """Under sdpa the dynamic step's attention is grouped_decode_attention (one call per layer and decode step,
    no copy of a K/V head per query head) and greedy rows still equal generate()'s; eager attention is left
    as the model runs it."""
    from lowmem_grpo.policy import decode_slots
    calls = []
    real = decode_slots.grouped_decode_attention
    monkeypatch.setattr(decode_slots, "grouped_decode_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = tiny_model("qwen2")
    model.config._attn_implementation = implementation
    distinct = random_prompts([3, 7, 5], 64)
    cfg = GenerationConfig(max_completion_length=12, generation_micro_batch_size=8)
    eos = frequent_token(model, distinct, cfg)
    slow, fast = both_paths(model, [p for p in distinct for _ in range(3)], cfg, eos_ids=[eos], pad_id=PAD,
                            greedy=True)
    assert_same_batch(slow, fast)
    stats = SamplingStats()
    calls.clear()
    sample(model, distinct, 3, cfg, eos_ids=[eos], pad_id=PAD, device=CPU, greedy=True, stats=stats)
    assert len(calls) == (stats.decode_steps * model.config.num_hidden_layers if grouped else 0)
    assert stats.decode_steps > 0 and model.config._attn_implementation == implementation


def test_greedy_takes_model_generation_config_like_generate():
    """generate() fills settings left unset (greedy sets no repetition penalty) from the model's own
    generation_config; the fast path must resolve them the same way."""
    if repetition_penalty_problem():  # older transformers: the fast path hands these to generate()
        pytest.skip(repetition_penalty_problem())
    model = tiny_model("llama")
    model.generation_config.repetition_penalty = 1.5
    distinct = random_prompts([2, 6, 4], 64)
    cfg = GenerationConfig(max_completion_length=16)
    slow, fast = both_paths(model, distinct, cfg, eos_ids=[], pad_id=PAD, greedy=True)
    assert_same_batch(slow, fast)
    model.generation_config.repetition_penalty = 1.0
    plain = generate(model, distinct, cfg, eos_ids=[], pad_id=PAD, device=CPU, greedy=True)
    assert not torch.equal(plain.completion_ids, fast.completion_ids), "the penalty should change greedy output"


def test_unsupported_setting_falls_back_to_generate(caplog):
    model = tiny_model("llama")
    model.generation_config.no_repeat_ngram_size = 2
    cfg = GenerationConfig(max_completion_length=12)
    assert "no_repeat_ngram_size" in fast_sampling_problem(model, cfg, greedy=True)
    prompts = random_prompts([3, 5], 64)
    with pytest.raises(ValueError, match="no_repeat_ngram_size"):
        sample(model, prompts, 1, cfg, eos_ids=[], pad_id=PAD, device=CPU, greedy=True)
    with caplog.at_level(logging.WARNING, logger="lowmem_grpo.policy.sampling"):
        slow, fast = both_paths(model, prompts, cfg, eos_ids=[], pad_id=PAD, greedy=True)
    assert_same_batch(slow, fast)
    assert any("no_repeat_ngram_size" in r.getMessage() for r in caplog.records)


# ---- format -----------------------------------------------------------------------------------


def test_sampled_batch_format_and_max_new_tokens():
    model = tiny_model("qwen2")
    distinct = random_prompts([4, 8, 2], 64)
    G, max_new, eos = 8, 5, [7, 11, 13, 17]  # several EOS ids, some rows end early
    prompts = [p for p in distinct for _ in range(G)]
    torch.manual_seed(0)
    batch = generate(model, prompts, GenerationConfig(max_completion_length=50, generation_micro_batch_size=16),
                     eos_ids=eos, pad_id=PAD, device=CPU, max_new_tokens=max_new)
    N, C = batch.completion_ids.shape
    assert N == len(prompts) and C <= max_new
    is_eos = torch.isin(batch.completion_ids, torch.tensor(eos))
    for row, mask, trunc, e in zip(batch.completion_ids, batch.completion_mask, batch.is_truncated, is_eos):
        n = int(mask.sum())
        assert mask[:n].all() and not mask[n:].any() and (row[n:] == PAD).all()
        assert bool(trunc) == (not e.any()) and (n == max_new if trunc else bool(e[n - 1]) and not e[:n - 1].any())
    assert batch.is_truncated.any() and (~batch.is_truncated).any()
    for i, p in enumerate(distinct):  # the cache copy must not make a prompt's samples the same
        rows = batch.completion_ids[i * G:(i + 1) * G]
        assert len({tuple(r.tolist()) for r in rows}) > 1
        assert (batch.prompt_ids[i * G:(i + 1) * G, -len(p):] == torch.tensor(p)).all()


def test_min_p_zero_is_skipped_and_changes_nothing():
    """generate() runs MinPLogitsWarper at min_p=0 (the explicit "off" sampling_kwargs passes); the fast loop
    skips it, which is exact only while the warper returns its scores unchanged there: checked on scores
    with -inf (a top-k before it), ties and a row of one finite score."""
    from transformers.generation import MinPLogitsWarper

    from lowmem_grpo.policy import sampling
    model = tiny_model("llama")
    names = lambda cfg: [type(p).__name__ for p in sampling._processors(  # noqa: E731
        sampling._resolve(model, cfg, False)[0], torch.zeros(1, dtype=torch.long))]
    assert "MinPLogitsWarper" not in names(GenerationConfig())
    assert "MinPLogitsWarper" in names(GenerationConfig(min_p=0.05))
    scores = torch.randn(4, 300, generator=torch.Generator().manual_seed(0)) * 8
    scores[0, ::3] = -math.inf
    scores[1, 10:20] = scores[1].max() + 1
    scores[2, 1:] = -math.inf
    assert torch.equal(MinPLogitsWarper(0.0)(torch.zeros(4, 1, dtype=torch.long), scores), scores)


def test_group_runs():
    assert group_runs([[1, 2], [1, 2], [3], [1, 2]]) == ([[1, 2], [3], [1, 2]], [2, 1, 1])


# ---- sampling: in distribution -----------------------------------------------------------------

V, N_PER_PROMPT, DELTA = 16, 6000, 1e-6
EOS = 5


def processors(temperature=1.0, top_k=0, top_p=1.0, min_p=None, repetition_penalty=1.0):
    """generate()'s processors for these settings, built by hand in generate()'s order."""
    from transformers.generation import (LogitsProcessorList, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                         TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)
    procs = LogitsProcessorList()
    if repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(repetition_penalty))
    if temperature != 1.0:
        procs.append(TemperatureLogitsWarper(temperature))
    if top_k:
        procs.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        procs.append(TopPLogitsWarper(top_p))
    if min_p:
        procs.append(MinPLogitsWarper(min_p))
    return procs


@torch.no_grad()
def exact_first_two(model, prompt, procs, history_prefix=()) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact distributions of completion token 1 (V,) and token 2 (V + 1,), the last entry "ended at EOS".

    The model sees the prompt unpadded; `procs` see `history_prefix + prompt (+ token 1)` (to model a
    repetition penalty that wrongly counts left padding).
    """
    ids = torch.tensor([prompt])  # (1, P)
    hist = torch.tensor([list(history_prefix) + prompt])  # (1, P')
    p1 = torch.softmax(procs(hist, model(ids).logits[:, -1].float()), -1)[0]  # (V,)
    first = torch.arange(V)[:, None]  # (V, 1): every first token
    logits2 = model(torch.cat([ids.expand(V, -1), first], 1)).logits[:, -1].float()  # (V, V)
    p2_given = torch.softmax(procs(torch.cat([hist.expand(V, -1), first], 1), logits2), -1)  # (V, V)
    cont = p1.clone()
    cont[EOS] = 0
    p2 = torch.cat([cont @ p2_given, p1[EOS:EOS + 1]])  # (V + 1,)
    return p1.double(), p2.double()


def empirical_first_two(batch, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
    ids, mask = batch.completion_ids[rows], batch.completion_mask[rows]
    t2 = torch.where(mask[:, 1], ids[:, 1], torch.full_like(ids[:, 1], V))  # V = "ended at EOS"
    n = ids.shape[0]
    return (torch.bincount(ids[:, 0], minlength=V).double() / n, torch.bincount(t2, minlength=V + 1).double() / n)


def tv(p, q) -> float:
    return 0.5 * (p - q).abs().sum().item()


def tv_tolerance(p, n: int) -> float:
    """TV(empirical of n draws, p) exceeds this with probability <= DELTA: E[TV] <= 1/2 sum_i sqrt(p_i (1 - p_i) / n)
    (Jensen), and TV moves by <= 1/n per draw, so McDiarmid adds sqrt(ln(1/DELTA) / 2n)."""
    return 0.5 * (p * (1 - p) / n).sqrt().sum().item() + math.sqrt(math.log(1 / DELTA) / (2 * n))


def test_draw_matches_the_softmax():
    """The CPU draw (an inverse CDF in blocks) picks each token with its softmax probability: logits spread
    over 12 nats (probabilities from ~0.5 down to ~5e-6) and tokens filtered to -inf, 200,000 draws
    per row, TV within the bound above; filtered tokens never drawn; the draw's randomness is the
    global generator's (same seed, same tokens)."""
    torch.manual_seed(3)
    scores = torch.linspace(0.0, -12.0, V)[torch.randperm(V)].repeat(2, 1)  # (2, V)
    scores[1, scores[1] < -6] = float("-inf")  # row 1: a top-p-like cut
    n = 200_000
    torch.manual_seed(0)
    tokens = draw(scores.repeat_interleave(n, 0)).view(2, n)
    torch.manual_seed(0)
    assert torch.equal(draw(scores.repeat_interleave(n, 0)).view(2, n), tokens)
    for row in range(2):
        p = torch.softmax(scores[row].double(), -1)
        got = torch.bincount(tokens[row], minlength=V).double() / n
        assert tv(got, p) < tv_tolerance(p, n), (row, got, p)
        assert not got[p == 0].any()


SETTINGS = {
    # name: (settings, [(mistake, the settings it samples with, does it penalise left padding)])
    "temperature_top_k_top_p": (dict(temperature=0.6, top_k=10, top_p=0.9),
                                [("temperature ignored", dict(top_k=10, top_p=0.9), False)]),
    "repetition_penalty": (dict(repetition_penalty=2.0),
                           [("penalty ignored", dict(), False),
                            ("left padding penalised", dict(repetition_penalty=2.0), True)]),
    "min_p": (dict(temperature=1.5, min_p=0.1), [("min_p ignored", dict(temperature=1.5), False)]),
}


@pytest.mark.parametrize("micro_batch, decode", [(None, "dynamic"), (1024, "dynamic"), (1024, "static")],
                         ids=["one_batch", "refill", "refill_static"])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_sampled_distribution_matches_generate(name, micro_batch, decode):
    """micro_batch None: every row in one batch, generate() and the fast path checked. 1024: the fast path
    refills slots all along (rows end after 1 or 2 tokens), prompt 1's longer prefix widens the cache
    under prompt 0's rows, and refilled rows sit behind extra left padding: same distribution. static: the
    same with the preallocated cache and bucketed step of policy/static_decode.py (rows without padding)."""
    if "repetition_penalty" in name and repetition_penalty_problem():
        pytest.skip(repetition_penalty_problem())
    settings, mistakes = SETTINGS[name]
    model = tiny_model("llama", vocab=V, seed=9)
    distinct = [[9, 3, 12], [1, 14, 9, 7, 2, 11]]  # one micro-batch: the first is left-padded by 3
    with torch.no_grad():  # pad with the first prompt's likeliest next token, so penalising padding would show
        first = model(torch.tensor([distinct[0]])).logits[0, -1]
    pad = next(t for t in first.argsort(descending=True).tolist() if t != EOS and all(t not in p for p in distinct))
    prefix = [pad] * (len(distinct[1]) - len(distinct[0]))
    prompts = [p for p in distinct for _ in range(N_PER_PROMPT)]
    cfg = GenerationConfig(max_completion_length=2, generation_micro_batch_size=micro_batch or len(prompts),
                           max_prompt_length=len(distinct[1]),
                           **{"temperature": 1.0, "top_k": 0, "top_p": 1.0, **settings})
    kw = dict(eos_ids=[EOS], pad_id=pad, device=CPU)
    torch.manual_seed(0)
    slow = generate(model, prompts, dataclasses.replace(cfg, fast_rollout=False), **kw) if micro_batch is None else None
    torch.manual_seed(1)
    if micro_batch is None:
        fast = generate(model, prompts, cfg, **kw)
    else:
        stats = SamplingStats()
        completions = sample(model, distinct, N_PER_PROMPT, cfg, stats=stats, decode=decode, **kw)
        fast = Batch(*left_pad(prompts, pad), completions, *eos_mask(completions, [EOS]))
        assert stats.refills > 4 * micro_batch and stats.mean_rows_per_step_queued == micro_batch
    power = {m: 0.0 for m, _, _ in mistakes}  # the largest TV(exact, mistaken) / (2 tol) over the comparisons
    for i, prompt in enumerate(distinct):
        rows = slice(i * N_PER_PROMPT, (i + 1) * N_PER_PROMPT)
        exact = exact_first_two(model, prompt, processors(**settings))
        for pos, p in enumerate(exact):
            tol = tv_tolerance(p, N_PER_PROMPT)
            for path, batch in (("generate", slow), ("fast", fast)):
                if batch is None:
                    continue
                got = empirical_first_two(batch, rows)[pos]
                err = tv(got, p)
                assert err <= tol, f"{name}, prompt {i}, token {pos + 1}, {path}: TV {err:.4f} > {tol:.4f}"
        for mistake, wrong, pads in mistakes:
            mistaken = exact_first_two(model, prompt, processors(**wrong), prefix if i == 0 and pads else ())
            for p, q in zip(exact, mistaken):
                power[mistake] = max(power[mistake], tv(p, q) / (2 * tv_tolerance(p, N_PER_PROMPT)))
    # a sampler drawing from a mistaken distribution would fail some comparison with probability >= 1 - DELTA
    assert all(v > 1 for v in power.values()), f"{name}: the test cannot tell these mistakes apart: {power}"


@pytest.mark.parametrize("V", [300, 1024], ids=["short_last_block", "whole_blocks"])
def test_draw_is_the_inverse_cdf(V):
    """The CPU draw picks, for the seeded uniform u of each row, the first token whose running sum of the
    probabilities exceeds u x the row's total: the same tokens, seed for seed, as a one-level float64
    search over every token (the block totals only choose where to look), over rows with -inf runs."""
    scores = torch.randn(6, V) * 3
    scores[:, :7] = float("-inf")
    scores[1, DRAW_BLOCK - 3:2 * DRAW_BLOCK + 5] = float("-inf")  # a whole block that cannot be drawn
    for seed in range(30):
        torch.manual_seed(seed)
        ends = torch.softmax(scores, dim=-1).cumsum(-1, dtype=torch.float64)
        u = torch.rand(6, 1, dtype=torch.float64) * ends[:, -1:]
        expected = torch.searchsorted(ends, u, right=True).squeeze(1)
        torch.manual_seed(seed)
        assert torch.equal(draw(scores), expected), seed


@pytest.mark.parametrize("extreme", [0.0, 1.0 - 2.0 ** -53], ids=["u_0", "u_below_1"])
def test_draw_at_the_ends_of_the_uniform_draws_a_possible_token(extreme, monkeypatch):
    """u = 0 draws each row's first token of probability > 0; the largest uniform below 1 (where u x total
    can round up to the total, and a block's total differs from its running sum in the last bits) draws the
    last: never a filtered token, never past the vocabulary."""
    V = 700  # blocks of 256, 256 and 188
    scores = torch.randn(3, V)
    scores[:, :10] = float("-inf")
    scores[:, -20:] = float("-inf")
    scores[1, 200:600] = float("-inf")
    scores[2, :] = float("-inf")
    scores[2, 300] = 0.0  # one possible token
    real_rand = torch.rand
    monkeypatch.setattr(torch, "rand", lambda *a, **k: real_rand(*a, **k).fill_(extreme))
    tokens = draw(scores)
    columns = torch.arange(V).expand(3, V)
    possible = torch.isfinite(scores)
    first = torch.where(possible, columns, V).min(1).values
    last = torch.where(possible, columns, -1).max(1).values
    assert torch.equal(tokens, first if extreme == 0.0 else last), (tokens, first, last)
