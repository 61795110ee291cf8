"""The compact int8 copy of the policy the native engine samples from (policy/compact.py): its layers, what
it shares with the policy, its refresh. The trainer's use of it: tests/training/test_compact_rollouts.py."""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from lowmem_grpo.policy.compact import CompactPolicy, QuantizedLinear

from tests.training.conftest import TINY_LLAMA


def _model(**extra) -> nn.Module:
    torch.manual_seed(0)
    config = AutoConfig.for_model(**{**TINY_LLAMA, "vocab_size": 64, **extra})
    return AutoModelForCausalLM.from_config(config).eval()


def test_a_quantized_layer_is_its_int8_rows_times_their_scales():
    torch.manual_seed(0)
    source = nn.Linear(48, 24, bias=True)
    with torch.no_grad():
        source.weight[3].zero_()  # a zero row: scale 1, codes 0
    layer = QuantizedLinear(source)
    w = source.weight.detach()
    scale = w.abs().amax(1) / 127
    assert layer.qweight.dtype == torch.int8 and int(layer.qweight.abs().max()) == 127
    assert torch.equal(layer.qweight[3], torch.zeros(48, dtype=torch.int8)) and layer.scale[3] == 1
    back = layer.dequantized(torch.float32)
    rows = [i for i in range(24) if i != 3]
    assert torch.all((back - w)[rows].abs() <= scale[rows, None] / 2 + 1e-7)  # round to nearest
    assert torch.equal(back[3], w[3])
    x = torch.randn(5, 48)
    torch.testing.assert_close(layer(x), F.linear(x, back, source.bias), rtol=0, atol=0)
    assert layer.bias is source.bias  # shared, not copied
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the CPU's int8 GEMM, scales on its output
        y = layer(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), F.linear(x, back, source.bias), rtol=0.02, atol=0.02)


def test_the_copy_shares_every_tensor_but_the_decoder_linears_and_none_of_the_hooks():
    model = _model()
    called = []
    model.model.layers[0].register_forward_pre_hook(lambda *a: called.append(1))
    compact = CompactPolicy(model)
    assert compact.model.model.embed_tokens.weight is model.model.embed_tokens.weight
    assert compact.model.lm_head.weight is model.lm_head.weight  # the head stays as it is (tied here)
    assert compact.model.model.norm.weight is model.model.norm.weight
    assert isinstance(compact.model.model.layers[0].self_attn.q_proj, QuantizedLinear)
    assert isinstance(model.model.layers[0].self_attn.q_proj, nn.Linear)  # the policy is untouched
    linears = sum(m.weight.numel() for n, m in model.named_modules() if isinstance(m, nn.Linear) and "layers" in n)
    assert compact.nbytes() == linears + 4 * sum(q.scale.numel() for q in compact.model.modules()
                                                 if isinstance(q, QuantizedLinear))
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        near, exact = compact.model(ids).logits, model(ids).logits
    assert called == [1]  # the policy's own forward only
    assert 0 < (near - exact).abs().max() < 0.05 * exact.abs().max()


def test_refresh_quantizes_the_current_weights():
    model = _model()
    compact = CompactPolicy(model)
    layer = compact.model.model.layers[1].mlp.down_proj
    before = layer.qweight.clone()
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(-1)
    assert torch.equal(layer.qweight, before)  # a copy: it moves only when refreshed
    compact.refresh()
    assert torch.equal(layer.qweight, -before)


def test_an_nf4_layer_computes_what_bitsandbytes_own_4bit_layer_does():
    """The same quantization as bitsandbytes' Linear4bit (nf4, blocks of NF4_BLOCK), applied the same way: the
    outputs agree to the rounding of the two GEMMs; the weight itself is within NF4's step of the source."""
    import bitsandbytes as bnb
    from lowmem_grpo.policy.compact import NF4_BLOCK, NF4Linear
    torch.manual_seed(0)
    source = nn.Linear(128, 64, bias=True)
    layer = NF4Linear(source)
    theirs = bnb.nn.Linear4bit(128, 64, bias=True, compute_dtype=torch.float32, quant_type="nf4")
    theirs.weight = bnb.nn.Params4bit(source.weight.detach().clone(), requires_grad=False, quant_type="nf4",
                                      blocksize=NF4_BLOCK, compress_statistics=False)  # (ours: fp32 absmax)
    theirs.bias = nn.Parameter(source.bias.detach().clone())
    theirs = theirs.to("cpu")  # (quantizes on the move)
    x = torch.randn(5, 128)
    torch.testing.assert_close(layer(x), theirs(x), rtol=1e-5, atol=1e-6)
    w = source.weight.detach()
    back = bnb.functional.dequantize_4bit(layer.packed, layer.state)
    blocks = w.reshape(-1, NF4_BLOCK).abs().amax(1, keepdim=True)
    assert torch.all((back - w).reshape(-1, NF4_BLOCK).abs() <= 0.17 * blocks)  # NF4's widest gap / 2 is ~0.16
    assert layer.nbytes() == 128 * 64 // 2 + 128 * 64 // NF4_BLOCK * 4
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(x).dtype == torch.bfloat16
