"""Prompt data: load a local dataset, turn each row into prompt token ids, and order prompts per epoch.

Three pieces, used in this order by the trainer:

* `load_rows` reads a .jsonl/.json/.csv/.parquet file or a `save_to_disk` folder into a list of dicts.
* `build_prompt_set` checks the columns and tokenizes every prompt once, up front, so a bad row stops the
  run before any model work, with the row number and the fix in the message.
* `PromptSampler` yields prompt indices: a fresh seeded permutation each epoch, resumable from a checkpoint.

Every problem the user can fix raises `DataError`, whose message names the file or row and says what to do.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import tempfile
from dataclasses import dataclass, field
from typing import Optional

SUPPORTED_EXTENSIONS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


class DataError(ValueError):
    """A problem with the prompt data that the user can fix; the message names the file or row and the fix."""


class Rows(list):
    """Data rows (plain dicts) read from a file, and how error messages name each: the file's own line
    number for JSON lines (what an editor shows), else the row counted from 1. Rows a caller passes as a
    plain list are named by their 0-based index, as Python indexes them (`Rows.name_of`)."""

    def __init__(self, rows, lines: Optional[list[int]] = None):
        super().__init__(rows)
        self.lines = lines if lines is not None and len(lines) == len(self) else None

    def sliced(self, start: int, stop: Optional[int] = None) -> "Rows":
        """rows[start:stop], keeping each row's name."""
        return Rows(self[start:stop], None if self.lines is None else self.lines[start:stop])

    def name(self, i: int, source: str) -> str:
        return f"{source} line {self.lines[i]}" if self.lines is not None else f"{source} row {i + 1}"

    @staticmethod
    def name_of(rows: list, i: int, source: str) -> str:
        """How messages name rows[i]: by its line or 1-based row for Rows, by its index for a plain list."""
        return rows.name(i, source) if isinstance(rows, Rows) else f"{source} index {i}"


# ----------------------------------------------------------------------------------------------- loading
def load_rows(source, name: str | None = None) -> list[dict]:
    """All rows of a local data file or `datasets` folder, as plain dicts (`Rows`, which name each row's
    line or 1-based row in error messages).

    From Python, `source` may also be the data itself: a `datasets.Dataset` (or a DatasetDict with a
    'train' split), or a list of dicts. `name` names in-memory data in error messages."""
    if not isinstance(source, (str, os.PathLike)):
        return _in_memory_rows(source, name or "the dataset")
    path = os.path.expanduser(str(source))
    if not os.path.exists(path):
        raise DataError(f"data file not found: {path} (give a local .jsonl/.json/.csv/.parquet file or a "
                        "folder made by datasets' save_to_disk)")
    ext = os.path.splitext(path)[1].lower()
    if os.path.isfile(path) and ext not in SUPPORTED_EXTENSIONS:
        raise DataError(f"unsupported data file type {ext or '(no extension)'!r} for {path}: use one of "
                        f"{', '.join(SUPPORTED_EXTENSIONS)} or a folder made by save_to_disk")
    try:
        import datasets  # slow to import: only when data is actually loaded
    except ImportError:  # a bare GPU image (benchmarks): JSONL needs no library; other formats do
        if ext == ".jsonl" and os.path.isfile(path):
            return _read_jsonl(path)
        raise DataError(f"reading {path} needs the `datasets` package: pip install datasets") from None

    # Quiet datasets' progress bars and its own copy of the parse error (ours says it better), then restore.
    bars_were_off = datasets.utils.are_progress_bars_disabled()
    verbosity = datasets.logging.get_verbosity()
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    try:
        rows = _load_dir(path) if os.path.isdir(path) else _load_file(path)
    finally:
        datasets.logging.set_verbosity(verbosity)
        if not bars_were_off:
            datasets.enable_progress_bars()
    if not rows:
        raise DataError(f"{path} has no rows")
    return rows if isinstance(rows, Rows) else Rows(rows, _jsonl_lines(path) if ext == ".jsonl" else None)


def _jsonl_lines(path: str) -> list[int]:
    """The line number of each non-blank line of a JSON-lines file: the rows a parser reads from it."""
    with open(path, errors="replace") as f:
        return [n for n, line in enumerate(f, 1) if line.strip()]


