"""Built-in reward functions, named in a recipe as ``reward_funcs: [numeric_answer, ...]``.

Each entry of :data:`BUILTINS` is a factory: it takes the options given in the recipe (``{name:
exact_match, mode: contains}``), checks them, and returns a function with TRL's reward signature
``f(prompts, completions, completion_ids=None, **columns) -> list[float | None]`` whose
``__name__`` is the built-in's name. ``None`` means "not applicable" (e.g. the expected answer is
missing or unparseable).
"""

from __future__ import annotations

import math
import numbers
import re
import string
import threading
from typing import Callable

from .base import RewardError, completion_text

# ----------------------------------------------------------------------------------------------
# Shared helpers
# ----------------------------------------------------------------------------------------------

# A number: optional sign (only where it cannot be a hyphen, e.g. not in "3-5"), optional "$",
# then "1,234,567.8" (thousands groups) or "1234.5" / "5." / ".5". Trailing dots of sentences are
# harmless: float("5.") == 5.0.
_NUMBER = re.compile(r"(?:(?<![\w)\]])(?P<sign>[-+\u2212]))?\$?(?<![\d.])"
                     r"(?P<num>\d{1,3}(?:,\d{3})+(?![\d])(?:\.\d+)?|\d+(?:\.\d*)?|\.\d+)")


def parse_last_number(text: str) -> float | None:
    """The last number in ``text`` ("-1,234.5", "$12", "7." ...), or None if there is none."""
    last = None
    for m in _NUMBER.finditer(text):
        last = m
    if last is None:
        return None
    value = float(last["num"].replace(",", ""))
    return -value if last["sign"] in ("-", "\u2212") else value


def _expected_number(v) -> float | None:
    if v is None or isinstance(v, bool):
        return None
    if isinstance(v, numbers.Real):
        return float(v) if math.isfinite(v) else None
    if isinstance(v, str):
        return parse_last_number(_after_hashes(v))
    return None


def _after_hashes(s: str) -> str:
    # GSM8K solutions end with "#### <answer>".
    return s.rpartition("####")[2] if "####" in s else s


def _column(kwargs: dict, column: str, who: str) -> list:
    """A dataset column from the reward kwargs, or a clear error naming the columns that exist."""
    if column not in kwargs:
        have = sorted(k for k in kwargs if k != "completion_ids")
        raise RewardError(f"{who} needs the dataset column '{column}', which the dataset does not have. "
                          f"Columns available: {have or '(none)'}. Add the column or set {who}'s option "
                          f"to the right one, e.g. {{name: {who}, answer_column: <column>}}.")
    return kwargs[column]


def _named(fn: Callable, name: str) -> Callable:
    fn.__name__ = fn.__qualname__ = name
    return fn


def _token_ids(completion_ids, completions) -> list:
    return completion_ids if completion_ids is not None else completions


# ----------------------------------------------------------------------------------------------
# Built-ins
# ----------------------------------------------------------------------------------------------

_FLAGS = {"i": re.IGNORECASE, "m": re.MULTILINE, "s": re.DOTALL, "x": re.VERBOSE, "a": re.ASCII}


def regex_format(pattern: str, full_match: bool = True, flags: str = "s") -> Callable:
    """1.0 if the completion text matches ``pattern``, else 0.0.

    full_match=True: ``re.fullmatch`` on the text stripped of surrounding whitespace; False:
    ``re.search`` anywhere. ``flags``: letters of i (ignore case), m (multiline), s (dot matches
    newline, the default), x (verbose), a (ASCII).
    """
    bits = 0
    for letter in flags:
        if letter not in _FLAGS:
            raise ValueError(f"unknown regex flag '{letter}' in flags={flags!r}; use letters of {''.join(_FLAGS)}")
        bits |= _FLAGS[letter]
    try:
        rx = re.compile(pattern, bits)
    except re.error as e:
        raise ValueError(f"invalid regular expression {pattern!r}: {e}") from e
    match = (lambda t: rx.fullmatch(t.strip())) if full_match else rx.search

    def reward(prompts, completions, completion_ids=None, **kwargs):
        return [1.0 if match(completion_text(c)) else 0.0 for c in completions]

    return _named(reward, "regex_format")


