"""The reward models' share of the plan: device bytes by placement, the "rewards" phase, host RAM.

A reward model (rewards/model.py) placed "gpu" keeps its weights on the device for the whole run (the
"reward model" category, in every phase); "stream" holds about two decoder layers there while it scores
(policy/streaming.py) and its weights in host RAM, pinned on a GPU; "cpu" uses no device memory. The
"rewards" phase is the policy's resident state plus one scoring forward: `batch_size` rows of prompt +
completion at the generation limits, with no gradient: the input embeddings, the hidden states out,
one layer's transient (the layer probe's) and the attention mask with sdpa's per-call copy.
Shapes are read from each model's config.json on the meta device: no weights are loaded.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
import torch

from ..config import Config, ConfigError
from ..host_arena import arena_bytes
from ..rewards.model import looks_like_model, model_folder
from .layer_probe import layer_costs

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class RewardArch:
    """What a reward model's memory depends on."""

    name: str
    tensor_sizes: tuple  # numel of every parameter tensor
    layer_params: int  # the largest decoder layer's parameters
    hidden: int
    weight_bytes: int  # per parameter, in model_dtype
    config: dict

    @property
    def params(self) -> int:
        return sum(self.tensor_sizes)


def reward_archs(cfg: Config, base_dir=None) -> list[RewardArch]:
    """The reward models among rewards.reward_funcs (folders tried from the current folder, then `base_dir`)."""
    out = []
    for spec in cfg.rewards.reward_funcs:
        spec = spec.get("name") if isinstance(spec, dict) else spec
        if isinstance(spec, str) and looks_like_model(spec, base_dir):
            folder = model_folder(spec, base_dir)
            out.append(_read(str(folder) if folder else spec, cfg.rewards.model_dtype))
    return out


def resolve_folders(cfg: Config, base_dir) -> None:
    """Make reward-model folders named relative to `base_dir` (the recipe's folder) absolute in `cfg`, so
    the planner finds them from any current folder, as the trainer does."""
    specs = cfg.rewards.reward_funcs
    for i, spec in enumerate(specs):
        name = spec.get("name") if isinstance(spec, dict) else spec
        if isinstance(name, str) and ":" not in name and model_folder(name) is None:
            folder = model_folder(name, base_dir)
            if folder is not None:
                specs[i] = {**spec, "name": str(folder)} if isinstance(spec, dict) else str(folder)


@functools.lru_cache(maxsize=32)
def _read(source: str, dtype: str) -> RewardArch:
    from transformers import AutoConfig, AutoModelForSequenceClassification
    try:
        conf = AutoConfig.from_pretrained(source, num_labels=1)
    except (OSError, ValueError) as e:
        raise ConfigError(f"the planner cannot read the reward model {source!r}'s config.json ({type(e).__name__}: "
                          f"{e}); give a folder or a hub id this machine can reach") from e
    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(conf)
    layers = getattr(model.base_model, "layers", None)
    layer_params = max((sum(p.numel() for p in layer.parameters()) for layer in layers or []), default=0)
    stored = str(getattr(conf, "dtype", None) or getattr(conf, "torch_dtype", None) or "float32").split(".")[-1]
    weight_bytes = _DTYPE_BYTES.get(stored if dtype == "auto" else dtype, 4)
    text = conf.get_text_config()
    return RewardArch(source.rstrip("/").split("/")[-1], tuple(p.numel() for p in model.parameters()), layer_params,
                      text.hidden_size, weight_bytes, text.to_dict())


def placement(cfg: Config, device: str = "cuda") -> str:
    """rewards.model_placement as the trainer resolves it (auto: cpu on a CPU run, stream on a GPU)."""
    setting = cfg.rewards.model_placement
    return setting if setting != "auto" else ("cpu" if device == "cpu" else "stream")


def device_bytes(cfg: Config, archs: list[RewardArch], where: str) -> tuple[int, dict]:
    """(bytes every phase holds: the weights of gpu-placed models; the "rewards" phase's own categories,
    {} without reward models), for the models placed `where` (gpu | stream | cpu)."""
    if not archs or where == "cpu":
        return 0, ({"reward buffers": 0} if archs else {})
    resident = sum(a.weight_bytes * a.params for a in archs) if where == "gpu" else 0
    g, t = cfg.generation, cfg.train
    rows = cfg.rewards.model_batch_size or t.per_device_train_batch_size
    length = g.max_prompt_length + g.max_completion_length
    worst = 0
    for a in archs:
        costs = layer_costs(a.config, torch.bfloat16 if a.weight_bytes == 2 else torch.float32, False)
        T = rows * length
        mask = rows * length * length * (1 + a.weight_bytes)  # the bool mask and sdpa's additive copy
        work = 2 * T * a.hidden * a.weight_bytes + (costs.no_grad_peak - costs.kv_cache) * T + mask
        streamed = 2 * a.layer_params * a.weight_bytes if where == "stream" else 0
        worst = max(worst, int(work + streamed))
    return resident, {"reward buffers": worst}


def host_bytes(archs: list[RewardArch], where: str, device: str = "cuda") -> int:
    """Host RAM the reward models placed `where` keep: streamed on a GPU, one pinned block each
    (host_arena.py); otherwise their weights; gpu-placed, nothing."""
    if where == "gpu":
        return 0
    if where == "stream" and device != "cpu":
        return sum(arena_bytes(a.weight_bytes * n for n in a.tensor_sizes) for a in archs)
    return sum(a.weight_bytes * a.params for a in archs)
