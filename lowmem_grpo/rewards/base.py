"""What loading, calling and the built-in reward functions share: the error type, the loaded function
record, and reading a completion's text.

A reward function has TRL's GRPOTrainer signature, ``f(prompts, completions, completion_ids=..., **columns)
-> list[float | None]``: ``prompts`` are dataset prompts (a string, a chat message list, or list[int] for
token-id tasks); ``completions`` strings, ``[{"role": "assistant", "content": text}]`` for conversational
prompts, or list[int] ids without a tokenizer; ``completion_ids`` the token ids (EOS excluded); every other
dataset column arrives as a keyword with one entry per completion. During training ``trainer_state``,
``log_metric(name, value)`` and ``log_extra(column, values)`` arrive too, so take ``**kwargs``. ``None``
means "not applicable": NaN in the per-function table, left out of that function's mean, 0 in the weighted
total; a completion with None from every function is left out of its group's mean and std and of
``reward``, and gets advantage 0 (TRL >= 1.6).
Specs accepted by :func:`load_reward_functions` (:data:`lowmem_grpo.rewards.builtins.BUILTINS`): a built-in
name, ``{"name": ..., "label": ..., **kwargs}``, ``"package.module:function"``, ``"path/to/file.py:function"``,
or (from Python) a callable.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Callable


_PREVIEW_CHARS = 200


class RewardError(RuntimeError, ValueError):
    """A user-facing problem with a reward function or its configuration.

    Also a ValueError, so config validation that catches ValueError reports it the same way.
    """


@dataclass
class RewardFunction:
    name: str  # label for metrics: rewards/<name>/mean
    fn: Callable
    weight: float


# ----------------------------------------------------------------------------------------------
# Helpers shared with the built-ins
# ----------------------------------------------------------------------------------------------

def completion_text(c) -> str:
    """The text of one completion: a string, or the last assistant message of a TRL chat list."""
    if isinstance(c, str):
        return c
    if isinstance(c, dict):
        return _content_text(c.get("content"))
    if isinstance(c, (list, tuple)):
        if c and all(isinstance(x, numbers.Integral) for x in c):
            raise RewardError("this completion is a list of token ids: the task has no tokenizer, so there is "
                              "no text. Use a token-id reward (token_answer, token_think) or read "
                              "`completion_ids` in your function.")
        if all(isinstance(m, dict) for m in c):
            if not c:
                return ""
            assistant = [m for m in c if m.get("role") == "assistant"]
            return _content_text((assistant or c)[-1].get("content"))
    raise RewardError(f"cannot read text from a completion of type {type(c).__name__}: expected a string or "
                      f"a list of chat messages, got {preview(c)}")


def _content_text(content) -> str:
    # Multimodal-style content is a list of parts: [{"type": "text", "text": ...}, ...].
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def preview(x, limit: int = _PREVIEW_CHARS) -> str:
    """A one-line, truncated rendering of a prompt or completion for error messages."""
    if isinstance(x, (list, tuple)) and x and all(isinstance(m, dict) for m in x):
        text = " | ".join(f"{m.get('role', '?')}: {_content_text(m.get('content'))}" for m in x)
    else:
        text = x if isinstance(x, str) else str(x)
    if len(text) > limit:  # keep both ends: the system prompt opens a prompt, the question ends it
        half = limit // 2
        text = f"{text[:half]} ... {text[-half:]} [{len(text)} chars]"
    return repr(text)


def describe_sample(prompts, completions, i: int) -> str:
    p = prompts[i] if i < len(prompts) else "?"
    c = completions[i] if i < len(completions) else "?"
    return f"\n  sample {i}:\n    prompt:     {preview(p)}\n    completion: {preview(c)}"