def numeric_answer(answer_column: str = "answer", tag: str | None = "answer", tolerance: float = 1e-6) -> Callable:
    """1.0 if the predicted number equals the expected one (within ``tolerance``), else 0.0.

    Predicted: the last number inside the last ``<tag>...</tag>`` if the completion has one (so an
    answer tag beats a later number), else the last number of the completion; tag=None disables
    tags. Numbers may carry a sign, "$", thousands commas and decimals. Expected (column
    ``answer_column``): a number, or a string whose last number counts -- after the last "####"
    for GSM8K solutions. None if the expected answer is missing or unparseable. Equal means
    |predicted - expected| <= tolerance * max(1, |expected|).
    """
    if not isinstance(tolerance, numbers.Real) or not tolerance >= 0:
        raise ValueError(f"tolerance must be a number >= 0, got {tolerance!r}")
    tag_rx = re.compile(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", re.DOTALL) if tag else None

    def predicted(text: str) -> float | None:
        inside = tag_rx.findall(text) if tag_rx else []
        return parse_last_number(inside[-1] if inside else text)

    def reward(prompts, completions, completion_ids=None, **kwargs):
        answers = _column(kwargs, answer_column, "numeric_answer")
        out = []
        for c, a in zip(completions, answers):
            expected = _expected_number(a)
            if expected is None:
                out.append(None)
                continue
            pred = predicted(completion_text(c))
            ok = pred is not None and abs(pred - expected) <= tolerance * max(1.0, abs(expected))
            out.append(1.0 if ok else 0.0)
        return out

    return _named(reward, "numeric_answer")


_STRIP = string.punctuation + string.whitespace + "\u201c\u201d\u2018\u2019\u00ab\u00bb"


def normalize_answer(s: str) -> str:
    """Casefold, collapse whitespace, strip surrounding punctuation and quotes."""
    return " ".join(s.casefold().split()).strip(_STRIP)


def exact_match(answer_column: str = "answer", mode: str = "exact", normalize: bool = True,
                length_penalty: float = 0.0) -> Callable:
    """1.0 if the completion is (mode="exact") or contains (mode="contains") the expected string.

    The column may hold a string or a list of acceptable strings (the best match counts); None
    or an expected string that is empty after normalising gives None. normalize=True casefolds,
    collapses whitespace and strips surrounding punctuation/quotes on both sides; False only
    strips surrounding whitespace. ``length_penalty`` discourages padding around the answer:
    reward = match * max(0, 1 - length_penalty * extra / max(len(expected), 1)), where extra is
    how many characters the (normalised) completion is longer than the expected string.
    """
    if mode not in ("exact", "contains"):
        raise ValueError(f"mode must be 'exact' or 'contains', got {mode!r}")
    if not isinstance(length_penalty, numbers.Real) or not length_penalty >= 0:
        raise ValueError(f"length_penalty must be a number >= 0, got {length_penalty!r}")
    norm = normalize_answer if normalize else str.strip

    def score(text: str, expected: str) -> float:
        hit = (text == expected) if mode == "exact" else (expected in text)
        if not hit:
            return 0.0
        extra = max(0, len(text) - len(expected))
        return max(0.0, 1.0 - length_penalty * extra / max(len(expected), 1))

    def reward(prompts, completions, completion_ids=None, **kwargs):
        answers = _column(kwargs, answer_column, "exact_match")
        out = []
        for c, a in zip(completions, answers):
            options = a if isinstance(a, (list, tuple)) else [a]
            options = [norm(str(o)) for o in options if o is not None]
            options = [o for o in options if o]
            if not options:
                out.append(None)
                continue
            text = norm(completion_text(c))
            out.append(max(score(text, o) for o in options))
        return out

    return _named(reward, "exact_match")


def _int_label(v) -> int | None:
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, numbers.Integral):
        return int(v)
    if isinstance(v, numbers.Real) and float(v).is_integer():
        return int(v)
    if isinstance(v, str) and v.strip().lstrip("-").isdigit():
        return int(v.strip())
    return None


def token_answer(open_id: int, close_id: int, label_column: str = "label", partial: float = 0.0) -> Callable:
    """Token-id task: 1.0 if the completion ids contain [open_id, label, close_id], else 0.0.

    ``label`` is the integer in column ``label_column``; None where it is missing or not an integer.
    ``partial`` (e.g. 0.2) is paid for the right format with the wrong label, [open_id, x, close_id]:
    shaping for a from-scratch policy that would otherwise almost never see a reward.
    """
    _check_ids(open_id=open_id, close_id=close_id)

    def reward(prompts, completions, completion_ids=None, **kwargs):
        labels = _column(kwargs, label_column, "token_answer")
        out = []
        for ids, lab in zip(_token_ids(completion_ids, completions), labels):
            lab = _int_label(lab)
            if lab is None:
                out.append(None)
                continue
            ids = list(ids)
            windows = [ids[k:k + 3] for k in range(len(ids) - 2)]
            if [open_id, lab, close_id] in windows:
                out.append(1.0)
            elif any(w[0] == open_id and w[2] == close_id for w in windows):
                out.append(float(partial))
            else:
                out.append(0.0)
        return out

    return _named(reward, "token_answer")


