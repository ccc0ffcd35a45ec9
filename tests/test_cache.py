"""Tests of the hidden-state cache (dflash/cache/, stages/cache_cmd.py): bit-exact bf16 storage, fp8, commit
semantics, corruption detection naming the shard, duplicate rows, the ``cache info``/``cache verify`` commands.

Hidden states are real: SmolLM2-135M-Instruct (the ``target`` fixture) run on short stdlib docstrings, tapping the
DFlash default layers. Special bf16 values (subnormals, infinities, NaN payloads, -0.0) use synthetic bit patterns.
"""

from __future__ import annotations

import collections
import functools
import json
import os
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from dflash.cache import (
    CacheMetadata,
    CacheReader,
    HiddenSample,
    HiddenStateCache,
    find_nonfinite_layers,
    quarantine_record,
    verify_cache,
)
from dflash.errors import CacheCorruptError, CacheError, ConfigError
from dflash.target.taps import LAYER_ID_CONVENTION, default_target_layer_ids

NUM_TAPS = 3


@pytest.fixture(scope="module")
def real_samples(target):
    """Six samples of real SmolLM2 hidden states (bf16, taps concatenated) on stdlib docstrings."""
    texts = [
        json.__doc__[:300],
        textwrap.__doc__,
        collections.__doc__[:400],
        functools.__doc__ or "functools",
        textwrap.dedent.__doc__[:250],
        json.dumps.__doc__[:350],
    ]
    layer_ids = default_target_layer_ids(target.identity.num_hidden_layers, NUM_TAPS)
    samples = []
    # One thread: on the shared 2-core CI box, two OpenMP threads spin against other jobs and run ~20x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for row, text in enumerate(texts):
            input_ids = target.tokenizer(text, return_tensors="pt").input_ids[0]
            with torch.no_grad():
                # The base model only: hidden states need no LM head.
                states = target.model.model(input_ids[None], output_hidden_states=True).hidden_states
            hidden = torch.cat([states[layer_id + 1][0] for layer_id in layer_ids], dim=-1).to(torch.bfloat16)
            loss_mask = (torch.arange(len(input_ids)) >= len(input_ids) // 2).to(torch.uint8)
            samples.append(HiddenSample(row, input_ids.to(torch.int32), loss_mask, hidden))
    finally:
        torch.set_num_threads(threads)
    return layer_ids, samples


def _metadata(target, layer_ids, shard_rows, **overrides) -> CacheMetadata:
    fields = dict(
        target=target.identity.to_dict(),
        target_spec="default",
        target_layer_ids=layer_ids,
        layer_id_convention=LAYER_ID_CONVENTION,
        hidden_size=target.identity.hidden_size,
        num_taps=len(layer_ids),
        corpus_fingerprint="sha256:" + "ab" * 32,
        corpus_path="stdlib-docstrings",
        num_shards=len(shard_rows),
        shard_rows=shard_rows,
        chunk_tokens=32,  # several chunks per shard with these short samples
    )
    fields.update(overrides)
    return CacheMetadata(**fields)


@pytest.fixture
def written(tmp_path, target, real_samples):
    """A complete two-shard bf16 cache of the real samples: rows [0, 3) and [3, 6)."""
    layer_ids, samples = real_samples
    cache = HiddenStateCache.create(tmp_path / "cache", _metadata(target, layer_ids, [[0, 3], [3, 6]]))
    cache.write_shard(0, samples[:3], [])
    cache.write_shard(1, samples[3:], [])
    return tmp_path / "cache", samples


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.int16)