def _in_memory_rows(data, name: str) -> list[dict]:
    """Rows of a `datasets.Dataset` / DatasetDict or a list of dicts, copied into plain dicts."""
    if isinstance(data, dict):
        if not data or not all(hasattr(v, "column_names") for v in data.values()):
            raise DataError(f"{name} is a dict: give one dict per row in a list (or datasets.Dataset.from_dict("
                            "columns) for a dict of columns)")
        data = _train_split(data, name)  # a DatasetDict
    if hasattr(data, "to_list") and hasattr(data, "column_names"):  # a datasets.Dataset
        rows = data.to_list()
    elif isinstance(data, (list, tuple)):
        rows = list(data)
    else:
        hint = " (an IterableDataset has no length: load it as a Dataset, or take rows with .take(n))" \
            if hasattr(data, "take") else ""
        raise DataError(f"{name} is a {type(data).__name__}: give a datasets.Dataset, a list of dicts, or the path "
                        f"of a .jsonl/.json/.csv/.parquet file or save_to_disk folder{hint}")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(f"{name} index {i} is a {type(row).__name__}, not a dict: each row needs a 'prompt' "
                            "(or 'prompt_ids') key, e.g. {'prompt': 'What is 2+3?', 'answer': '5'}")
    if not rows:
        raise DataError(f"{name} has no rows")
    return [dict(row) for row in rows]


def _train_split(ds, name: str):
    """The split to train on from a DatasetDict: 'train', or its only split."""
    splits = list(ds.keys())
    if "train" in splits:
        return ds["train"]
    if len(splits) == 1:
        return ds[splits[0]]
    raise DataError(f"{name} holds a DatasetDict with splits {splits} and none is named 'train': "
                    "pass the split to use, e.g. dataset['test']")


def _load_file(path: str) -> list[dict]:
    from datasets import load_dataset

    ext = os.path.splitext(path)[1].lower()
    if os.path.getsize(path) == 0:
        raise DataError(f"{path} is empty")
    # load_dataset writes Arrow files to a cache; point that at a throw-away folder so nothing lands in
    # ~/.cache or next to the data (which may be read-only), and keep the table in memory.
    with tempfile.TemporaryDirectory(prefix="lowmem_grpo_data_") as cache_dir:
        try:
            ds = load_dataset(SUPPORTED_EXTENSIONS[ext], data_files=path, split="train",
                              cache_dir=cache_dir, keep_in_memory=True)
        except Exception as e:  # the parsers raise many types; all mean "this file does not parse"
            if "corresponds to no data" in str(e) or isinstance(e, StopIteration):
                raise DataError(f"{path} has no rows") from e
            raise DataError(f"could not read {path} as {SUPPORTED_EXTENSIONS[ext]}: {_root_message(e)}") from e
        return ds.to_list()


def _read_jsonl(path: str) -> Rows:
    """JSONL without `datasets`, with the same errors (the file and line that do not parse; no rows)."""
    rows, lines = [], []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(f"could not read {path} as JSON lines: line {i}: {e.msg}") from None
            lines.append(i)
    if not rows:
        raise DataError(f"{path} has no rows")
    return Rows(rows, lines)


def _load_dir(path: str) -> list[dict]:
    from datasets import DatasetDict, load_from_disk

    try:
        ds = load_from_disk(path, keep_in_memory=True)
    except Exception as e:
        raise DataError(f"{path} is a folder but not one written by datasets' save_to_disk "
                        f"({_root_message(e)})") from e
    if isinstance(ds, DatasetDict):
        splits = list(ds)
        if "train" in ds:
            ds = ds["train"]
        elif len(splits) == 1:
            ds = ds[splits[0]]
        else:
            raise DataError(f"{path} holds a DatasetDict with splits {splits} and none is named 'train': "
                            "save the split to use on its own, or rename it to 'train'")
    return ds.to_list()


def _root_message(e: BaseException) -> str:
    """The innermost cause's message: datasets wraps parser errors in a generic 'error occurred' one."""
    while e.__cause__ is not None:
        e = e.__cause__
    return f"{type(e).__name__}: {e}"


# ------------------------------------------------------------------------------------------ prompt set
@dataclass
class PromptSet:
    prompts: list                  # each prompt as given (str, chat message list, or list[int]) for rewards/logs
    prompt_ids: list[list[int]]    # token ids after chat template / truncation
    columns: dict[str, list]       # every other column, row-aligned (keyword arguments of reward functions)
    num_truncated: int
    truncated: list[bool] = field(default_factory=list, repr=False)  # per row, so select() can recount

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def select(self, indices: list[int]) -> "PromptSet":
        """The rows at `indices`, in that order."""
        indices = [int(i) for i in indices]
        flags = [self.truncated[i] for i in indices] if self.truncated else []
        return PromptSet(prompts=[self.prompts[i] for i in indices],
                         prompt_ids=[list(self.prompt_ids[i]) for i in indices],
                         columns={k: [v[i] for i in indices] for k, v in self.columns.items()},
                         num_truncated=sum(flags), truncated=flags)