def token_think(open_id: int, close_id: int) -> Callable:
    """Token-id task: 1.0 if the completion starts with open_id and closes it later with close_id."""
    _check_ids(open_id=open_id, close_id=close_id)

    def reward(prompts, completions, completion_ids=None, **kwargs):
        out = []
        for ids in _token_ids(completion_ids, completions):
            ids = list(ids)
            out.append(1.0 if ids and ids[0] == open_id and close_id in ids[1:] else 0.0)
        return out

    return _named(reward, "token_think")


def _check_ids(**ids) -> None:
    for k, v in ids.items():
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
            raise ValueError(f"{k} must be a token id (an integer >= 0), got {v!r}")


def char_count(char: str = "e", per_char: float = 1.0, max_reward: float | None = None) -> Callable:
    """``per_char`` times the number of occurrences of ``char`` in the text, capped at ``max_reward``.

    A toy reward for smoke tests; needs text completions (a tokenizer).
    """
    if not isinstance(char, str) or not char:
        raise ValueError(f"char must be a non-empty string, got {char!r}")
    for k, v in (("per_char", per_char), ("max_reward", max_reward)):
        if v is not None and (not isinstance(v, numbers.Real) or not math.isfinite(v)):
            raise ValueError(f"{k} must be a finite number, got {v!r}")

    def reward(prompts, completions, completion_ids=None, **kwargs):
        out = []
        for c in completions:
            r = completion_text(c).count(char) * float(per_char)
            out.append(min(r, float(max_reward)) if max_reward is not None else r)
        return out

    return _named(reward, "char_count")


def math_verify(answer_column: str = "answer") -> Callable:
    """1.0 if math-verify finds the completion's answer equal to the expected one, else 0.0.

    Uses ``math_verify.verify(parse(expected), parse(completion))`` (LaTeX, \\boxed{}, plain
    expressions). A GSM8K expected string counts from after its last "####". None when the
    expected answer cannot be parsed; any error inside math-verify scores 0.0. Its own timeouts
    (signal-based) only work in the main thread; elsewhere they are off.
    """
    try:
        from math_verify import parse, verify
    except ImportError as e:
        raise RewardError("the math_verify reward needs the math-verify package: pip install math-verify") from e
    try:  # math-verify's timeout derives from BaseException, so `except Exception` would miss it
        from math_verify.errors import TimeoutException as _Timeout
    except ImportError:
        _Timeout = Exception

    def parse_gold(key: str, timeout):
        try:  # plain LaTeX answers ("\\frac12") parse only inside math delimiters
            return parse(key, parsing_timeout=timeout) or parse(f"${key}$", parsing_timeout=timeout)
        except (Exception, _Timeout):
            return []

    def reward(prompts, completions, completion_ids=None, **kwargs):
        answers = _column(kwargs, answer_column, "math_verify")
        timeout = 5 if threading.current_thread() is threading.main_thread() else None
        golds: dict = {}  # each row repeats G times: parse its answer once
        out = []
        for c, a in zip(completions, answers):
            if a is None:
                out.append(None)
                continue
            key = str(a) if isinstance(a, numbers.Real) else _after_hashes(str(a))
            if key not in golds:
                golds[key] = parse_gold(key, timeout)
            if not golds[key]:
                out.append(None)
                continue
            try:
                pred = parse(completion_text(c), parsing_timeout=timeout)
                ok = bool(verify(golds[key], pred, timeout_seconds=timeout))
            except RewardError:
                raise
            except (Exception, _Timeout):  # math-verify on odd input (incl. its own timeouts): no reward
                ok = False
            out.append(1.0 if ok else 0.0)
        return out

    return _named(reward, "math_verify")


BUILTINS: dict[str, Callable[..., Callable]] = {
    "regex_format": regex_format,
    "numeric_answer": numeric_answer,
    "exact_match": exact_match,
    "token_answer": token_answer,
    "token_think": token_think,
    "char_count": char_count,
    "math_verify": math_verify,
}
