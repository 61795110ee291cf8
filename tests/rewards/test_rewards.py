"""Reward layer: built-ins on hand-written cases, loading specs, and compute_rewards' checks."""

import math
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from lowmem_grpo.rewards.builtins import BUILTINS, parse_last_number
from tests.optional import needs_math_verify
from lowmem_grpo.rewards import (RewardError, RewardFunction, completion_text, compute_rewards,
                                 load_reward_functions, reward_metrics)


def builtin(spec):
    """Load one built-in spec; return its TRL-signature function."""
    [f] = load_reward_functions([spec])
    return f.fn


def chat(text):
    return [{"role": "assistant", "content": text}]


# ---------------------------------------------------------------- completion_text, numbers

def test_completion_text_forms():
    assert completion_text("hi") == "hi"
    assert completion_text([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a1"},
                            {"role": "assistant", "content": "a2"}]) == "a2"
    assert completion_text(chat([{"type": "text", "text": "x"}, {"type": "text", "text": "y"}])) == "xy"
    with pytest.raises(RewardError, match="no tokenizer.*completion_ids"):
        completion_text([5, 6, 7])


@pytest.mark.parametrize("text,value", [
    ("so 12 apples, then 1,234.", 1234.0), ("$1,234,567.89", 1234567.89), ("x = -5", -5.0),
    ("pages 3-5", 5.0), ("lost -$12", -12.0), ("costs 7.", 7.0), ("1,2,3", 3.0), ("a .5 b", 0.5),
    ("no digits", None),
])
def test_parse_last_number(text, value):
    assert parse_last_number(text) == value


# ---------------------------------------------------------------- built-ins

def test_regex_format():
    f = builtin({"name": "regex_format", "pattern": r"<think>.*</think>\s*<answer>.*</answer>"})
    good = "  <think>a\nb</think>\n<answer>4</answer>\n"  # DOTALL by default, surrounding space stripped
    assert f(prompts=["p"] * 3, completions=[good, "<answer>4</answer>", chat(good)]) == [1.0, 0.0, 1.0]
    search = builtin({"name": "regex_format", "pattern": "ANSWER", "full_match": False, "flags": "i"})
    assert search(prompts=["p", "p"], completions=["the answer: 3", "nope"]) == [1.0, 0.0]
    assert f.__name__ == "regex_format"


def test_numeric_answer():
    f = builtin("numeric_answer")
    comps = ["<answer>42</answer> but maybe 7",      # the tag beats the later number
             "I think it is 1,234.",                 # commas, trailing dot
             "The loss is -$3.50",                   # sign, dollar, decimals
             chat("so 18"),                          # conversational
             "<answer>none</answer> 18",             # tag without a number: no prediction
             "17", "17", "17"]
    answers = ["Nat sold 6 + 36 = 42 #### 42", "1234", -3.5, 18, "#### 18", None, "n/a", 17.0000001]
    assert f(prompts=["p"] * 8, completions=comps, answer=answers) == [1.0, 1.0, 1.0, 1.0, 0.0, None, None, 1.0]
    assert f(prompts=["p"], completions=["41"], answer=["#### 42"]) == [0.0]
    notag = builtin({"name": "numeric_answer", "tag": None, "answer_column": "gold"})
    assert notag(prompts=["p"], completions=["<answer>1</answer> 2"], gold=[2]) == [1.0]


def test_numeric_answer_missing_column():
    f = builtin("numeric_answer")
    with pytest.raises(RewardError, match=r"numeric_answer needs the dataset column 'answer'.*\['solution'\]"):
        f(prompts=["p"], completions=["1"], completion_ids=[[1]], solution=["1"])


def test_exact_match_modes_and_lists():
    f = builtin("exact_match")
    comps = ["  Paris! ", "\u201cNew   York\u201d", "paris is it", "Lyon", "x", "x"]
    answers = ["paris", "new york", "Paris", ["Marseille", "lyon"], None, ["", "  "]]
    assert f(prompts=["p"] * 6, completions=comps, answer=answers) == [1.0, 1.0, 0.0, 1.0, None, None]
    contains = builtin({"name": "exact_match", "mode": "contains"})
    assert contains(prompts=["p"] * 2, completions=["It is PARIS.", "Rome"], answer=["paris"] * 2) == [1.0, 0.0]
    raw = builtin({"name": "exact_match", "normalize": False})
    assert raw(prompts=["p"] * 2, completions=[" Paris\n", "paris"], answer=["Paris"] * 2) == [1.0, 0.0]


