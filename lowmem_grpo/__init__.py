"""lowmem-grpo: LoRA-free, low-memory GRPO for small LLMs on 8 GB GPUs.

The fused loss-head ops live in :mod:`lowmem_grpo.kernels`.
"""

__version__ = "0.1.0"
