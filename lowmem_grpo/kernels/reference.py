"""Deprecated: the old name of `lowmem_grpo.kernels.spec`, the plain fp32 torch spec of every fused op.

Importing it warns (DeprecationWarning) once with the new path; every name read from it is the spec's own
object (`reference.grpo_token_terms is spec.grpo_token_terms`). It goes away in a later release.
"""

import warnings

from . import spec as _spec

warnings.warn("lowmem_grpo.kernels.reference is deprecated: import lowmem_grpo.kernels.spec (the same functions)",
              DeprecationWarning, stacklevel=2)


def __getattr__(name: str) -> object:
    """Every attribute is the spec module's attribute of that name."""
    return getattr(_spec, name)


def __dir__() -> list[str]:
    return dir(_spec)
