"""Architectures of models people train with lowmem-grpo, as transformers config dicts.

Benchmarks and the memory planner build random-weight models from these: memory and speed do not
depend on weight values, and no hub download is needed. Values are from each model's config.json.

Design notes: docs/planner.md
"""

from __future__ import annotations

# Llama 3.2's RoPE scaling (Llama 3.1's has factor 8): memory does not depend on it, the model's outputs do
LLAMA_3_2_ROPE = dict(rope_type="llama3", factor=32.0, high_freq_factor=4.0, low_freq_factor=1.0,
                      original_max_position_embeddings=8192)

PRESETS: dict[str, dict] = {
    "Qwen2.5-0.5B": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                         tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645, pad_token_id=151643),
    "Qwen2.5-1.5B": dict(model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                         tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645, pad_token_id=151643),
    "Qwen2.5-3B": dict(model_type="qwen2", vocab_size=151936, hidden_size=2048, intermediate_size=11008,
                       num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                       max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645, pad_token_id=151643),
    "Qwen2.5-7B": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645, pad_token_id=151643),
    "Qwen3-0.6B": dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645),
    "Qwen3-1.7B": dict(model_type="qwen3", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645),
    "Qwen3-4B": dict(model_type="qwen3", vocab_size=151936, hidden_size=2560, intermediate_size=9728,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                     tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645),
    "Qwen3-8B": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                     tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645),
    "Llama-3.2-1B": dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                         rope_scaling=LLAMA_3_2_ROPE, tie_word_embeddings=True, bos_token_id=128000,
                         eos_token_id=128009),
    "Llama-3.2-3B": dict(model_type="llama", vocab_size=128256, hidden_size=3072, intermediate_size=8192,
                         num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8, head_dim=128,
                         max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                         rope_scaling=LLAMA_3_2_ROPE, tie_word_embeddings=True, bos_token_id=128000,
                         eos_token_id=128009),
    "Llama-3.1-8B": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                         rope_scaling={**LLAMA_3_2_ROPE, "factor": 8.0}, tie_word_embeddings=False,
                         bos_token_id=128000, eos_token_id=128009),
    # the text-only 1B (Gemma3ForCausalLM); sliding-window layers with a global one every sixth
    "Gemma-3-1B": dict(model_type="gemma3_text", vocab_size=262144, hidden_size=1152, intermediate_size=6912,
                       num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                       max_position_embeddings=32768, rope_theta=1000000.0, rope_local_base_freq=10000.0,
                       rope_scaling=None, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh",
                       query_pre_attn_scalar=256, sliding_window=512, sliding_window_pattern=6,
                       attn_logit_softcapping=None, final_logit_softcapping=None, tie_word_embeddings=True,
                       bos_token_id=2, eos_token_id=[1, 106], pad_token_id=0),
    "SmolLM2-135M": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2),
    "SmolLM2-360M": dict(model_type="llama", vocab_size=49152, hidden_size=960, intermediate_size=2560,
                         num_hidden_layers=32, num_attention_heads=15, num_key_value_heads=5, head_dim=64,
                         max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2),
    "SmolLM2-1.7B": dict(model_type="llama", vocab_size=49152, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=32, head_dim=64,
                         max_position_embeddings=8192, rope_theta=130000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2),
}


def preset(name: str) -> dict:
    """A preset by short name ('Qwen2.5-1.5B') or hub id ('Qwen/Qwen2.5-1.5B-Instruct', 'google/gemma-3-1b-it'),
    case-insensitive: an instruction-tuned model has its base model's architecture."""
    key = name.split("/")[-1].lower().removesuffix("-instruct").removesuffix("-it")
    for k, v in PRESETS.items():
        if k.lower() == key:
            return dict(v)
    raise KeyError(f"no preset {name!r}; known: {', '.join(PRESETS)}")
