"""load_target on the real SmolLM2-135M-Instruct: no raw transformers progress bars in the user's output."""

from __future__ import annotations

from huggingface_hub import utils as hub_utils
from transformers.utils import logging as hf_logging

from dflash.target.load import load_target


def test_load_target_prints_no_transformers_progress_bar_and_restores_the_switch(capfd):
    hf_logging.enable_progress_bar()
    loaded = load_target("default")
    captured = capfd.readouterr()
    assert loaded.identity.num_hidden_layers == 30
    assert "Loading weights" not in captured.err + captured.out
    assert "%|" not in captured.err  # no tqdm bar of any kind
    # The caller's choice is kept: bars stay enabled for anything else that uses transformers/huggingface_hub.
    assert hf_logging.is_progress_bar_enabled()
    assert not hub_utils.are_progress_bars_disabled()


def test_target_num_layers_reads_folders_and_gguf_headers_without_loading(tmp_path, target_path):
    from dflash.target.load import default_gguf_path, target_num_layers

    assert target_num_layers(default_gguf_path()) == 30  # the GGUF header's llama.block_count
    assert target_num_layers(target_path) == 30  # the converted folder's config.json
    (tmp_path / "vlm").mkdir()
    (tmp_path / "vlm" / "config.json").write_text('{"text_config": {"num_hidden_layers": 7}, "num_hidden_layers": 99}')
    assert target_num_layers(tmp_path / "vlm") == 7
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    assert target_num_layers(tmp_path / "broken") is None
    (tmp_path / "fake.gguf").write_bytes(b"GGUF but not really")
    assert target_num_layers(tmp_path / "fake.gguf") is None