def test_exact_match_length_penalty():
    f = builtin({"name": "exact_match", "mode": "contains", "length_penalty": 0.1})
    # "the answer is paris" (19 chars) vs "paris" (5): extra 14 -> 1 - 0.1 * 14 / 5 = 0.72
    out = f(prompts=["p"] * 3, completions=["The answer is Paris.", "Paris", "Rome, not Paris"],
            answer=["Paris"] * 3)
    assert out[0] == pytest.approx(0.72) and out[1] == 1.0
    assert out[2] == pytest.approx(1 - 0.1 * 10 / 5)  # "rome, not paris": 15 chars, extra 10
    harsh = builtin({"name": "exact_match", "mode": "contains", "length_penalty": 1.0})
    assert harsh(prompts=["p"] * 2, completions=["The answer is Paris.", "Rome"], answer=["Paris"] * 2) == [0.0, 0.0]


def test_token_rules():
    ans = builtin({"name": "token_answer", "open_id": 3, "close_id": 4})
    ids = [[1, 3, 7, 4], [3, 7, 9, 4], [3, 8, 4], [3, 7], [3, 7, 4]]
    labels = [7, 7, 7, 7, None]
    assert ans(prompts=[[0]] * 5, completions=ids, completion_ids=ids, label=labels) == [1.0, 0.0, 0.0, 0.0, None]
    shaped = builtin({"name": "token_answer", "open_id": 3, "close_id": 4, "partial": 0.25})
    assert shaped(prompts=[[0]] * 5, completions=ids, completion_ids=ids, label=labels) == [1.0, 0.0, 0.25, 0.0, None]
    think = builtin({"name": "token_think", "open_id": 5, "close_id": 6})
    ids = [[5, 1, 6, 2], [5, 6], [1, 5, 6], [5, 1, 2], [5], []]
    assert think(prompts=[[0]] * 6, completions=ids, completion_ids=ids) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


def test_char_count():
    f = builtin({"name": "char_count", "per_char": 0.5, "max_reward": 2.0})
    assert f(prompts=["p"] * 3, completions=["eel", chat("eeeeee"), "xyz"]) == [1.0, 2.0, 0.0]
    with pytest.raises(RewardError, match="no tokenizer"):
        f(prompts=[[1]], completions=[[1, 2]], completion_ids=[[1, 2]])


@needs_math_verify
def test_math_verify():
    f = builtin("math_verify")
    comps = [r"So the answer is $\boxed{\frac{1}{2}}$", "0.5", "it is 8", "3"]
    answers = ["1/2", "The total is 0.5 #### 1/2", "#### 7", None]
    assert f(prompts=["p"] * 4, completions=comps, answer=answers) == [1.0, 1.0, 0.0, None]


# ---------------------------------------------------------------- loading

def test_load_by_name_dict_label_and_duplicates():
    funcs = load_reward_functions(["numeric_answer", {"name": "numeric_answer", "tag": "final"},
                                   {"name": "char_count", "label": "e_count", "char": "x"}],
                                  weights=[1, 0.5, 2])
    assert [f.name for f in funcs] == ["numeric_answer", "numeric_answer_2", "e_count"]
    assert [f.weight for f in funcs] == [1.0, 0.5, 2.0]
    assert funcs[1].fn(prompts=["p"], completions=["<final>3</final> 4"], answer=[3]) == [1.0]
    assert funcs[2].fn(prompts=["p"], completions=["xex"]) == [2.0]
    assert set(BUILTINS) >= {"regex_format", "numeric_answer", "exact_match", "token_answer", "token_think",
                             "char_count", "math_verify"}


def _write(path, body):
    path.write_text(textwrap.dedent(body))
    return path


def test_load_module_function(tmp_path, monkeypatch):
    _write(tmp_path / "my_rewards_mod.py", """
        def length(prompts, completions, scale=1.0, **kw):
            return [scale * len(c) for c in completions]
    """)
    monkeypatch.syspath_prepend(str(tmp_path))
    f, g = load_reward_functions(["my_rewards_mod:length", {"name": "my_rewards_mod:length", "scale": 2.0}])
    assert (f.name, g.name) == ("length", "length_2")
    assert f.fn(prompts=["p"], completions=["abc"]) == [3] and g.fn(prompts=["p"], completions=["abc"]) == [6.0]


def test_load_file_function_cwd_and_base_dir(tmp_path, monkeypatch):
    recipe_dir, other = tmp_path / "recipe", tmp_path / "elsewhere"
    recipe_dir.mkdir(), other.mkdir()
    _write(recipe_dir / "rw.py", "def one(prompts, completions, **kw):\n    return [1.0] * len(completions)\n")
    monkeypatch.chdir(other)
    [f] = load_reward_functions(["rw.py:one"], base_dir=recipe_dir)  # not in cwd: found via base_dir
    assert f.name == "one" and f.fn(prompts=["p"], completions=["c"]) == [1.0]
    monkeypatch.chdir(tmp_path)
    [f] = load_reward_functions(["recipe/rw.py:one"])  # relative to cwd
    assert f.fn(prompts=["p"], completions=["c"]) == [1.0]
    [f] = load_reward_functions([f"{recipe_dir / 'rw.py'}:one"])  # absolute
    assert f.name == "one"


