"""benchmarks/decode_profile.py's op census: a decode step's dispatcher ops, counted apart from the prefill's."""

import pytest
import torch

from lowmem_grpo.policy.decode_slots import cache_argument, returned_cache
from tests.benchmark_scripts import load_benchmark
from tests.policy.test_sampling import tiny_model


@pytest.fixture(scope="module")
def dp():
    return load_benchmark("decode_profile")


@torch.no_grad()
def test_op_census_counts_decode_forwards_apart_from_the_prefill(dp):
    model = tiny_model("llama")
    vocab = model.config.vocab_size
    layers = model.config.num_hidden_layers

    def rollout():
        out = model(input_ids=torch.randint(0, vocab, (2, 5)), use_cache=True)  # the prefill: counted outside
        cache = returned_cache(out)
        for step in range(3):  # three decode steps of one column each
            out = model(input_ids=torch.randint(0, vocab, (2, 1)), use_cache=True,
                        position_ids=torch.full((2, 1), 5 + step), **{cache_argument(model): cache})
            cache = returned_cache(out)

    census = dp.op_census(rollout, model)
    assert census["steps"] == 3
    assert census["by_name"]["mm"] == 7 * layers + 1  # q, k, v, o, gate, up, down per layer and the head
    assert census["by_kind"]["gemm"] == census["by_name"]["mm"]
    assert census["by_name"]["silu"] == layers and census["by_name"]["rsqrt"] == 2 * layers + 1
    assert census["per_step"] == pytest.approx(sum(census["by_kind"].values()))
    assert census["per_layer"] == pytest.approx(census["per_step"] / layers)
    assert census["outside_forward_per_step"] * 3 >= census["per_step"]  # the prefill's forward: about a step's ops
