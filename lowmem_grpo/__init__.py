"""lowmem-grpo: LoRA-free, low-memory GRPO for small LLMs on 8 GB GPUs.

The package, bottom to top (each layer imports only the ones above it in this list):

    lowmem_grpo.kernels   fused loss-head ops (the top-level `kernels/` folder of the source tree)
    config, phases        the settings tree; the step's phase markers for the profiler
    policy/               loading the model, generation, the no-grad log-prob passes
    rewards/              reward functions: TRL's signature, built-ins, loading, calling
    memory_modes/         bf16 + stochastic rounding, optimizer in backward, reference off the GPU,
                          activation offload, optimizer construction
    training/             the GRPO loop: Trainer, generation batches, data, checkpoints, metrics, eval
    memory/               memory tools: track(), the profiler, the planner and its layer probe, presets
    api                   the Python API in TRL's shape: GRPOConfig, GRPOTrainer (the CLI's Trainer), callbacks
    cli/                  `lowmem-grpo train|eval|plan|profile|recipes`

shipped_recipes (where the recipes installed with the package are) imports nothing and sits at the
bottom with config. `from lowmem_grpo import GRPOConfig, GRPOTrainer, TrainerCallback` loads the API
(and torch) on first use only, so `import lowmem_grpo` and `lowmem_grpo.kernels` stay light.
"""

import importlib.util
import logging
import os
import sys

__version__ = "0.1.0"


def _default_log_handler() -> None:
    """Library messages (resumed from, saved, held-out scores, ...) go through `logging`, under the
    `lowmem_grpo` logger. As transformers does for its own, that logger prints INFO and above to
    stderr by default, prefixed [lowmem-grpo], and does not propagate (no duplicates where the root
    logger has a handler). `logging.getLogger("lowmem_grpo").setLevel(logging.WARNING)` quiets it; to
    route it elsewhere, replace its handlers and set `propagate` back to True."""
    logger = logging.getLogger(__name__)
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[lowmem-grpo] %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


_default_log_handler()


class _SourceTreeKernels:
    """Finds `lowmem_grpo.kernels` in a source tree, where it is the `kernels/` folder beside this package.

    An install maps that folder into the package (pyproject's package-dir). A bare tree (the GPU
    machine, a clone with its root on sys.path) has no such mapping, and a tree that shadows an install
    (`python -m pytest` from the root puts the root first) would fail to import the kernels or take
    another tree's. So when this package is imported from a source tree, `lowmem_grpo.kernels` is
    always that tree's `kernels/`. Only this one name is handled.
    """

    def __init__(self, folder: str):
        self.folder = folder

    def find_spec(self, fullname, path=None, target=None):
        if fullname != __name__ + ".kernels":
            return None
        return importlib.util.spec_from_file_location(fullname, os.path.join(self.folder, "__init__.py"),
                                                      submodule_search_locations=[self.folder])


def _map_source_tree_kernels() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    if os.path.isfile(os.path.join(here, "kernels", "__init__.py")):
        return  # an installed wheel: the kernels are inside the package
    folder = os.path.join(os.path.dirname(here), "kernels")
    if os.path.isfile(os.path.join(folder, "__init__.py")):
        sys.meta_path.insert(0, _SourceTreeKernels(folder))


_map_source_tree_kernels()


_API = ("GRPOConfig", "GRPOTrainer", "TrainerCallback")


def __getattr__(name):
    if name in _API:
        from . import api
        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_API))
