"""What the drop-in tests share: the tiny model they train, and the keywords that make both trainers sample the
same completions."""

import torch


def tiny_qwen2(folder):
    """A tiny random Qwen2 (2 layers, hidden 32, tied embeddings) and the char tokenizer, saved in `folder` once
    (TRL builds its reference model from the path); returns the tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from lowmem_grpo.policy.char_tokenizer import char_tokenizer

    tokenizer = char_tokenizer()
    if not folder.exists():
        torch.manual_seed(0)
        Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                     tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                                     eos_token_id=tokenizer.eos_token_id)).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return tokenizer


def same_rollouts(trainer_cls) -> dict:
    """Constructor keywords for `trainer_cls`: the drop-in samples through TRL's generate() (its native engine
    draws from another random stream), so that its losses and gradients compare with TRL's on the same tokens."""
    return {} if trainer_cls.__module__.startswith("trl") else {"native_generation": False}
