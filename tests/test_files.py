"""``dflash.files``: the one atomic file replacement (run records, reports, prompt files)."""

from __future__ import annotations

import pytest

from dflash.files import atomic_output, atomic_write_bytes, atomic_write_text


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "run.json"
    atomic_write_text(path, "old\n")
    with pytest.raises(RuntimeError, match="mid-write"), atomic_output(path) as handle:
        handle.write("new, partly")
        raise RuntimeError("mid-write")
    assert path.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json"]
    atomic_write_bytes(path, b"\x00new")
    assert path.read_bytes() == b"\x00new" and sorted(p.name for p in tmp_path.iterdir()) == ["run.json"]
    with pytest.raises(ValueError, match="mode must be"), atomic_output(path, "a"):
        pass
