"""Start-up checks of the run's lengths and tokenizer against the model (lowmem_grpo/policy/limits.py):
learned positions refuse, RoPE warns once (rope_scaling raises the limit), ids past the embedding refuse;
in training and in evaluation (Trainer(training=False)), before the weights load."""

import json
import logging

import pytest
from transformers import AutoConfig

from lowmem_grpo.policy import model as model_module
from lowmem_grpo.policy.limits import ModelLimitError, check_positions, position_limit
from lowmem_grpo.training.trainer import Trainer

from .conftest import TINY_LLAMA

TINY_GPT2 = {"model_type": "gpt2", "vocab_size": 32, "n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 16,
             "bos_token_id": 1, "eos_token_id": 1}


@pytest.fixture
def no_weights(monkeypatch):
    """Fail if a model is built: the checks must come before the weights."""
    def refuse(*args, **kwargs):
        raise AssertionError("weights loaded before the check")
    monkeypatch.setattr("lowmem_grpo.training.setup.load_model", refuse)


@pytest.mark.parametrize("training", [True, False])
def test_learned_positions_past_their_table_are_refused(toy_config, no_weights, training):
    cfg = toy_config(f"model.config={json.dumps(TINY_GPT2)}", "max_prompt_length=10", "max_completion_length=10")
    with pytest.raises(ModelLimitError) as err:
        Trainer(cfg, training=training)
    msg = str(err.value)
    assert "10 + 10 = 20" in msg and "16 positions" in msg and "max_completion_length" in msg, msg


def test_learned_positions_within_their_table_run(toy_config):
    cfg = toy_config(f"model.config={json.dumps(TINY_GPT2)}", "max_prompt_length=8", "max_completion_length=8")
    Trainer(cfg, training=False)  # 16 = 16: fits


def test_rope_past_its_length_warns_once_with_the_numbers(toy_config, caplog):
    conf = dict(TINY_LLAMA, max_position_embeddings=12)
    cfg = toy_config(f"model.config={json.dumps(conf)}", "max_prompt_length=8", "max_completion_length=6")
    with caplog.at_level(logging.WARNING, logger="lowmem_grpo.policy.limits"):
        Trainer(cfg, training=False)
        Trainer(cfg, training=False)
    said = [r.getMessage() for r in caplog.records if "positions" in r.getMessage()]
    assert len(said) == 1, said
    assert "8 + 6 = 14" in said[0] and "12 positions" in said[0] and "not guaranteed" in said[0], said[0]


def test_rope_scaling_that_extends_the_context_is_counted(caplog):
    linear = AutoConfig.for_model("llama", max_position_embeddings=12,
                                  rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert position_limit(linear) == ("rope", 24)
    yarn = AutoConfig.for_model("qwen2", max_position_embeddings=32768,
                                rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                              "original_max_position_embeddings": 32768})
    assert position_limit(yarn) == ("rope", 131072)
    llama3 = AutoConfig.for_model("llama", max_position_embeddings=131072,  # the config states the extended length
                                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    assert position_limit(llama3) == ("rope", 131072)
    with caplog.at_level(logging.WARNING, logger="lowmem_grpo.policy.limits"):
        check_positions(linear, 12, 12, "scaled")
    assert not caplog.records


def test_position_kinds():
    assert position_limit(AutoConfig.for_model("gpt2", n_positions=1024)) == ("learned", 1024)
    assert position_limit(AutoConfig.for_model("opt", max_position_embeddings=2048)) == ("learned", 2048)
    assert position_limit(AutoConfig.for_model("bloom")) == ("none", None)  # ALiBi
    assert position_limit(AutoConfig.for_model("falcon", alibi=True)) == ("none", None)
    assert position_limit(AutoConfig.for_model("falcon", alibi=False)) == ("rope", 2048)


@pytest.mark.parametrize("training", [True, False])
def test_tokenizer_ids_past_the_embedding_are_refused(toy_config, no_weights, training):
    conf = dict(TINY_LLAMA, vocab_size=60)  # the character tokenizer has 100 ids
    cfg = toy_config(f"model.config={json.dumps(conf)}", "model.tokenizer=chars")
    with pytest.raises(ModelLimitError) as err:
        Trainer(cfg, training=training)
    msg = str(err.value)
    assert "ids up to 99" in msg and "60 embedding rows" in msg and "tokenizer" in msg, msg


def test_a_loaded_model_is_checked_by_its_embedding(toy_config):
    from lowmem_grpo.policy.char_tokenizer import char_tokenizer
    cfg = toy_config("model.tokenizer=chars")
    model = model_module.load_model(cfg.model, seed=0)  # vocab 32 < 100 ids
    with pytest.raises(ModelLimitError, match="32 embedding rows"):
        Trainer(cfg, training=False, model=model, tokenizer=char_tokenizer())