def test_load_callable():
    def mine(prompts, completions, bonus=0.0, **kw):
        return [bonus] * len(completions)
    a, b = load_reward_functions([mine, {"name": mine, "bonus": 3.0, "label": "bonus"}])
    assert (a.name, b.name) == ("mine", "bonus") and b.fn(prompts=["p"], completions=["c"]) == [3.0]


@pytest.mark.parametrize("specs,weights,match", [
    (["numeric_anwser"], None, r"reward_funcs\[0\]: unknown built-in reward 'numeric_anwser'\. "
                               r"Did you mean 'numeric_answer'\?.*exact_match"),
    ([{"name": "exact_match", "mdoe": "contains"}], None, r"no option 'mdoe'; valid options: answer_column, mode"),
    (["regex_format"], None, r"'regex_format' needs 'pattern'"),
    ([{"name": "regex_format", "pattern": "(unclosed"}], None, r"regex_format.*invalid regular expression"),
    ([{"name": "exact_match", "mode": "fuzzy"}], None, r"exact_match.*mode must be 'exact' or 'contains'"),
    (["no_such_pkg_xyz.mod:f"], None, r"cannot import module 'no_such_pkg_xyz.mod'.*PYTHONPATH"),
    (["missing/file.py:f"], None, r"reward file 'missing/file.py' not found"),
    (["math:no_such_fn"], None, r"'math' has no attribute 'no_such_fn'"),
    (["math:pi"], None, r"'math:pi' is a float, not a function"),
    ([{"label": "x"}], None, r"needs a 'name' key"),
    ([42], None, r"reward_funcs\[0\]: expected a built-in name"),
    ([], None, r"no reward functions configured"),
    (["numeric_answer", "char_count"], [1.0], r"reward_weights has 1 values for 2 reward functions"),
    (["numeric_answer"], [float("inf")], r"reward_weights\[0\] = inf is not a finite number"),
    (["numeric_answer"], ["1"], r"reward_weights\[0\] = '1' is not a finite number"),
])
def test_load_errors(specs, weights, match):
    with pytest.raises(RewardError, match=match):
        load_reward_functions(specs, weights)


def test_load_file_errors_show_paths_tried(tmp_path):
    with pytest.raises(ValueError, match=r"not found \(looked at: .*nope\.py, .*base.*nope\.py\)"):
        load_reward_functions(["nope.py:f"], base_dir=tmp_path / "base")  # RewardError is a ValueError too
    _write(tmp_path / "broken.py", "raise ImportError('needs foo')\n")
    with pytest.raises(RewardError, match=r"running .*broken\.py' failed: ImportError: needs foo"):
        load_reward_functions([f"{tmp_path / 'broken.py'}:f"])


# ---------------------------------------------------------------- compute_rewards

def _const(values, name="const"):
    def f(prompts, completions, **kw):
        return values
    return RewardFunction(name=name, fn=f, weight=1.0)


def test_compute_rewards_weights_none_and_passthrough():
    seen = {}

    def spy(prompts, completions, completion_ids, answer, level):
        seen.update(prompts=prompts, completion_ids=completion_ids, answer=answer, level=level)
        return [1.0, None, 0.5]

    funcs = [RewardFunction("spy", spy, 2.0), RewardFunction("other", _const([None, None, 1.0]).fn, -1.0)]
    cols = {"answer": ["a", "a", "b"], "level": [1, 1, 2]}
    ids = [[1], [2, 3], []]
    per_func, total = compute_rewards(funcs, ["p1", "p1", "p2"], ["x", "y", "z"], ids, cols)
    assert seen == {"prompts": ["p1", "p1", "p2"], "completion_ids": ids, "answer": ["a", "a", "b"], "level": [1, 1, 2]}
    assert per_func.dtype == torch.float32 and per_func.shape == (3, 2)
    assert torch.isnan(per_func[1]).all() and torch.isnan(per_func[0, 1])
    assert total.tolist() == [2.0, 0.0, 0.0]  # 2*1; all None -> 0; 2*0.5 - 1*1
    m = reward_metrics(funcs, per_func, total)
    assert m["rewards/spy/mean"] == 0.75 and m["rewards/spy/std"] == pytest.approx(math.sqrt(0.125))
    assert m["rewards/other/mean"] == 1.0 and m["rewards/other/std"] == 0.0
    assert m["reward"] == pytest.approx(1.0)  # the mean of 2.0 and 0.0: row 1 (every function None) is left out
    assert m["reward_std"] == pytest.approx(math.sqrt(2.0))