def build_prompt_set(rows: list[dict], tokenizer, data_cfg, max_prompt_length: int, source: str,
                     vocab_size: int | None = None) -> PromptSet:
    """Tokenize every row's prompt (or check its prompt_ids); `source` names the data in error messages."""
    if not rows:
        raise DataError(f"{source} has no rows")
    if data_cfg.prompt_truncation not in ("error", "left"):
        raise DataError(f"data.prompt_truncation must be 'error' or 'left', got {data_cfg.prompt_truncation!r}")
    if max_prompt_length < 1:
        raise DataError(f"generation.max_prompt_length must be at least 1, got {max_prompt_length}")
    names = list(dict.fromkeys(k for row in rows for k in row))  # union of columns, first-seen order
    key = _prompt_column(names, source)
    if key == "prompt" and tokenizer is None:
        raise DataError(f"{source}: this model has no tokenizer (model.tokenizer: none): give token ids in a "
                        "prompt_ids column instead of text in a prompt column")

    prompts, all_ids, flags = [], [], []
    for i, row in enumerate(rows):
        value, where = row.get(key), Rows.name_of(rows, i, source)
        ids = (_check_ids(value, where, vocab_size) if key == "prompt_ids"
               else _tokenize(value, where, tokenizer, data_cfg))
        if not ids:
            raise DataError(f"{where}: the prompt is empty (0 tokens)")
        cut = len(ids) > max_prompt_length
        if cut and data_cfg.prompt_truncation == "error":
            raise DataError(
                f"{where}: the prompt is {len(ids)} tokens, longer than generation.max_prompt_length="
                f"{max_prompt_length}. Raise generation.max_prompt_length, or set data.prompt_truncation=left "
                f"to keep the last {max_prompt_length} tokens of long prompts.")
        if cut:  # left: the end holds the question and the chat template's generation prompt
            ids = ids[-max_prompt_length:]
        flags.append(cut)
        prompts.append(value)
        all_ids.append(ids)
    columns = {k: [row.get(k) for row in rows] for k in names if k not in ("prompt", "prompt_ids")}
    return PromptSet(prompts, all_ids, columns, num_truncated=sum(flags), truncated=flags)


def _prompt_column(names: list[str], source: str) -> str:
    """'prompt' or 'prompt_ids': exactly one of them must be present."""
    if "prompt" in names and "prompt_ids" in names:
        raise DataError(f"{source} has both a 'prompt' and a 'prompt_ids' column: keep one (prompt for text or "
                        "chat messages, prompt_ids for token ids)")
    if "prompt" in names:
        return "prompt"
    if "prompt_ids" in names:
        return "prompt_ids"
    raise DataError(f"{source} has no 'prompt' column (found columns: {names}). Rename the column holding the "
                    "prompts to 'prompt' (a string or a chat message list), or give token ids in a "
                    "'prompt_ids' column for token-id tasks.")


def _is_missing(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _tokenize(prompt, where: str, tokenizer, data_cfg) -> list[int]:
    """Token ids of one `prompt` cell: a string, or a list of chat messages."""
    if _is_missing(prompt):
        raise DataError(f"{where}: the prompt is missing (empty cell / null): fill it in or drop the row")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    system = data_cfg.system_prompt
    if isinstance(prompt, str):
        if data_cfg.chat_template and has_template:
            messages = ([{"role": "system", "content": system}] if system else []) + \
                       [{"role": "user", "content": prompt}]
            return _apply_template(tokenizer, messages)
        text = f"{system}\n\n{prompt}" if system else prompt
        return list(tokenizer(text, add_special_tokens=True)["input_ids"])
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        messages = _check_messages(prompt, where)
        if not has_template:
            raise DataError(f"{where}: the prompt is a chat message list but the tokenizer has no chat "
                            "template: give plain string prompts, or use a tokenizer with a chat_template")
        if system and not any(m["role"] == "system" for m in messages):
            messages = [{"role": "system", "content": system}] + messages
        return _apply_template(tokenizer, messages)
    if isinstance(prompt, (list, tuple)) and prompt and all(_is_int(t) for t in prompt):
        raise DataError(f"{where}: the prompt is a list of token ids: put them in a 'prompt_ids' column")
    raise DataError(f"{where}: the prompt must be a string or a list of chat messages "
                    f"({{'role': ..., 'content': ...}}), got {type(prompt).__name__}: {str(prompt)[:80]!r}")


def _check_messages(messages, where: str) -> list[dict]:
    for j, m in enumerate(messages):
        if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), (str, list)):
            raise DataError(f"{where}: message {j} must have a string 'role' and a 'content' "
                            f"(string or list of parts), got {m!r}")
    # Columnar formats give every message every key seen in the column (None where absent): drop those.
    return [{k: v for k, v in m.items() if v is not None} for m in messages]