def test_bf16_special_values_round_trip_bit_exact(tmp_path, target):
    hidden_size = 16
    patterns = [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0x7F81, 0xFF81, 0x7FFF, 0xFFFF, 0x7FA5, 0x0001, 0x8001, 0x007F, 0x807F, 0x0080, 0x7F7F, 0xFF7F]
    patterns += list(range(0x0001, 0x0080, 3)) + list(range(0x8001, 0x8080, 5))  # positive and negative subnormals
    generator = np.random.default_rng(0)
    bits = np.array(patterns * 4, dtype=np.uint16)
    bits = np.concatenate([bits, generator.integers(0, 1 << 16, size=hidden_size * 40 - len(bits) % hidden_size, dtype=np.uint16)])
    bits = bits[: len(bits) // hidden_size * hidden_size].reshape(-1, hidden_size)
    hidden = torch.from_numpy(bits.copy()).view(torch.bfloat16)
    assert torch.isnan(hidden).any() and torch.isinf(hidden).any() and (hidden == 0).any()
    sample = HiddenSample(0, torch.arange(len(hidden), dtype=torch.int32), torch.ones(len(hidden), dtype=torch.uint8), hidden)
    meta = _metadata(target, [4], [[0, 1]], hidden_size=hidden_size, num_taps=1, chunk_tokens=8)
    HiddenStateCache.create(tmp_path / "c", meta).write_shard(0, [sample], [])
    (back,) = CacheReader(tmp_path / "c").read_shard(0)
    assert back.hidden.dtype == torch.bfloat16
    assert torch.equal(_bits(back.hidden), _bits(hidden))
    assert verify_cache(tmp_path / "c")["complete"]


def test_real_hidden_states_round_trip_and_lengths(written, target, real_samples):
    path, samples = written
    reader = CacheReader(path)
    assert reader.shards == [0, 1]
    assert reader.metadata.target == target.identity.to_dict()
    assert reader.metadata.target_layer_ids == real_samples[0]
    assert reader.shard_lengths(1).tolist() == [len(s) for s in samples[3:]]
    assert reader.shard_corpus_rows(1).tolist() == [3, 4, 5]
    for shard in reader.shards:
        for got, want in zip(reader.read_shard(shard), samples[3 * shard : 3 * shard + 3], strict=True):
            assert got.corpus_row == want.corpus_row
            assert got.input_ids.dtype == torch.int32 and torch.equal(got.input_ids, want.input_ids)
            assert got.loss_mask.dtype == torch.uint8 and torch.equal(got.loss_mask, want.loss_mask)
            assert torch.equal(_bits(got.hidden), _bits(want.hidden))
    subset = reader.read_shard(0, [2, 0])
    assert [s.corpus_row for s in subset] == [2, 0]
    assert torch.equal(_bits(subset[0].hidden), _bits(samples[2].hidden))
    report = verify_cache(path)
    assert report["complete"] and report["num_samples"] == 6
    assert report["num_tokens"] == sum(len(s) for s in samples)


def test_a_cache_without_the_final_tap_records_nothing_of_it_and_refuses_a_final_tap_reader(written, target):
    """The metadata of a cache without the final tap is what it was before the final tap existed (no key), its
    rows stay n*H wide, and a reader asking for the final tap is refused naming the extract setting."""
    path, samples = written
    reader = CacheReader(path)
    assert "final_tap" not in reader.metadata.to_dict() and not reader.metadata.final_tap
    assert reader.metadata.row_width == reader.metadata.num_taps * reader.metadata.hidden_size
    assert torch.equal(reader.read_shard(0)[0].hidden, samples[0].hidden)
    with pytest.raises(ConfigError, match=r"has no final tap .*extract --final-tap"):
        CacheReader(path, final_tap=True)


def test_fp8_round_trip_within_tolerance_and_marked(tmp_path, target, real_samples):
    layer_ids, samples = real_samples
    meta = _metadata(target, layer_ids, [[0, 6]], storage_dtype="float8_e4m3fn")
    HiddenStateCache.create(tmp_path / "fp8", meta).write_shard(0, samples, [])
    reader = CacheReader(tmp_path / "fp8")
    assert reader.metadata.storage_dtype == "float8_e4m3fn" and reader.metadata.to_dict()["lossy"] is True
    for got, want in zip(reader.read_shard(0), samples, strict=True):
        assert got.hidden.dtype == torch.bfloat16
        want_taps = want.hidden.float().reshape(len(want), NUM_TAPS, -1)
        error = (got.hidden.float().reshape(len(want), NUM_TAPS, -1) - want_taps).abs()
        amax = want_taps.abs().amax(dim=-1, keepdim=True)
        # e4m3 has 3 mantissa bits: |error| <= 2**-4 * |x| for normals, plus the subnormal step of the scale.
        assert torch.all(error <= want_taps.abs() / 16 + amax / 448 * 2**-6 + 1e-6)
        assert not torch.equal(got.hidden, want.hidden)  # it is lossy, and says so
    info = json.loads(_cli(["cache", "info", str(tmp_path / "fp8"), "--json"]).stdout)
    assert info["metadata"]["storage_dtype"] == "float8_e4m3fn"
    # Bytes per token as extract's report computes it (stored shard bytes / tokens, rounded to a whole byte).
    assert info["bytes_per_token"] == info["stored_bytes"] / info["num_tokens"]
    shown = f"{info['stored_bytes'] / info['num_tokens']:,.0f}"
    table = _cli(["cache", "info", str(tmp_path / "fp8")]).stdout
    assert [" ".join(line.strip("│ ").split()) for line in table.splitlines() if "bytes per token" in line] == [
        f"stored bytes per token │ {shown}"]


def test_uncommitted_shard_is_not_counted_and_is_redone_cleanly(tmp_path, target, real_samples):
    layer_ids, samples = real_samples
    path = tmp_path / "cache"
    cache = HiddenStateCache.create(path, _metadata(target, layer_ids, [[0, 3], [3, 6]]))
    first = cache.write_shard(0, samples[:3], [])
    # A killed attempt at shard 1: arrays written, commit record never written, plus a stray chunk.
    cache.write_shard(1, samples[3:], [])
    os.remove(path / "commits" / "shard-000001.json")
    stray = path / "shards" / "000001" / "hidden" / "c" / "999" / "0"
    stray.parent.mkdir(parents=True)
    stray.write_bytes(b"partial")
    assert cache.committed_shards() == {0}
    reader = CacheReader(path)
    assert reader.shards == [0]
    with pytest.raises(CacheError, match="shard 1 .* not committed"):
        reader.read_shard(1)
    report = verify_cache(path)
    assert not report["complete"] and report["uncommitted_shards"] == [1] and report["stray_shards"] == [1]
    assert report["num_samples"] == 3
    # Rerun: shard 0 is skipped (no double counting), shard 1 is redone from scratch.
    reopened = HiddenStateCache.create(path, _metadata(target, layer_ids, [[0, 3], [3, 6]]))
    again = reopened.write_shard(0, samples[:3], [])
    assert again["already_committed"] and again["digest"] == first["digest"]
    reopened.write_shard(1, samples[3:], [])
    assert not stray.exists()
    report = verify_cache(path, require_complete=True)
    assert report["complete"] and report["num_samples"] == 6 and report["stray_shards"] == []
    assert reopened.finalize()["num_samples"] == 6


def test_resume_refuses_a_different_plan(tmp_path, target, real_samples):
    layer_ids, _ = real_samples
    HiddenStateCache.create(tmp_path / "c", _metadata(target, layer_ids, [[0, 3], [3, 6]]))
    with pytest.raises(CacheError, match="shard_rows"):
        HiddenStateCache.create(tmp_path / "c", _metadata(target, layer_ids, [[0, 6]]))
    with pytest.raises(ConfigError, match="shard_rows\\[1\\]"):
        _metadata(target, layer_ids, [[0, 4], [3, 6]])


@pytest.mark.parametrize("damage", ["delete", "flip"])
def test_damaged_chunk_fails_verify_and_reader_naming_the_shard(written, damage):
    path, samples = written
    chunk = Path(path) / "shards" / "000001" / "hidden" / "c" / "1" / "0"
    if damage == "delete":
        chunk.unlink()
    else:
        data = bytearray(chunk.read_bytes())
        data[len(data) // 2] ^= 0x04
        chunk.write_bytes(bytes(data))
    with pytest.raises(CacheCorruptError, match=r"shard 1 .*'hidden'.*c/1/0\b") as caught:
        verify_cache(path)
    assert "c/1/..." not in str(caught.value)  # the chunk key whole
    reader = CacheReader(path)
    reader.read_shard(0)  # the other shard stays readable
    with pytest.raises(CacheCorruptError, match=r"shard 1 .*'hidden'"):
        reader.read_shard(1)
    result = _cli(["cache", "verify", str(path)])
    assert result.exit_code == 1 and "CORRUPT: shard 1 of" in result.output and "shard 0 of" not in result.output
    # Withdraw the bad shard; the rerun redoes it and the cache is whole again.
    assert _cli(["cache", "verify", str(path), "--uncommit-corrupt"]).exit_code == 1
    assert CacheReader(path).shards == [0]
    HiddenStateCache.open(path).write_shard(1, samples[3:], [])
    assert _cli(["cache", "verify", str(path)]).exit_code == 0


def test_verify_names_whole_chunk_keys_of_one_dimensional_arrays(written):
    path, _ = written
    chunk = Path(path) / "shards" / "000000" / "input_ids" / "c" / "0"
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x04
    chunk.write_bytes(bytes(data))
    with pytest.raises(CacheCorruptError, match=r"shard 0 .*array 'input_ids' chunk c/0 fails to decode"):
        verify_cache(path)


def test_temporaries_of_a_killed_write_are_reported_by_verify(written):
    path, _ = written
    (Path(path) / "zarr.0123abcd.partial").write_text("{")  # a kill between zarr's temporary file and its rename
    (Path(path) / "commits" / "shard-000001.4567ef.partial").write_text("{")
    report = verify_cache(path)
    assert report["ok"] and report["partial_files"] == ["commits/shard-000001.4567ef.partial", "zarr.0123abcd.partial"]
    result = _cli(["cache", "verify", str(path)])
    assert result.exit_code == 0, result.output
    assert "2 temporary file(s) of an interrupted write (ignored, removed by the next extract run): " \
        "commits/shard-000001.4567ef.partial, zarr.0123abcd.partial" in " ".join(result.output.split())


def test_altered_or_swapped_chunk_caught_by_chunk_digest(tmp_path, target, real_samples):
    """Version-3 digest: a bit flipped mid-array and re-encoded with a valid chunk checksum, or a valid chunk copied
    over another, fails verify naming the shard, the array and the chunk; editing the recorded leaf to match breaks
    the root instead; the other shard stays sound."""
    import shutil

    import zarr

    layer_ids, samples = real_samples
    path = tmp_path / "seg"
    cache = HiddenStateCache.create(path, _metadata(target, layer_ids, [[0, 3], [3, 6]], chunk_tokens=16))
    cache.write_shard(0, samples[:3], [])
    record = cache.write_shard(1, samples[3:], [])
    leaves = record["arrays"]["hidden"]["crc32c_chunks"]
    assert record["digest_version"] == 3 and record["digest"].startswith("sha256-tree:")
    assert len(leaves) == record["arrays"]["hidden"]["num_chunks"] > 8 and all(len(leaf) == 8 for leaf in leaves)
    assert verify_cache(path, require_complete=True)["ok"]
    shard_dir = path / "shards" / "000001" / "hidden"
    hidden = zarr.open_array(str(shard_dir), mode="r+")
    rows, width = hidden.shape
    row, col = rows // 2, width // 2
    value = hidden[row, col]
    hidden[row, col] = np.uint16(value ^ 0x0100)  # zarr re-encodes the chunk with a valid crc32c
    chunk = row // 16
    with pytest.raises(CacheCorruptError, match=rf"shard 1 .*array 'hidden' chunk c/{chunk}/0 .*commit record says"):
        verify_cache(path)
    report = verify_cache(path, fail_fast=False)
    assert sorted(report["corrupt_shards"]) == [1] and report["num_samples"] == 3
    hidden[row, col] = value
    assert verify_cache(path)["ok"]
    # A valid chunk copied over another one (same shape, valid checksum) is a leaf mismatch too.
    original = (shard_dir / "c" / "2" / "0").read_bytes()
    shutil.copyfile(shard_dir / "c" / "1" / "0", shard_dir / "c" / "2" / "0")
    with pytest.raises(CacheCorruptError, match=r"shard 1 .*array 'hidden' chunk c/2/0 "):
        verify_cache(path)
    (shard_dir / "c" / "2" / "0").write_bytes(original)
    # A flipped stored byte (no valid checksum) is named as a checksum failure.
    (shard_dir / "c" / "3" / "0").write_bytes(bytes([original[0] ^ 1]) + (shard_dir / "c" / "3" / "0").read_bytes()[1:])
    with pytest.raises(CacheCorruptError, match=r"shard 1 .*chunk c/3/0 .*crc32c"):
        verify_cache(path)
    # Editing the recorded leaf to match a changed chunk breaks the root digest over the leaves.
    cache.uncommit(1)
    record = cache.write_shard(1, samples[3:], [])
    commit = path / "commits" / "shard-000001.json"
    stored = json.loads(commit.read_text())
    stored["arrays"]["hidden"]["crc32c_chunks"][0] = "00000000"
    commit.write_text(json.dumps(stored))
    with pytest.raises(CacheCorruptError, match=r"shard 1 .*'hidden' chunk c/0/0 "):
        verify_cache(path)


def test_integrity_check_before_training_catches_swapped_missing_and_edited_without_decoding(written, monkeypatch):
    """``check_cache`` (the trainer's check before step 1): a hidden chunk swapped in from the other shard (a valid
    chunk with its own valid crc32c), a deleted chunk, a truncated chunk and an edited commit record are refused
    naming the shard and the chunk, and no hidden chunk is decoded; the reader refuses the swapped chunk at read time
    too. A bit flip inside a chunk keeps its trailer: the check passes and the reader's decode catches it."""
    import shutil

    from dflash.cache.integrity import check_cache

    path, _ = written
    assert check_cache(CacheReader(path))["num_samples"] == 6
    mine, theirs = path / "shards" / "000001" / "hidden" / "c" / "1" / "0", path / "shards" / "000000" / "hidden" / "c" / "1" / "0"
    original = mine.read_bytes()

    decoded_rows = CacheReader._decoded_rows

    def no_hidden_decoding(self, shard, name, *args, **kwargs):
        assert name != "hidden", "the check before step 1 decoded a hidden chunk"
        return decoded_rows(self, shard, name, *args, **kwargs)

    def no_zarr(*args, **kwargs):
        raise AssertionError("the check before step 1 decoded a chunk through zarr")

    shutil.copyfile(theirs, mine)
    with monkeypatch.context() as patch:
        patch.setattr(CacheReader, "_decoded_rows", no_hidden_decoding)
        patch.setattr(CacheReader, "_read", no_zarr)
        with pytest.raises(CacheCorruptError, match=r"shard 1 .*array 'hidden' chunk 1 \(c/1/0, rows 32\.\.64\) ends with crc32c "
                                                    r"\w{8}, the commit record says \w{8}; the chunk was swapped"):
            check_cache(CacheReader(path))
    with pytest.raises(CacheCorruptError, match=r"shard 1 .*chunk 1 .*has crc32c \w{8}, the commit record says"):
        CacheReader(path).read_shard(1)  # the reader alone refuses it too (no check_cache first)
    mine.write_bytes(original[: len(original) // 2])
    with pytest.raises(CacheCorruptError, match=r"shard 1 .*chunk 1 .*swapped, replaced or truncated"):
        check_cache(CacheReader(path))
    mine.unlink()
    with pytest.raises(CacheCorruptError, match=r"shard 1 .*chunk 1 .*is missing"):
        check_cache(CacheReader(path))
    flipped = bytearray(original)
    flipped[len(flipped) // 2] ^= 0x10
    mine.write_bytes(bytes(flipped))
    check_cache(CacheReader(path))  # the trailer is intact: only decoding the chunk can tell
    with pytest.raises(CacheCorruptError, match=r"shard 1 .*chunk 1 .*fails its crc32c checksum"):
        CacheReader(path).read_shard(1)
    mine.write_bytes(original)
    commit = path / "commits" / "shard-000000.json"
    record = json.loads(commit.read_text())
    record["arrays"]["input_ids"]["sha256_segments"][0] = "0" * 64
    commit.write_text(json.dumps(record))
    with pytest.raises(CacheCorruptError, match=r"shard 0 .*does not match its own leaves.*the record was edited"):
        check_cache(CacheReader(path))


def test_integrity_check_refuses_an_incomplete_cache_unless_allowed(written):
    from dflash.cache.integrity import check_cache

    path, _ = written
    (path / "commits" / "shard-000001.json").unlink()
    with pytest.raises(CacheError, match=r"is incomplete: 1 of 2 planned shards have no commit record \(first: \[1\]; "
                                         r"3 of 6 corpus rows\), so training would see 3 samples instead of about 6; "
                                         r"rerun `dflash-stages extract`.*--allow-incomplete"):
        check_cache(CacheReader(path))
    report = check_cache(CacheReader(path), allow_incomplete=True)
    assert report["num_samples"] == 3 and report["uncommitted_shards"] == [1] and report["planned_rows"] == 6


def test_reader_refuses_a_small_array_that_differs_from_its_record(written):
    """input_ids rewritten with valid zarr checksums (another sample's tokens) differ from the record's sha256."""
    import zarr

    path, _ = written
    ids = zarr.open_array(str(path / "shards" / "000000" / "input_ids"), mode="r+")
    ids[0] = ids[0] + 1
    with pytest.raises(CacheCorruptError, match=r"shard 0 .*array 'input_ids' segment 0 has a sha256 that differs"):
        CacheReader(path).read_shard(0)
    CacheReader(path).read_shard(1)


def test_verify_reads_older_digest_versions(written):
    """Caches written with the version-2 (sha256 segments of every array) or version-1 (one sha256 stream) digest
    still verify; a changed byte is still caught; an unknown version is refused by name."""
    import hashlib

    import zarr

    from dflash.cache.writer import digest_root, shard_arrays

    path, _ = written
    reader = CacheReader(path)
    commit = Path(path) / "commits" / "shard-000000.json"
    record = json.loads(commit.read_text())
    raw = {name: np.ascontiguousarray(reader._array(0, name)[...]).view(np.uint8).reshape(-1)
           for name in shard_arrays(reader.metadata)}  # fmt: skip
    # version 2: 4 KiB sha256 segments of every array
    v2 = json.loads(json.dumps(record))
    for name, data in raw.items():
        v2["arrays"][name].pop("crc32c_chunks", None)
        v2["arrays"][name]["sha256_segments"] = [hashlib.sha256(data[i : i + 4096]).hexdigest() for i in range(0, len(data), 4096)]
    v2["digest_version"], v2["digest_segment_bytes"] = 2, 4096
    v2["digest"] = digest_root({n: v2["arrays"][n]["sha256_segments"] for n in raw}, {n: len(d) for n, d in raw.items()})
    commit.write_text(json.dumps(v2))
    assert verify_cache(path, require_complete=True)["ok"]
    # version 1: one stream over names and bytes, in the old writer's order
    stream = hashlib.sha256()
    for name, data in raw.items():
        stream.update(name.encode())
        stream.update(data.data)
    v1 = json.loads(json.dumps(v2))
    for entry in v1["arrays"].values():
        del entry["sha256_segments"]
    del v1["digest_version"], v1["digest_segment_bytes"]
    v1["digest"] = f"sha256:{stream.hexdigest()}"
    commit.write_text(json.dumps(v1))
    assert verify_cache(path, require_complete=True)["ok"]
    hidden = zarr.open_array(str(Path(path) / "shards" / "000000" / "hidden"), mode="r+")
    hidden[1, 7] = np.uint16(hidden[1, 7] ^ 0x0001)
    with pytest.raises(CacheCorruptError, match=r"shard 0 .*digest_version 1"):
        verify_cache(path)
    commit.write_text(json.dumps(v2))
    with pytest.raises(CacheCorruptError, match=r"shard 0 .*'hidden' segment 0 "):
        verify_cache(path)
    v2["digest_version"] = 4
    commit.write_text(json.dumps(v2))
    with pytest.raises(CacheCorruptError, match=r"shard 0 .*digest_version 4 is not known"):
        verify_cache(path)


def test_duplicate_rows_detected(tmp_path, written, target, real_samples):
    path, samples = written
    other = HiddenStateCache.create(tmp_path / "other", _metadata(target, real_samples[0], [[0, 6]]))
    with pytest.raises(CacheError, match="shard 0: corpus row 1 given twice"):
        other.write_shard(0, [samples[1], samples[0], samples[1]], [])
    with pytest.raises(CacheError, match="shard 0: corpus row 0 given twice"):
        other.write_shard(0, samples[:3], [quarantine_record(0, "dup", [4])])
    # A committed shard whose corpus_rows array was altered to hold a row twice.
    import zarr

    rows = zarr.open_array(str(path / "shards" / "000000" / "corpus_rows"), mode="r+")
    rows[...] = np.array([0, 1, 1])
    with pytest.raises(CacheCorruptError, match=r"shard 0 .*'corpus_rows'.*duplicate rows \[1\]"):
        verify_cache(path)
    with pytest.raises(CacheCorruptError, match=r"shard 0 .*duplicate"):
        CacheReader(path).shard_lengths(0)


def test_quarantine_recorded_and_summarized(tmp_path, target, real_samples):
    layer_ids, samples = real_samples
    poisoned = samples[1].hidden.clone()
    poisoned[3, len(layer_ids[:1]) * target.identity.hidden_size + 5] = float("nan")  # inside the second tap
    assert find_nonfinite_layers(poisoned, layer_ids) == [layer_ids[1]]
    assert find_nonfinite_layers(samples[0].hidden, layer_ids) == []
    cache = HiddenStateCache.create(tmp_path / "q", _metadata(target, layer_ids, [[0, 3]]))
    record = cache.write_shard(0, [samples[0], samples[2]], [quarantine_record(1, "json-doc", find_nonfinite_layers(poisoned, layer_ids))])
    assert record["num_quarantined"] == 1 and record["quarantined"][0]["layers"] == [layer_ids[1]]
    assert verify_cache(tmp_path / "q")["num_quarantined"] == 1  # quarantined rows count as accounted for
    result = _cli(["cache", "info", str(tmp_path / "q")])
    assert result.exit_code == 0
    assert "json-doc" in result.stdout and "quarantined" in result.stdout
    info = json.loads(_cli(["cache", "info", str(tmp_path / "q"), "--json"]).stdout)
    assert info["quarantined_by_layer"] == {str(layer_ids[1]): 1}
    assert info["compression_ratio"] > 1.0 and info["num_samples"] == 2


def test_write_shard_rejects_wrong_width(tmp_path, target, real_samples):
    layer_ids, samples = real_samples
    cache = HiddenStateCache.create(tmp_path / "w", _metadata(target, layer_ids[:2], [[0, 3]]))
    with pytest.raises(CacheError, match=r"shard 0, corpus row 0: hidden has shape"):
        cache.write_shard(0, samples[:1], [])
    assert cache.committed_shards() == set()


def _cli(arguments: list[str]):
    import typer

    from stages.cache_cmd import register

    app = typer.Typer()
    register(app)

    @app.callback()
    def _root() -> None:  # keeps "cache" a sub-command
        pass

    return CliRunner().invoke(app, arguments)


def test_fsspec_url_round_trip(target, real_samples):
    layer_ids, samples = real_samples
    url = f"memory://dflash-test-cache-{os.getpid()}/cache"
    cache = HiddenStateCache.create(url, _metadata(target, layer_ids, [[0, 6]]))
    cache.write_shard(0, samples, [])
    reader = CacheReader(url)
    assert reader.shards == [0] and reader.size_on_disk() > 0
    got = reader.read_shard(0, [5])[0]
    assert got.corpus_row == 5 and torch.equal(_bits(got.hidden), _bits(samples[5].hidden))
    assert verify_cache(url, require_complete=True)["num_samples"] == 6


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lengths=st.lists(st.integers(min_value=0, max_value=40), min_size=0, max_size=7),
    picks=st.lists(st.integers(min_value=0, max_value=6), max_size=6),
    seed=st.integers(min_value=0, max_value=2**16),
)
def test_csr_round_trip_any_lengths_and_subsets(tmp_path_factory, target, lengths, picks, seed):
    """Ragged shards of any sample lengths (zero and chunk-straddling included, or no samples at all) read back
    bit-exactly, whole or as any subset in any order; lengths come from offsets alone."""
    width = 8
    generator = np.random.default_rng(seed)
    samples = [
        HiddenSample(
            row,
            torch.from_numpy(generator.integers(0, 49152, size=length, dtype=np.int32)),
            torch.from_numpy(generator.integers(0, 2, size=length, dtype=np.uint8)),
            torch.from_numpy(generator.integers(0, 1 << 16, size=(length, width), dtype=np.uint16)).view(torch.bfloat16),
        )
        for row, length in enumerate(lengths)
    ]
    path = tmp_path_factory.mktemp("csr") / "cache"
    meta = _metadata(target, [3, 9], [[0, len(lengths)]], hidden_size=width // 2, num_taps=2, chunk_tokens=16)
    HiddenStateCache.create(path, meta).write_shard(0, samples, [])
    reader = CacheReader(path)
    assert reader.shard_lengths(0).tolist() == lengths
    indices = [i for i in picks if i < len(lengths)]
    for got, index in zip(reader.read_shard(0, indices), indices, strict=True):
        want = samples[index]
        assert got.corpus_row == index and torch.equal(got.input_ids, want.input_ids)
        assert torch.equal(got.loss_mask, want.loss_mask) and torch.equal(_bits(got.hidden), _bits(want.hidden))
    assert len(reader.read_shard(0)) == len(lengths)
    assert verify_cache(path, require_complete=True)["num_tokens"] == sum(lengths)


@pytest.mark.parametrize("storage", ["bfloat16", "float8_e4m3fn"])
def test_direct_chunk_encoding_is_byte_identical_to_zarr(tmp_path, real_samples, storage):
    """The writer's off-event-loop chunk path (dflash.cache.chunks) stores exactly the bytes zarr's own pipeline
    stores, for every codec preset, including a zero-padded partial last chunk; zarr reads it back bit-exactly."""
    import zarr

    from dflash.cache.chunks import chunk_encoder, store_chunk
    from dflash.cache.format import CODEC_PRESETS, quantize_fp8, zarr_compressors

    _, samples = real_samples
    hidden = torch.cat([sample.hidden for sample in samples])  # real bf16 states, ~100s of tokens
    if storage == "bfloat16":
        values = hidden.view(torch.uint16).numpy()
    else:
        values, _ = quantize_fp8(hidden, NUM_TAPS)
    rows, width = values.shape
    chunk_rows = 64
    assert rows % chunk_rows, "the data must end in a partial chunk"
    handled = 0
    for name, codec in CODEC_PRESETS.items():
        group = zarr.open_group(str(tmp_path / f"{storage}-{name}"), mode="w", zarr_format=3)
        kwargs = dict(shape=values.shape, dtype=values.dtype, chunks=(chunk_rows, width), fill_value=0,
                      compressors=zarr_compressors(codec), config={"write_empty_chunks": True})
        by_zarr = group.create_array("by_zarr", **kwargs)
        by_zarr[...] = values
        direct = group.create_array("direct", **kwargs)
        encode = chunk_encoder(direct)
        if encode is None:
            assert codec["name"] == "gzip", f"{name}: the direct path should handle this codec"
            continue
        handled += 1
        for index, start in enumerate(range(0, rows, chunk_rows)):
            chunk = np.zeros((chunk_rows, width), dtype=values.dtype)
            part = values[start : start + chunk_rows]
            chunk[: len(part)] = part
            store_chunk(direct, (index, 0), encode(chunk))
        root = tmp_path / f"{storage}-{name}"
        zarr_files = sorted(p.relative_to(root / "by_zarr") for p in (root / "by_zarr" / "c").rglob("*") if p.is_file())
        assert len(zarr_files) == -(-rows // chunk_rows)
        for relative in zarr_files:
            assert (root / "direct" / relative).read_bytes() == (root / "by_zarr" / relative).read_bytes(), (name, relative)
        np.testing.assert_array_equal(zarr.open_array(str(root / "direct"), mode="r")[...], values)
    assert handled == len(CODEC_PRESETS) - 1


def test_write_process_task_commits_a_shard_with_no_kept_sample(tmp_path, target, real_samples):
    """A shard whose every row was quarantined reaches a write process with no sample (so no shared-memory view):
    it commits an empty shard, as the in-process writer does."""
    from dflash.cache.process_writer import _write_in_process

    layer_ids, _ = real_samples
    path = tmp_path / "cache"
    HiddenStateCache.create(path, _metadata(target, layer_ids, [[0, 2]]))
    quarantined = [{"corpus_row": row, "sample_id": f"row-{row}", "layers": [layer_ids[0]]} for row in (0, 1)]
    record = _write_in_process(str(path), 0, [], quarantined, [])
    assert record["num_samples"] == 0 and record["num_quarantined"] == 2
    assert HiddenStateCache.open(path).committed_shards() == {0}


def test_document_keys_are_stored_checked_on_resume_and_optional(tmp_path, target, real_samples):
    """The root array ``document_keys`` (contract 2, optional): stored at creation, read back exactly, checked
    against its record; a resume must bring the same keys; a cache without them opens and reads as before."""
    import zarr

    layer_ids, samples = real_samples
    metadata = _metadata(target, layer_ids, [[0, 3], [3, 6]])
    keys = np.array([11, 11, 2**64 - 1, 5, 5, 5], dtype=np.uint64)
    cache = HiddenStateCache.create(tmp_path / "c", metadata, document_keys=keys)
    cache.write_shard(0, samples[:3], [])
    reader = CacheReader(tmp_path / "c")
    assert reader.document_keys().dtype == np.uint64 and reader.document_keys().tolist() == keys.tolist()
    assert reader.document_keys_info["num_rows"] == 6 and reader.document_keys_info["num_documents"] == 3
    assert verify_cache(tmp_path / "c")["document_keys"]["num_documents"] == 3

    # Resume: the same keys reopen; other keys, or a corpus now without document ids, are refused by name.
    HiddenStateCache.create(tmp_path / "c", metadata, document_keys=keys)
    with pytest.raises(CacheError, match=r"its document keys \(6 rows, 3 documents, sha256:.*\) differ from this "
                                         r"corpus's \(6 rows, 5 documents"):
        HiddenStateCache.create(tmp_path / "c", metadata, document_keys=np.array([1, 2, 3, 4, 5, 5], np.uint64))
    with pytest.raises(CacheError, match="this corpus has no document_id column"):
        HiddenStateCache.create(tmp_path / "c", metadata)
    with pytest.raises(CacheError, match="5 keys for the 6 planned corpus rows"):
        HiddenStateCache.create(tmp_path / "short", metadata, document_keys=keys[:5])

    # Damaged keys (a valid chunk of other values): the reader refuses them, naming the array.
    zarr.open_array(str(tmp_path / "c" / "document_keys"), mode="r+")[0] = 12
    with pytest.raises(CacheCorruptError, match=r"array 'document_keys' \(6 rows, sha256:.*\) differs from "
                                                r"dflash_document_keys"):
        CacheReader(tmp_path / "c").document_keys()

    # A cache created without keys (a corpus without document ids) opens and reads as before ...
    HiddenStateCache.create(tmp_path / "old", metadata).write_shard(0, samples[:3], [])
    old = CacheReader(tmp_path / "old")
    assert old.document_keys() is None and old.document_keys_info is None
    assert [s.corpus_row for s in old.read_shard(0)] == [0, 1, 2]
    assert verify_cache(tmp_path / "old", require_complete=False)["document_keys"] is None
    # ... and a resume with a corpus that has them adds them, before the next shard.
    HiddenStateCache.create(tmp_path / "old", metadata, document_keys=keys)
    assert CacheReader(tmp_path / "old").document_keys().tolist() == keys.tolist()


def test_a_damaged_commit_record_or_metadata_is_one_cache_error_naming_it(written, target):
    """A commit record nested 100k deep (a ``RecursionError`` in the parser) or garbled is a ``CacheCorruptError``
    naming its key and the fix; metadata with a field of the wrong type is a ``CacheError``, not a ``TypeError``."""
    path, _ = written
    record = Path(path) / "commits" / "shard-000001.json"
    for text, needle in (("[" * 100_000 + "]" * 100_000, "nested more than 64 levels deep"),
                         ('{"rows": ', "not valid JSON at line 1")):
        record.write_text(text)
        with pytest.raises(CacheCorruptError, match=r"commits/shard-000001.json: ") as caught:
            verify_cache(path)
        assert needle in str(caught.value) and "delete it so the shard is redone" in str(caught.value)
    import os

    for make in (lambda p: p.symlink_to("/dev/zero"), lambda p: os.mkfifo(p)):  # neither is read (nor blocks)
        record.unlink()
        make(record)
        with pytest.raises(CacheCorruptError, match=r"shard-000001.json is not a regular file .* re-extract it"):
            verify_cache(path)
    good = _metadata(target, [1, 2], [[0, 3]]).to_dict()
    for damaged in ({**good, "hidden_size": "576"}, {**good, "shard_rows": 7}, [good]):
        with pytest.raises(CacheError, match="dflash_cache.*re-extract the cache"):
            CacheMetadata.from_dict(damaged)