def test_compute_rewards_accepts_arrays_and_all_none_metric():
    funcs = [_const(np.array([1.0, 2.0]), "np"), _const(torch.tensor([0.0, 1.0]), "pt"), _const((None, None), "nil")]
    per_func, total = compute_rewards(funcs, ["p", "q"], ["a", "b"], [[1], [2]], {})
    assert total.tolist() == [1.0, 3.0]
    assert math.isnan(reward_metrics(funcs, per_func, total)["rewards/nil/mean"])


def test_compute_rewards_raise_names_function_and_sample():
    def picky(prompts, completions, **kw):
        return [1.0 / len(c) for c in completions]  # ZeroDivisionError on the empty completion

    with pytest.raises(RewardError, match=r"(?s)'picky' raised ZeroDivisionError: float division by zero.*"
                                          r"sample 1:.*prompt: +'second prompt'.*completion: ''") as ei:
        compute_rewards([RewardFunction("picky", picky, 1.0)], ["first", "second prompt"], ["ok", ""],
                        [[1], []], {})
    assert isinstance(ei.value.__cause__, ZeroDivisionError)


@pytest.mark.parametrize("values,match", [
    (0.5, r"'bad' returned a float .*must return a list"),
    ([1.0] * 5, r"'bad' returned 5 values for 3 completions"),
    ([1.0, "1.0", 0.0], r"(?s)'bad' returned '1\.0' \(str\) for completion 1.*real number or None.*"
                        r"prompt: +'p1'.*completion: +'c1'"),
    ([1.0, 0.0, float("nan")], r"(?s)'bad' returned nan for completion 2.*return None.*completion: +'c2'"),
    ([float("inf"), 0.0, 0.0], r"'bad' returned inf for completion 0.*return None"),
    ([1e39, 0.0, 0.0], r"'bad' returned 1e\+39 for completion 0, which is not finite in float32"),
    (np.zeros((3, 1)), r"'bad' returned an array of shape \(3, 1\)"),
])
def test_compute_rewards_bad_returns(values, match):
    with pytest.raises(RewardError, match=match):
        compute_rewards([_const(values, "bad")], ["p0", "p1", "p2"], ["c0", "c1", "c2"], [[0], [1], [2]], {})


def test_compute_rewards_missing_column_and_clash():
    with pytest.raises(RewardError, match=r"'numeric_answer' raised RewardError: numeric_answer needs .*'answer'"):
        compute_rewards(load_reward_functions(["numeric_answer"]), ["p"], ["1"], [[1]], {"gold": ["1"]})
    with pytest.raises(RewardError, match=r"clash"):
        compute_rewards([_const([1.0])], ["p"], ["c"], [[1]], {"completions": ["x"]})
    with pytest.raises(ValueError, match=r"'answer' has 2 entries for 1 completions"):
        compute_rewards([_const([1.0])], ["p"], ["c"], [[1]], {"answer": ["x", "y"]})


def test_long_samples_are_truncated():
    long_prompt = "S" * 1000 + "QUESTION"
    with pytest.raises(RewardError) as ei:
        compute_rewards([_const(["x"], "t")], [long_prompt], ["c" * 5000], [[1]], {})
    msg = str(ei.value)
    assert "QUESTION" in msg and "[1008 chars]" in msg and "[5000 chars]" in msg and len(msg) < 800


def test_evaluation_gives_no_pass_rate_for_a_reward_model(tmp_path):
    """A reward model's score has no pass mark: evaluation reports its mean, and a pass rate only for the
    functions (whose >= 1 is accuracy for 0/1 rewards)."""
    from lowmem_grpo.config import load_config
    from lowmem_grpo.training.trainer import Trainer
    from tests.rewards.tiny_reward_models import random_reward_model
    root = Path(__file__).resolve().parents[2]
    model, tok = random_reward_model(tmp_path / "rm")
    cfg = load_config(str(root / "recipes" / "char_e.yaml"), [
        f"rewards.reward_funcs=['{model}', char_count]", f"rewards.reward_processing_classes=['{tok}', null]",
        f"output.output_dir={tmp_path / 'run'}", "train.device=cpu"])
    result = Trainer(cfg, recipe_dir=root / "recipes", training=False).evaluate()
    names = [k for k in result if k.startswith("rewards/")]
    assert len(names) == 2 and all(result[k] is not None for k in names)
    assert [k for k in result if k.startswith("pass_rate/")] == ["pass_rate/char_count"]
