"""Deprecated: the old name of `lowmem_grpo.optim` (and of three modules that moved elsewhere).

`import lowmem_grpo.memory_modes.X` keeps working for one release and warns (DeprecationWarning) with
the new path. Old module -> new module:

    memory_modes.offload, .optimizer_in_backward, .optimizers, .sr_adamw, .host_adamw -> optim.<same>
    memory_modes.reference           -> policy.reference
    memory_modes.activation_offload  -> training.activation_offload
    memory_modes.host_arena          -> host_arena

Renamed classes stay reachable under their old names here: `OffloadedOptimizerInBackward` is
`optim.offload.OffloadedOptimizer`; the host RAM arithmetic once in offload is `optim.host_ram`.
"""

import importlib
import sys
import types
import warnings

MOVED = {
    "offload": ("lowmem_grpo.optim.offload", "lowmem_grpo.optim.host_ram"),
    "optimizer_in_backward": ("lowmem_grpo.optim.optimizer_in_backward",),
    "optimizers": ("lowmem_grpo.optim.optimizers",),
    "sr_adamw": ("lowmem_grpo.optim.sr_adamw",),
    "host_adamw": ("lowmem_grpo.optim.host_adamw",),
    "reference": ("lowmem_grpo.policy.reference",),
    "activation_offload": ("lowmem_grpo.training.activation_offload",),
    "host_arena": ("lowmem_grpo.host_arena",),
}
RENAMED = {"OffloadedOptimizerInBackward": "OffloadedOptimizer"}

warnings.warn("lowmem_grpo.memory_modes is deprecated: import lowmem_grpo.optim (the optimizer), "
              "lowmem_grpo.policy.reference, lowmem_grpo.training.activation_offload or "
              "lowmem_grpo.host_arena instead", DeprecationWarning, stacklevel=2)


class _Moved(types.ModuleType):
    """The old module: each attribute read from the first new module that has it (old class names
    through RENAMED)."""

    def __init__(self, old: str, new: tuple[str, ...]):
        super().__init__(old, f"Deprecated alias of {', '.join(new)}.")
        self._new = new

    def __getattr__(self, name):
        if name.startswith("__"):  # tools that scan sys.modules (torch's import does) must not import anything
            raise AttributeError(name)
        name = RENAMED.get(name, name)
        for module in map(importlib.import_module, self._new):
            if hasattr(module, name):
                return getattr(module, name)
        raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")

    def __dir__(self):
        return sorted(set().union(*(dir(importlib.import_module(m)) for m in self._new)) | set(RENAMED))


for _old, _new in MOVED.items():
    sys.modules[f"{__name__}.{_old}"] = globals()[_old] = _Moved(f"{__name__}.{_old}", _new)
