"""A character-level tokenizer (one token per printable ASCII character) for tiny from-scratch models.

Built with the `tokenizers` library and wrapped as a transformers PreTrainedTokenizerFast, so it
saves with save_pretrained next to a checkpoint and loads back with AutoTokenizer.
"""

from __future__ import annotations

import string

from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<pad>", "<eos>", "<unk>"]
CHARACTERS = [c for c in string.printable if c not in "\x0b\x0c\r"]  # letters, digits, punctuation, space, \t, \n


def char_tokenizer():
    """A PreTrainedTokenizerFast with ids 0..2 = <pad>, <eos>, <unk>, then one id per character."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    # BPE with no merges splits a string into single characters; Fuse joins them back without spaces.
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                   padding_side="left")
