"""The policy model: loading it, sampling from it, and running it the way the loss needs.

    model.py           load the model and tokenizer; the fused head's view of it (decoder + output embedding)
    batch.py           `Batch`: a generation batch's prompts and completions (left/right padded, cut at EOS)
    rollout.py         `generate` completions (fast sampling loop or transformers' generate()), decode them
    sampling.py        the fast sampling loop: one prefill per prompt, finished rows' slots refilled
    decode_slots.py    the rows decoding together, one per slot, and the KV cache they share
    static_decode.py   the static-shape decode step (preallocated cache, batch buckets, compiled)
    decode_graphs.py   CUDA graphs of the compiled decode step, owned by one rollout
    logprobs.py        hidden states and no-grad log-probs of the completion tokens (loss, old policy)
    packing.py         shared-prompt packing: one row per prompt and its completions, block mask
    reference.py       the frozen reference model, kept in CPU RAM; streaming.py runs it (and reward models)
                       from host RAM on the device a layer at a time
    char_tokenizer.py  a character tokenizer for tiny from-scratch models
May import lowmem_grpo.config, the kernels and host_arena, nothing else. Design notes: docs/rollouts.md
"""
