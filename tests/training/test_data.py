"""Tests of lowmem_grpo.training.data: file loading, prompt tokenization and checks, eval split, prompt sampler."""

import json

import pytest

from lowmem_grpo.config import DataConfig
from lowmem_grpo.training.data import DataError, PromptSampler, build_prompt_set, load_rows, split_eval
from tests.optional import needs_datasets

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
ROWS = [{"prompt": "what is 1+1?", "answer": "2", "level": 1},
        {"prompt": "what is 2+3?", "answer": "5", "level": 2},
        {"prompt": "say hi", "answer": "hi", "level": 3}]


def _tokenizer(chat_template=TEMPLATE):
    """A character-level tokenizer built offline: one id per character, decode joins them back."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    for ch in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,:;?!+-=<>/_\n'\"":
        vocab.setdefault(ch, len(vocab))
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    tok.chat_template = chat_template
    return tok


@pytest.fixture(scope="module")
def tok():
    return _tokenizer()


def _build(rows, tok, max_len=512, **cfg):
    return build_prompt_set(rows, tok, DataConfig(**cfg), max_len, source="train.jsonl", vocab_size=50)


# ------------------------------------------------------------------------------------------- loading
def _write(path, fmt):
    import pandas as pd

    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    elif fmt == "json":
        path.write_text(json.dumps(ROWS))
    elif fmt == "csv":
        pd.DataFrame(ROWS).to_csv(path, index=False)
    elif fmt == "parquet":
        pd.DataFrame(ROWS).to_parquet(path)


@pytest.mark.parametrize("fmt", ["jsonl", *(pytest.param(f, marks=needs_datasets) for f in ("json", "csv", "parquet"))])
def test_load_rows_file_formats_round_trip(tmp_path, fmt):
    path = tmp_path / f"data.{fmt}"
    _write(path, fmt)
    assert load_rows(str(path)) == ROWS
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no cache files written next to the data


@needs_datasets
def test_load_rows_save_to_disk_folders(tmp_path):
    from datasets import Dataset, DatasetDict

    ds = Dataset.from_list(ROWS)
    ds.save_to_disk(str(tmp_path / "ds"))
    before = sorted(p.name for p in (tmp_path / "ds").iterdir())
    assert load_rows(str(tmp_path / "ds")) == ROWS
    assert sorted(p.name for p in (tmp_path / "ds").iterdir()) == before
    DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "dd"))
    assert load_rows(str(tmp_path / "dd")) == ROWS
    DatasetDict({"only": ds}).save_to_disk(str(tmp_path / "one"))
    assert load_rows(str(tmp_path / "one")) == ROWS
    DatasetDict({"a": ds, "b": ds}).save_to_disk(str(tmp_path / "two"))
    with pytest.raises(DataError, match=r"\['a', 'b'\]"):
        load_rows(str(tmp_path / "two"))


def test_load_rows_errors(tmp_path):
    with pytest.raises(DataError, match="not found"):
        load_rows(str(tmp_path / "missing.jsonl"))
    (tmp_path / "data.txt").write_text("hello")
    with pytest.raises(DataError, match=r"\.jsonl.*\.parquet"):
        load_rows(str(tmp_path / "data.txt"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"prompt": \n')
    with pytest.raises(DataError, match="bad.jsonl.*JSON"):
        load_rows(str(bad))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match="no rows|empty"):
        load_rows(str(tmp_path / "empty.jsonl"))


@needs_datasets
def test_load_rows_errors_of_the_datasets_formats(tmp_path):
    (tmp_path / "header.csv").write_text("prompt,answer\n")
    with pytest.raises(DataError, match="no rows"):
        load_rows(str(tmp_path / "header.csv"))
    (tmp_path / "plain_dir").mkdir()
    with pytest.raises(DataError, match="save_to_disk"):
        load_rows(str(tmp_path / "plain_dir"))


# ------------------------------------------------------------------------------------------- prompts
def test_columns_preserved_and_prompts_as_given(tok):
    ps = _build(ROWS, tok)
    assert len(ps) == 3 and ps.prompts == [r["prompt"] for r in ROWS]
    assert ps.columns == {"answer": ["2", "5", "hi"], "level": [1, 2, 3]}
    assert ps.num_truncated == 0


def test_missing_and_both_prompt_columns(tok):
    with pytest.raises(DataError) as e:
        _build([{"question": "q", "answer": "a"}], tok)
    assert "train.jsonl" in str(e.value) and "question" in str(e.value) and "prompt_ids" in str(e.value)
    with pytest.raises(DataError, match="both"):
        _build([{"prompt": "q", "prompt_ids": [3, 4]}], tok)


def test_chat_template_on_string_prompts(tok):
    ps = _build(ROWS[:1], tok)
    assert tok.decode(ps.prompt_ids[0]) == "<user>what is 1+1?<assistant>"
    ps = _build(ROWS[:1], tok, system_prompt="be brief")
    assert tok.decode(ps.prompt_ids[0]) == "<system>be brief<user>what is 1+1?<assistant>"


def test_message_list_prompts(tok):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
            {"role": "user", "content": "again"}]
    ps = _build([{"prompt": msgs}], tok, system_prompt="sys")
    assert tok.decode(ps.prompt_ids[0]) == "<system>sys<user>hi<assistant>yo<user>again<assistant>"
    assert ps.prompts == [msgs]
    own = [{"role": "system", "content": "mine"}] + msgs[:1]  # its own system message wins
    assert tok.decode(_build([{"prompt": own}], tok, system_prompt="sys").prompt_ids[0]) == \
        "<system>mine<user>hi<assistant>"
    with pytest.raises(DataError, match="index 1.*message 0"):
        _build([{"prompt": msgs}, {"prompt": [{"content": "no role"}]}], tok)
    with pytest.raises(DataError, match="no chat template"):
        _build([{"prompt": msgs}], _tokenizer(chat_template=None))


@needs_datasets
def test_message_list_from_parquet(tmp_path, tok):
    import pandas as pd

    msgs = [{"role": "user", "content": "hi"}]
    pd.DataFrame({"prompt": [msgs], "answer": ["x"]}).to_parquet(tmp_path / "m.parquet")
    ps = _build(load_rows(str(tmp_path / "m.parquet")), tok)
    assert tok.decode(ps.prompt_ids[0]) == "<user>hi<assistant>"


def test_plain_encoding_without_chat_template(tok):
    plain = _tokenizer(chat_template=None)
    assert plain.decode(_build(ROWS[2:], plain).prompt_ids[0]) == "say hi"
    assert plain.decode(_build(ROWS[2:], plain, system_prompt="sys").prompt_ids[0]) == "sys\n\nsay hi"
    # data.chat_template=false skips a template the tokenizer has.
    assert tok.decode(_build(ROWS[2:], tok, chat_template=False).prompt_ids[0]) == "say hi"
    with pytest.raises(DataError, match="index 0.*empty"):
        _build([{"prompt": ""}], plain)


def test_bad_prompt_values(tok):
    with pytest.raises(DataError, match="index 1.*missing"):
        _build([{"prompt": "a"}, {"prompt": None}], tok)
    with pytest.raises(DataError, match="index 0.*missing"):
        _build([{"prompt": float("nan")}], tok)
    with pytest.raises(DataError, match="index 0.*prompt_ids"):
        _build([{"prompt": [3, 4]}], tok)
    with pytest.raises(DataError, match="model.tokenizer: none"):
        _build(ROWS, None)


def test_prompt_ids_without_tokenizer():
    ps = _build([{"prompt_ids": [3, 4, 5], "target": 7}, {"prompt_ids": [49], "target": 8}], None)
    assert ps.prompt_ids == [[3, 4, 5], [49]] and ps.columns == {"target": [7, 8]}
    with pytest.raises(DataError, match=r"index 1.*50.*\[0, 50\)"):
        _build([{"prompt_ids": [3]}, {"prompt_ids": [3, 50]}], None)
    with pytest.raises(DataError, match="index 0.*-1"):
        _build([{"prompt_ids": [-1]}], None)
    with pytest.raises(DataError, match="index 0.*empty"):
        _build([{"prompt_ids": []}], None)
    with pytest.raises(DataError, match="index 0.*list of integers"):
        _build([{"prompt_ids": "[3, 4]"}], None)


def test_truncation_error_names_row_lengths_and_fixes():
    rows = [{"prompt_ids": [3] * 4}, {"prompt_ids": [3] * 9}]
    with pytest.raises(DataError) as e:
        _build(rows, None, max_len=6)
    msg = str(e.value)
    for part in ("index 1", "9 tokens", "max_prompt_length=6", "raise generation.max_prompt_length",
                 "data.prompt_truncation=left"):
        assert part.lower() in msg.lower(), part


def test_left_truncation_keeps_last_tokens_and_counts(tok):
    rows = [{"prompt_ids": list(range(3, 13))}, {"prompt_ids": [3, 4]}, {"prompt_ids": list(range(20, 30))}]
    ps = _build(rows, None, max_len=4, prompt_truncation="left")
    assert ps.prompt_ids == [[9, 10, 11, 12], [3, 4], [26, 27, 28, 29]]
    assert ps.num_truncated == 2
    assert ps.prompts[0] == list(range(3, 13))  # the prompt as given stays whole for rewards/logs
    # With a chat template, the generation prompt at the end survives.
    ps = _build(ROWS[:1], tok, max_len=15, prompt_truncation="left")
    assert tok.decode(ps.prompt_ids[0]) == "1+1?<assistant>"


def test_select_subsets_rows_in_order():
    rows = [{"prompt_ids": [3] * (i + 1), "k": i} for i in range(5)]
    ps = _build(rows, None, max_len=3, prompt_truncation="left")
    assert ps.num_truncated == 2
    sub = ps.select([4, 0, 2])
    assert len(sub) == 3 and sub.columns == {"k": [4, 0, 2]}
    assert sub.prompt_ids == [[3, 3, 3], [3], [3, 3, 3]] and sub.prompts[1] == [3]
    assert sub.num_truncated == 1


def test_split_eval():
    rows = [{"prompt": str(i)} for i in range(5)]
    train, held = split_eval(rows, 2)
    assert held == rows[:2] and train == rows[2:]
    assert split_eval(rows, 0) == (rows, [])
    with pytest.raises(DataError, match="eval_holdout"):
        split_eval(rows, 5)


# ------------------------------------------------------------------------------------------- sampler
def test_sampler_epochs_are_permutations_that_differ():
    s = PromptSampler(10, seed=1)
    e0, e1 = s.next_indices(10), s.next_indices(10)
    assert sorted(e0) == sorted(e1) == list(range(10))
    assert e0 != e1 and e0 != list(range(10))
    assert s.epoch == 1
    assert PromptSampler(10, seed=1).next_indices(20) == e0 + e1  # seeded; crosses the boundary in one call
    assert PromptSampler(10, seed=2).next_indices(10) != e0


def test_sampler_crossing_epochs_in_one_call():
    s = PromptSampler(4, seed=0)
    ref = PromptSampler(4, seed=0)
    full = ref.next_indices(4) + ref.next_indices(4) + ref.next_indices(4)
    got = s.next_indices(3) + s.next_indices(6) + s.next_indices(3)
    assert got == full and s.epoch == 2
    assert s.next_indices(0) == []


def test_sampler_resume_gives_identical_continuation():
    a = PromptSampler(7, seed=3)
    a.next_indices(5)
    a.next_indices(5)
    state = json.loads(json.dumps(a.state_dict()))  # survives a JSON checkpoint
    assert state["epoch"] == 1 and state["position"] == 3 and state["num_prompts"] == 7
    b = PromptSampler(7, seed=3)
    b.load_state_dict(state)
    assert b.next_indices(12) == a.next_indices(12) and b.epoch == a.epoch


def test_sampler_without_shuffle_and_changed_dataset():
    s = PromptSampler(3, seed=5, shuffle=False)
    assert s.next_indices(7) == [0, 1, 2, 0, 1, 2, 0]
    with pytest.raises(DataError, match="changed"):
        PromptSampler(4, seed=5).load_state_dict(s.state_dict())


@needs_datasets
@pytest.mark.parametrize("with_datasets", [True, False])
def test_a_bad_row_of_a_file_is_named_by_its_line_or_its_row_from_1(tmp_path, tok, monkeypatch, with_datasets):
    import pandas as pd
    if not with_datasets:  # the bare GPU image reads JSON lines without datasets
        monkeypatch.setitem(__import__("sys").modules, "datasets", None)
    path = tmp_path / "train.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n{"prompt": null}\n')  # a blank line 2
    with pytest.raises(DataError, match=r"train.jsonl line 4: the prompt is missing"):
        _build(load_rows(str(path)), tok)
    rows = load_rows(str(path))
    train, held_out = split_eval(rows, 1)  # the held-out rows move; each keeps its line
    with pytest.raises(DataError, match=r"line 4: the prompt is missing"):
        _build(train, tok)
    if with_datasets:
        pd.DataFrame({"prompt": ["a", None]}).to_parquet(tmp_path / "t.parquet")
        with pytest.raises(DataError, match=r"train.jsonl row 2: the prompt is missing"):
            _build(load_rows(str(tmp_path / "t.parquet")), tok)
