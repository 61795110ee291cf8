"""The KV-cache layer that appends in place (policy/kv_columns.py) against transformers' DynamicLayer.

Both layers take the same updates and the same edits (leading columns trimmed, rows written in place,
rows selected, columns added at the left); their keys and values must be equal after every one. The
buffers must be reused while the edits allow it, released when they do not, and a rollout must sample the
same tokens with the layer as with transformers' own.
"""

import gc
import weakref

import torch
from transformers.cache_utils import DynamicLayer

from lowmem_grpo.config import GenerationConfig
from lowmem_grpo.policy import decode_slots
from lowmem_grpo.policy.decode_slots import new_cache
from lowmem_grpo.policy.kv_columns import ColumnsLayer, columns_cache
from lowmem_grpo.policy.sampling import SamplingStats, sample

from .test_sampling import CPU, PAD, frequent_token, random_prompts, tiny_model


def kv(rows, columns, seed, heads=2, dim=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, heads, columns, dim, generator=g), torch.randn(rows, heads, columns, dim, generator=g)


def same(a, b):
    assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def edit(layers, keys_of, values_of):
    """The same edit of both layers: ColumnsLayer through set, DynamicLayer by assignment (as Slots does)."""
    for layer in layers:
        k, v = keys_of(layer.keys), values_of(layer.values)
        if isinstance(layer, ColumnsLayer):
            layer.set(k, v)
        else:
            layer.keys, layer.values = k, v


def test_equal_to_dynamic_layer_through_updates_and_edits():
    ours, theirs = ColumnsLayer(capacity=12), DynamicLayer()
    step = iter(range(100))
    layers = (ours, theirs)

    def update(rows, columns=1):
        k, v = kv(rows, columns, next(step))
        for layer in layers:
            out = layer.update(k, v)
            assert out[0] is layer.keys and out[1] is layer.values
        same(ours, theirs)

    update(3, 5)  # the first update (a prefill), then decode steps
    for _ in range(3):
        update(3)
    buffer = ours.key_buffer
    assert buffer is not None and ours.keys._base is buffer and buffer.shape[2] == 12
    edit(layers, lambda k: k[:, :, 2:], lambda v: v[:, :, 2:])  # leading columns trimmed: still appending
    assert ours.key_buffer is buffer
    update(3)
    for layer in layers:  # a row written in place (a refill's prefix)
        layer.keys[1] = 0
        layer.values[1, :, 3:] = 7
    assert ours.key_buffer is buffer
    for _ in range(4):  # the buffer runs out (filled 12 of 12, 2 trimmed): a new one, the view at its start
        update(3)
    assert ours.key_buffer is not buffer and ours.keys.storage_offset() == 0
    edit(layers, lambda k: k[[0, 2]], lambda v: v[[0, 2]])  # rows selected
    assert ours.key_buffer is None
    update(2)
    edit(layers, lambda k: torch.cat([k.new_zeros(2, 2, 3, 4), k], 2), lambda v: torch.cat([v.new_zeros(2, 2, 3, 4), v], 2))
    update(2)
    update(2, 3)
    assert ours.keys.shape == (2, 2, 19, 4) and ours.key_buffer.shape[2] == 16 + 16 // 4


def test_appends_without_copying_the_cache():
    layer = ColumnsLayer(capacity=40)
    layer.update(*kv(2, 8, 0))
    layer.update(*kv(2, 1, 1))  # the buffers are made here
    buffer, pointer = layer.key_buffer, layer.key_buffer.data_ptr()
    for seed in range(2, 30):
        k, v = kv(2, 1, seed)
        layer.update(k, v)
        assert layer.key_buffer is buffer and layer.keys.data_ptr() == pointer
        assert torch.equal(layer.keys[:, :, -1:], k) and torch.equal(layer.values[:, :, -1:], v)
    assert layer.keys.shape[2] == 37 and layer.filled == 37


def test_set_releases_the_buffers():
    layer = ColumnsLayer(capacity=64)
    layer.update(*kv(4, 6, 0))
    layer.update(*kv(4, 1, 1))
    gone = weakref.ref(layer.key_buffer)
    layer.set(layer.keys[[1, 3]].clone(), layer.values[[1, 3]].clone())
    gc.collect()
    assert layer.key_buffer is None and gone() is None  # not held until the next update


def test_mixed_dtypes_as_under_autocast():
    """Under bf16 autocast the cache holds fp32 keys beside bf16 values: each buffer keeps the dtype
    transformers' layer gives that tensor."""
    ours, theirs = ColumnsLayer(capacity=10), DynamicLayer()
    for seed, columns in ((0, 4), (1, 1), (2, 1)):
        k, v = kv(2, columns, seed)
        for layer in (ours, theirs):
            layer.update(k, v.bfloat16())
    same(ours, theirs)  # (transformers 4.x's layer promotes the values to the keys' fp32; 5.x keeps bf16)
    assert ours.key_buffer.dtype == theirs.keys.dtype and ours.value_buffer.dtype == theirs.values.dtype


def test_columns_cache_replaces_the_empty_layers():
    model = tiny_model("llama", seed=1)
    cache = columns_cache(new_cache(model), 33)
    cache.update(*kv(1, 2, 0), 0)
    assert len(cache.layers) >= 1
    assert all(type(layer) is ColumnsLayer and layer.capacity == 33 for layer in cache.layers)


def test_rollout_samples_the_same_tokens(monkeypatch):
    """Sampled and greedy rollouts with refills and compactions: the same tokens as with DynamicLayer."""
    model = tiny_model("llama", seed=3)
    distinct = random_prompts([3, 7, 5, 9, 4], 64, seed=4)
    cfg = GenerationConfig(max_completion_length=16, generation_micro_batch_size=8)
    eos = frequent_token(model, distinct, cfg)
    runs = {}
    for columns in (True, False):
        if not columns:
            monkeypatch.setattr(decode_slots, "columns_cache", lambda cache, capacity: cache)
        for greedy in (True, False):
            stats = SamplingStats()
            torch.manual_seed(0)
            runs[columns, greedy] = sample(model, distinct, 8, cfg, eos_ids=[eos], pad_id=PAD, device=CPU,
                                           stats=stats, greedy=greedy)
            assert greedy or (stats.refills > 0 and stats.compactions > 0)  # greedy: a prompt's rows end together
    for greedy in (True, False):
        assert torch.equal(runs[True, greedy], runs[False, greedy])
