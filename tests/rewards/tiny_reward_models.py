"""Tiny sequence-classification reward models for the tests, over the character tokenizer.

`random_reward_model` saves a random one; `e_reward_model` trains one on the CPU (a few seconds) to score
a text by how many of its characters are the letter `e`, so a policy that writes more `e`s scores higher.
The tokenizer is saved in a folder of its own: next to a Qwen2 config.json, AutoTokenizer would load it
as Qwen2's tokenizer class, which splits text differently.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from lowmem_grpo.policy.char_tokenizer import CHARACTERS, char_tokenizer


def _model(tokenizer, seed: int, layers: int = 2):
    from transformers import Qwen2Config, Qwen2ForSequenceClassification
    torch.manual_seed(seed)
    return Qwen2ForSequenceClassification(Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, num_labels=1, max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id))


def save(model, tokenizer, folder: Path) -> tuple[Path, Path]:
    """(model folder, tokenizer folder) under `folder`."""
    model.save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "tokenizer")
    return folder / "model", folder / "tokenizer"


def random_reward_model(folder: Path, seed: int = 0, layers: int = 2) -> tuple[Path, Path]:
    tokenizer = char_tokenizer()
    return save(_model(tokenizer, seed, layers), tokenizer, folder)


def e_fraction(text: str) -> float:
    return 4.0 * text.count("e") / max(len(text), 1)


def e_reward_model(folder: Path, steps: int = 300, seed: int = 0) -> tuple[Path, Path]:
    """A reward model trained to predict 4 x (fraction of `e` in the text), on random texts that start like
    the char_e task's prompts ("owl mud cat:") and go on with random characters and runs of `e`."""
    tokenizer = char_tokenizer()
    tokenizer.padding_side = "right"
    model = _model(tokenizer, seed)
    rng = random.Random(seed)
    words = ["owl", "mud", "cat", "nut", "dog", "log", "box"]
    letters = [c for c in CHARACTERS if c.isprintable()]

    def text() -> str:
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(1, 3))) + ":"
        share = rng.random()
        tail = "".join("e" if rng.random() < share else rng.choice(letters) for _ in range(rng.randint(1, 24)))
        return prompt + tail

    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        texts = [text() for _ in range(64)]
        batch = tokenizer(texts, add_special_tokens=False, padding=True, return_tensors="pt")
        target = torch.tensor([e_fraction(t) for t in texts])
        loss = torch.nn.functional.mse_loss(model(**batch).logits[:, 0], target)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    tokenizer.padding_side = "left"
    return save(model, tokenizer, folder)
