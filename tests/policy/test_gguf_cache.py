"""The dequantised-GGUF cache: what making it draws from torch's generator (nothing) and what it holds."""

import sys
import types
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lowmem_grpo.config.schema import ModelConfig
from lowmem_grpo.policy import model as model_module


class _Tokenizer:
    def save_pretrained(self, path):
        Path(path, "tokenizer_config.json").write_text("{}")


def test_making_the_cache_leaves_the_seeded_stream_as_finding_it_does(tmp_path, monkeypatch):
    # transformers' GGUF loading is stood in for by a small model: what is under test is the plain copy
    # (its random initial weights, drawn from torch's generator, then overwritten) and the cache folder.
    config = AutoConfig.for_model("llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2)
    quantised = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    monkeypatch.setitem(sys.modules, "gguf", types.ModuleType("gguf"))
    monkeypatch.setattr(model_module.AutoTokenizer, "from_pretrained", lambda *args, **kwargs: _Tokenizer())
    monkeypatch.setattr(model_module.AutoModelForCausalLM, "from_pretrained",
                        lambda *args, **kwargs: quantised)
    (tmp_path / "model.Q4_1.gguf").write_bytes(b"GGUF")
    cfg = ModelConfig(name_or_path=str(tmp_path), gguf_file="model.Q4_1.gguf", cache_dir=str(tmp_path / "cache"))
    draws = []
    for _ in range(2):  # makes the cache, then finds it
        torch.manual_seed(0)
        target = model_module._dequantised_gguf(cfg, str(tmp_path), "model.Q4_1.gguf")
        draws.append(torch.rand(4))
    assert torch.equal(*draws)
    monkeypatch.undo()
    saved = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    for name, tensor in quantised.state_dict().items():
        assert torch.equal(saved.state_dict()[name], tensor), name
