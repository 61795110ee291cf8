"""Reward models: a sequence-classification model as a reward function, scored as TRL's GRPOTrainer scores it.

`RewardModel(model, tokenizer, placement=..., device=..., batch_size=...)` is called with TRL's reward
signature and returns one float per completion: the model's first logit (`logits[:, 0]`) at the last
token that is not padding, for the text `prompt + completion` (string prompts) or the tokenizer's chat
template over `prompt messages + completion messages` (conversational prompts), tokenized without
special tokens and padded on the right, as TRL does. Completions are scored `batch_size` at a time,
longest first, so one forward never holds more than that many rows.
Placement: "gpu" keeps the weights on the training device; "cpu" runs on the CPU; "stream" keeps them in
host RAM and copies each decoder layer to the device once per call, running every batch through it there
(policy/layer_major.py, as the reference model does), the embedding looked up on the host. Every
placement computes the same scores within the dtype's rounding (tests/rewards/test_reward_model.py).
"""

from __future__ import annotations

import functools
import inspect
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor, nn

from ..policy.layer_major import DecoderLayers, layer_major_outputs
from ..policy.streaming import stream_decoder
from .base import RewardError

PLACEMENTS = ("gpu", "stream", "cpu")
_HUB_ID = re.compile(r"^[\w.\-]+/[\w.\-]+$")


@dataclass
class ModelSettings:
    """How reward models run (the rewards.model_* settings, placement resolved) and their tokenizers
    (reward_processing_classes: one entry per reward_funcs entry, None for the model's own)."""

    placement: str = "cpu"
    device: torch.device | str = "cpu"
    batch_size: int = 8
    dtype: str = "auto"
    processing_classes: Optional[list] = None