def _apply_template(tokenizer, messages: list[dict]) -> list[int]:
    # transformers 5.x returns a BatchEncoding by default (return_dict=True); 4.x returns the id list.
    # Asking for return_dict=False gives a list in both; the Mapping branch guards against other versions.
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    if hasattr(out, "keys"):
        out = out["input_ids"]
    return [int(t) for t in out]


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check_ids(ids, where: str, vocab_size: int | None) -> list[int]:
    """A `prompt_ids` cell: a non-empty list of ints in [0, vocab_size)."""
    if _is_missing(ids):
        raise DataError(f"{where}: prompt_ids is missing (empty cell / null): fill it in or drop the row")
    if not isinstance(ids, (list, tuple)) or not all(_is_int(t) for t in ids):
        raise DataError(f"{where}: prompt_ids must be a list of integers, got {str(ids)[:80]!r} "
                        "(CSV cannot hold lists: use .jsonl or .parquet)")
    if not ids:
        raise DataError(f"{where}: prompt_ids is empty")
    bad = [t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
    if bad:
        limit = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
        raise DataError(f"{where}: prompt_ids holds {bad[0]}, outside the model's vocabulary {limit}")
    return [int(t) for t in ids]


def split_eval(rows: list[dict], holdout: int) -> tuple[list[dict], list[dict]]:
    """(train_rows, eval_rows): the first `holdout` rows (before any shuffling) are held out for eval."""
    if holdout < 0:
        raise DataError(f"data.eval_holdout must be >= 0, got {holdout}")
    if holdout and holdout >= len(rows):
        raise DataError(f"data.eval_holdout={holdout} leaves no training rows (the data has {len(rows)}): "
                        "lower it, or give a separate data.eval_file")
    if isinstance(rows, Rows):  # each row keeps its name (line) in error messages
        return rows.sliced(holdout), rows.sliced(0, holdout)
    return rows[holdout:], rows[:holdout]


# --------------------------------------------------------------------------------------------- sampler
class PromptSampler:
    """Deterministic prompt order: a fresh seeded permutation each epoch (or in order when shuffle=False);
    resumable. Epoch e's order depends only on (seed, e), so a resumed run draws the same prompts."""

    def __init__(self, num_prompts: int, seed: int, shuffle: bool = True):
        if num_prompts < 1:
            raise DataError("no prompts to sample from")
        self.num_prompts, self.seed, self.shuffle = int(num_prompts), int(seed), bool(shuffle)
        self._epoch, self._position = 0, 0
        self._order: list[int] | None = None  # the current epoch's permutation, built on first use

    @property
    def epoch(self) -> int:
        return self._epoch

    def _permutation(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_prompts))
        import torch

        g = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_prompts, generator=g).tolist()

    def next_indices(self, k: int) -> list[int]:
        """The next k prompt indices; an epoch boundary inside the call continues into the next permutation."""
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        out: list[int] = []
        while len(out) < k:
            if self._position == self.num_prompts:
                self._epoch, self._position, self._order = self._epoch + 1, 0, None
            if self._order is None:
                self._order = self._permutation(self._epoch)
            take = min(k - len(out), self.num_prompts - self._position)
            out += self._order[self._position:self._position + take]
            self._position += take
        return out

    def state_dict(self) -> dict:
        return {"epoch": self._epoch, "position": self._position, "seed": self.seed,
                "num_prompts": self.num_prompts, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        """Continue where `state` left off; the checkpoint's seed and shuffle win so the order is unchanged."""
        if int(state["num_prompts"]) != self.num_prompts:
            raise DataError(f"the checkpoint's prompt sampler saw {state['num_prompts']} prompts but the data now "
                            f"has {self.num_prompts}: the dataset changed since the checkpoint. Resume with the "
                            "same data, or start a new run")
        self.seed = int(state.get("seed", self.seed))
        self.shuffle = bool(state.get("shuffle", self.shuffle))
        self._epoch, self._position, self._order = int(state["epoch"]), int(state["position"]), None
