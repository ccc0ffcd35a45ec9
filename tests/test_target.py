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


def _target_folder_with_a_pickle(tmp_path, target_path, *, with_safetensors: bool):
    """A transformers folder of the real target (config, tokenizer) whose ``pytorch_model.bin`` is a pickle that
    would write ``tmp_path / "ran"`` if it were ever unpickled."""
    import os
    import pickle
    import shutil

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'ran'}",))

    folder = tmp_path / "target"
    folder.mkdir()
    for file in target_path.iterdir():
        if file.suffix != ".safetensors":
            shutil.copy(file, folder / file.name)
        elif with_safetensors:
            (folder / file.name).symlink_to(file)
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps({"model.embed_tokens.weight": Payload()}))
    return folder


def test_a_target_folder_with_pickled_weights_only_is_refused_before_any_model_loads(tmp_path, target_path,
                                                                                     monkeypatch, capsys):  # fmt: skip
    from cli_helpers import main_in_process

    folder = _target_folder_with_a_pickle(tmp_path, target_path, with_safetensors=False)
    code, stderr = main_in_process(monkeypatch, capsys, "generate", "default", "--target", str(folder),
                                   "--output", str(tmp_path / "out"), "--max-prompts", "2")  # fmt: skip
    assert code == 2 and "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert lines == [f"error: target folder {folder} holds its weights as pickles (pytorch_model.bin), which are never "
                     "loaded (a pickle can run code); provide the weights as safetensors (model.safetensors, or the "
                     "sharded model-*.safetensors with their index), or a .gguf file"]
    assert not (tmp_path / "out").exists() and not (tmp_path / "ran").exists()


def test_a_target_folder_with_safetensors_loads_them_and_never_its_pickle(tmp_path, target_path):
    folder = _target_folder_with_a_pickle(tmp_path, target_path, with_safetensors=True)
    loaded = load_target(folder)
    assert loaded.identity.num_hidden_layers == 30
    assert not (tmp_path / "ran").exists()


def test_the_gguf_conversion_bar_becomes_log_lines_where_stderr_is_not_a_terminal(capsys, caplog):
    """transformers' GGUF loader draws its bar with plain tqdm (its progress-bar switch does not reach it): on a
    stderr that is not a terminal its redraws are left out, a line before and after says what runs, and every other
    write (a warning) still goes through."""
    import logging
    import sys

    from tqdm.auto import tqdm

    from dflash.target.load import _conversion_bar_as_log_lines

    with caplog.at_level(logging.INFO, logger="dflash.target.load"), _conversion_bar_as_log_lines("x.gguf"):
        for _ in tqdm(range(300), desc="Converting and de-quantizing GGUF tensors...", mininterval=0):
            pass
        print("a warning of the loader", file=sys.stderr)
    err = capsys.readouterr().err
    assert "Converting" not in err and "\r" not in err and err == "a warning of the loader\n"
    assert [r.getMessage() for r in caplog.records] == [
        "converting x.gguf into a transformers folder (once; ~15 s for the default target)", "converted x.gguf"]