class RewardModel:
    """A loaded sequence-classification model and its tokenizer, callable as a reward function."""

    def __init__(self, model: nn.Module, tokenizer, *, placement: str = "cpu",
                 device: torch.device | str = "cpu", batch_size: int = 8, name: Optional[str] = None):
        if placement not in PLACEMENTS:
            raise RewardError(f"reward model placement must be one of {PLACEMENTS}, got {placement!r}")
        if tokenizer is None:
            raise RewardError("a reward model needs its tokenizer: give one in rewards.reward_processing_classes")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise RewardError(f"reward model batch size must be a positive integer, got {batch_size!r}")
        if tokenizer.pad_token_id is None:  # as TRL: right padding needs a pad token; the EOS serves
            tokenizer.pad_token = tokenizer.eos_token
        self.model = model.eval().requires_grad_(False)
        # The score is read at the last token that is not padding (transformers' rule): say which that is.
        self.model.config.get_text_config().pad_token_id = tokenizer.pad_token_id
        self.tokenizer, self.placement, self.batch_size = tokenizer, placement, batch_size
        self.device = torch.device("cpu") if placement == "cpu" else torch.device(device)
        self.__name__ = name or str(getattr(model.config, "_name_or_path", "") or type(model).__name__).split("/")[-1]
        self.streamer = self.arena = None
        if placement == "stream":
            score = getattr(model, "score", None)
            if not isinstance(score, nn.Linear):
                raise RewardError(f"{type(model).__name__} has no `score` linear head over a decoder: it cannot "
                                  f"be streamed; set rewards.model_placement=gpu or cpu")
            try:
                self.arena, self.streamer = stream_decoder(model, model.base_model, self.device,
                                                           "set rewards.model_placement=gpu or cpu",
                                                           kind="reward model layers")
            except NotImplementedError as e:
                raise RewardError(f"reward model {self.__name__}: {e}") from e
            score.to(self.device)
            self.layers = DecoderLayers(model.base_model.layers)
        else:
            self.model.to(self.device)

    def texts(self, prompts: list, completions: list) -> list[str]:
        """The text each completion is scored on (module docstring)."""
        if any(isinstance(p, (list, tuple)) and p and not isinstance(p[0], dict) for p in prompts):
            raise RewardError(f"reward model {self.__name__} reads text, but these prompts are token ids: score "
                              f"a token-id task with a reward function")
        out = []
        for p, c in zip(prompts, completions):
            if isinstance(p, (list, tuple)):  # a conversation: the prompt's messages, then the completion's
                messages = list(p) + (list(c) if isinstance(c, (list, tuple)) else [{"role": "assistant",
                                                                                      "content": c}])
                out.append(self.tokenizer.apply_chat_template(messages, tokenize=False))
            else:
                out.append(p + c)
        return out

    @torch.no_grad()
    def __call__(self, prompts: list, completions: list, **kwargs) -> list[float]:
        texts = self.texts(prompts, completions)
        ids = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        limit = getattr(self.model.config.get_text_config(), "max_position_embeddings", None)
        longest = max(range(len(ids)), key=lambda i: len(ids[i]), default=None)
        if limit and longest is not None and len(ids[longest]) > limit:
            raise RewardError(f"reward model {self.__name__} reads at most {limit} tokens; prompt + completion "
                              f"{longest} has {len(ids[longest])}: shorten generation.max_prompt_length or "
                              f"max_completion_length")
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
        scores = torch.empty(len(ids), dtype=torch.float32)
        batches = []
        for start in range(0, len(order), self.batch_size):
            rows = order[start:start + self.batch_size]
            batch = self.tokenizer.pad({"input_ids": [ids[i] for i in rows]}, padding=True, padding_side="right",
                                       return_tensors="pt")
            batches.append((rows, batch["input_ids"], batch["attention_mask"]))
        if self.streamer is None:
            for rows, input_ids, attention_mask in batches:
                scores[rows] = self.scores(input_ids, attention_mask)
        else:
            for (rows, _, _), part in zip(batches, self._streamed_scores(batches)):
                scores[rows] = part
        return scores.tolist()

    def scores(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """First logit at each row's last non-padding token, (b,) fp32 on the CPU; right-padded (b, L) input."""
        if self.streamer is None:  # the model's own forward, as TRL calls it
            out = self.model(input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device))
            return out.logits[:, 0].float().cpu()
        return self._streamed_scores([(None, input_ids, attention_mask)])[0]

    def _decoder_hidden(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        embeds = self.model.get_input_embeddings()(input_ids)  # the table stays in host RAM
        return self.model.base_model(inputs_embeds=embeds.to(self.device), attention_mask=attention_mask.to(
            self.device), use_cache=False).last_hidden_state

    def _streamed_scores(self, batches: list) -> list[Tensor]:
        """`scores` of each (rows, input_ids, attention_mask) batch, streamed layer-major: each layer's weights
        cross once and score every batch."""
        hiddens = layer_major_outputs(self.layers, [functools.partial(self._decoder_hidden, ids, mask)
                                                    for _, ids, mask in batches], around=self.streamer.resident)
        out = []
        for (_, input_ids, _), hidden in zip(batches, hiddens):
            last = last_token_index(input_ids, self.tokenizer.pad_token_id).to(self.device)
            picked = hidden[torch.arange(len(hidden), device=self.device), last]  # (b, H)
            out.append(self.model.score(picked)[:, 0].float().cpu())
        return out


def reward_models(funcs) -> list[RewardModel]:
    """The reward models among loaded reward functions (rewards.RewardFunction, timeouts unwrapped)."""
    return [fn for fn in (inspect.unwrap(f.fn) for f in funcs) if isinstance(fn, RewardModel)]


def uses_reward_model(funcs) -> bool:
    """Whether any of the loaded reward functions is a reward model."""
    return bool(reward_models(funcs))


def last_token_index(input_ids: Tensor, pad_token_id: int) -> Tensor:
    """transformers' rule for a sequence classifier's read position: the rightmost token that is not the pad
    token (0 for a row of padding only)."""
    positions = torch.arange(input_ids.shape[1], dtype=torch.int64)
    return (positions * (input_ids != pad_token_id)).argmax(-1)


def looks_like_model(spec, base_dir=None) -> bool:
    """Whether a reward_funcs entry names a reward model: a loaded model (an nn.Module with a config), a
    folder (from the current folder or the recipe's), a hub id 'org/name', or any other path (a string with
    a path separator and no ':'; loading it names the folders looked at)."""
    if isinstance(spec, nn.Module):
        return hasattr(spec, "config")
    if not isinstance(spec, str) or ":" in spec:
        return False
    return model_folder(spec, base_dir) is not None or bool(_HUB_ID.match(spec)) or _is_path(spec)


def _is_path(spec: str) -> bool:
    return "/" in spec or os.sep in spec or spec.startswith("~")


def _candidates(spec: str, base_dir=None) -> list[Path]:
    """Where a folder named `spec` is looked for: as given if absolute, else the current folder, then the recipe's."""
    path = Path(spec).expanduser()
    return [path] if path.is_absolute() else [Path.cwd() / path] + ([Path(base_dir) / path] if base_dir else [])


def model_folder(spec: str, base_dir=None) -> Optional[Path]:
    """The local folder a reward-model spec names (tried from the current folder, then the recipe's), else None."""
    return next((p.resolve() for p in _candidates(spec, base_dir) if (p / "config.json").is_file()), None)


def missing_folder_error(spec: str, base_dir, where: str, is_path: bool = False) -> Optional[RewardError]:
    """For a spec that names a folder (one that exists, one that can only be a path: it starts with / ./ ../
    or ~, or has two slashes, or any spec when `is_path`) but holds no model: the error that says so and
    where it looked; else None."""
    tried = _candidates(spec, base_dir)
    found = next((p for p in tried if p.is_dir()), None)
    path_only = is_path or spec.startswith(("/", "./", "../", "~")) or spec.count("/") > 1 or "\\" in spec
    if found is None and not path_only:
        return None
    what = (f"{found} has no config.json, so it is not a reward model" if found else
            f"no reward model folder {spec!r} (looked at {', '.join(str(p.resolve()) for p in tried)})")
    return RewardError(f"{where}: {what}: give the folder of a sequence-classification model (config.json and "
                       "weights), a hub id 'org/name', or a built-in reward")


def load_reward_model(spec, tokenizer=None, *, base_dir=None, settings: Optional[ModelSettings] = None,
                      where: str = "reward_funcs") -> RewardModel:
    """A RewardModel from a spec (a loaded model, a folder or a hub id) and an optional tokenizer (an object,
    a folder or hub id; default: the model's own). Loads as TRL does: AutoModelForSequenceClassification
    with num_labels=1."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    settings = settings or ModelSettings()
    dtype, source = settings.dtype, spec
    if isinstance(spec, str):
        folder = model_folder(spec, base_dir)
        if folder is None and not _HUB_ID.match(spec):  # neither a model folder nor a hub id
            raise missing_folder_error(spec, base_dir, where, is_path=True)
        source = str(folder) if folder is not None else spec
        # "auto" said outright: transformers 4.x loads fp32 unless told, 5.x the checkpoint's dtype
        try:
            model = AutoModelForSequenceClassification.from_pretrained(
                source, num_labels=1, dtype=dtype if dtype == "auto" else getattr(torch, dtype))
        except (OSError, ValueError) as e:
            if folder is None and (missing := missing_folder_error(spec, base_dir, where)) is not None:
                raise missing from None
            raise RewardError(f"{where}: cannot load the reward model {spec!r} ({type(e).__name__}: {e}). Give the "
                              f"folder of a sequence-classification model (config.json and weights) or a hub id "
                              f"this machine can download") from e
    else:
        model = spec
        if dtype != "auto":
            model = model.to(getattr(torch, dtype))
        source = getattr(model.config, "_name_or_path", None)
    if isinstance(tokenizer, str):
        folder = model_folder(tokenizer, base_dir) or Path(tokenizer)
        tokenizer = _load_tokenizer(AutoTokenizer, str(folder) if folder.exists() else tokenizer, where)
    elif tokenizer is None:
        if not source:
            raise RewardError(f"{where}: the reward model has no name to load its tokenizer from: give one in "
                              f"rewards.reward_processing_classes")
        tokenizer = _load_tokenizer(AutoTokenizer, source, where)
    return RewardModel(model, tokenizer, placement=settings.placement, device=settings.device,
                       batch_size=settings.batch_size)


def _load_tokenizer(auto, source: str, where: str):
    try:
        return auto.from_pretrained(source)
    except (OSError, ValueError) as e:
        raise RewardError(f"{where}: cannot load the reward model's tokenizer from {source!r} ({type(e).__name__}: "
                          f"{e}); name one in rewards.reward_processing_classes") from e
