"""Safetensors reads and writes through ``dflash.io.weights``: what the OS refuses is an ``OSError`` naming the file."""

from __future__ import annotations

import errno

import pytest
import torch

from dflash.io.weights import load_safetensors, save_safetensors


def test_save_and_load_round_trip_with_metadata(tmp_path):
    path = tmp_path / "w.safetensors"
    save_safetensors({"a": torch.arange(6.0).reshape(2, 3)}, path, metadata={"step": "4"})
    assert torch.equal(load_safetensors(path)["a"], torch.arange(6.0).reshape(2, 3))


def test_a_refused_write_is_an_os_error_naming_the_file_not_a_safetensors_error(tmp_path):
    """safetensors words the OS's refusal in its own error ("... (os error 2) at path ..."); it comes out as the
    OSError it is, with the errno and the file the caller named (a folder removed under the writer here; a full disk
    is errno 28 the same way)."""
    path = tmp_path / "gone" / "model.safetensors"
    with pytest.raises(OSError) as raised:
        save_safetensors({"a": torch.zeros(4)}, path)
    assert type(raised.value) is FileNotFoundError and raised.value.errno == errno.ENOENT
    assert raised.value.filename == str(path)
    assert type(raised.value.__cause__).__name__ == "SafetensorError"
