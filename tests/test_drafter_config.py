"""DFlashConfig: derived from the real SmolLM2 target, validated, mask token chosen among existing rows."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from drafter_fixtures import tiny_config

from dflash.drafter import DFlashConfig, select_mask_token_id
from dflash.errors import ConfigError


def test_from_real_target_config(target, tokenizer):
    config = DFlashConfig.from_target_config(target.model.config, tokenizer=tokenizer)
    assert (config.hidden_size, config.intermediate_size, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim, config.vocab_size, config.num_target_layers) == (576, 1536, 9, 3, 64, 49152, 30)
    assert config.num_hidden_layers == 5 and config.block_size == 16
    assert config.target_layer_ids == [1, 8, 14, 20, 27]  # round(1 + i * (30 - 4) / 4)
    assert config.rope_theta == 100000.0 and config.rope_scaling is None
    assert config.rms_norm_eps == pytest.approx(1e-5)
    assert DFlashConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


def test_smollm2_mask_token_is_an_unused_special_token(target, tokenizer):
    mask_id = select_mask_token_id(tokenizer, vocab_size=49152)
    assert tokenizer.convert_ids_to_tokens(mask_id) == "<empty_output>"
    assert mask_id < target.model.get_input_embeddings().weight.shape[0]
    assert mask_id not in {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}],
                                         tokenize=True)
    chat_ids = chat["input_ids"] if isinstance(chat, dict) or hasattr(chat, "keys") else chat
    assert mask_id not in list(chat_ids)


def test_mask_token_preferences_and_error():
    token = lambda content: SimpleNamespace(content=content, special=True)  # noqa: E731
    with_mask = SimpleNamespace(mask_token_id=7, added_tokens_decoder={})
    assert select_mask_token_id(with_mask, vocab_size=10) == 7
    pad_like = SimpleNamespace(mask_token_id=None, eos_token_id=0, chat_template="<|im_start|>",
                               added_tokens_decoder={0: token("<eos>"), 1: token("<|im_start|>"),
                                                     2: token("<|fim_pad|>"), 3: token("<other>")})
    assert select_mask_token_id(pad_like, vocab_size=10) == 2
    only_beyond_vocab = SimpleNamespace(mask_token_id=None, added_tokens_decoder={12: token("<x>")})
    with pytest.raises(ConfigError, match="mask_token_id"):
        select_mask_token_id(only_beyond_vocab, vocab_size=10)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("mask_token_id", 97, "mask_token_id"),
    ("mask_token_id", -1, "mask_token_id"),
    ("num_key_value_heads", 3, "num_key_value_heads"),
    ("target_layer_ids", [2, 1], "strictly increasing"),
    ("target_layer_ids", [0, 3], "never the last"),
    ("block_size", 1, "block_size"),
    ("hidden_size", 0, "hidden_size"),
])
def test_invalid_fields_name_the_field(field, value, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(**{field: value})


def test_from_dict_rejects_unknown_keys():
    data = tiny_config().to_dict() | {"bogus": 1}
    with pytest.raises(ConfigError, match="bogus"):
        DFlashConfig.from_dict(data)
