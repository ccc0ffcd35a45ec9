"""Contract 1 (dflash/corpus.py): the three on-disk formats, validation errors, fingerprint, atomic writer.

Rows are real: stdlib sources tokenized with the real SmolLM2 tokenizer.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash.corpus.default_corpus import stdlib_root
from dflash.corpus.format import DATA_FILE, METADATA_FILE, CorpusWriter, open_corpus, validate_corpus
from dflash.errors import CorpusError

VOCAB = 49152
SOURCES = ["this.py", "colorsys.py", "bisect.py", "keyword.py", "heapq.py", "graphlib.py"]


@pytest.fixture(scope="module")
def samples(tokenizer):
    """(sample_id, input_ids int32, loss_mask uint8) from real stdlib files; masks supervise the second half."""
    rows = []
    for index, name in enumerate(SOURCES):  # lengths 120, 240, ..., 720
        ids = np.asarray(tokenizer((stdlib_root() / name).read_text())["input_ids"], np.int32)[: 120 * (index + 1)]
        mask = np.zeros(len(ids), np.uint8)
        mask[len(ids) // 2:] = 1
        rows.append((name, ids, mask))
    return rows


def _write(path, samples, **metadata):
    with CorpusWriter(path, batch_rows=4) as writer:  # several record batches
        for sample_id, ids, mask in samples:
            writer.add(ids, mask, sample_id)
        return writer.commit(metadata)


def _table(samples, *, ids_type=pa.int32(), mask_type=pa.uint8(), drop=()):
    columns = {
        "input_ids": pa.array([s[1].tolist() for s in samples], pa.list_(ids_type)),
        "loss_mask": pa.array([s[2].tolist() for s in samples], pa.list_(pa.uint8())).cast(pa.list_(mask_type)),
        "sample_id": pa.array([s[0] for s in samples]),
    }
    return pa.table({k: v for k, v in columns.items() if k not in drop})


def _assert_same_rows(corpus, samples):
    assert len(corpus) == len(samples)
    assert corpus.lengths.dtype == np.int64
    assert corpus.lengths.tolist() == [len(s[1]) for s in samples]
    for index, (sample_id, ids, mask) in enumerate(samples):
        row = corpus.row(index)
        assert row.input_ids.dtype == np.int32 and row.loss_mask.dtype == np.uint8
        np.testing.assert_array_equal(row.input_ids, ids)
        np.testing.assert_array_equal(row.loss_mask, mask)
        assert row.sample_id == sample_id


def test_writer_output_reads_back_with_metadata(tmp_path, samples):
    path = _write(tmp_path / "corpus", samples, target_spec="default", max_length=2048)
    assert sorted(p.name for p in path.iterdir()) == [DATA_FILE, METADATA_FILE]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder left
    corpus = open_corpus(path)
    _assert_same_rows(corpus, samples)
    assert corpus.metadata["target_spec"] == "default" and corpus.metadata["format_version"] == "dflash.corpus/1"
    assert corpus.metadata["fingerprint"] == corpus.fingerprint
    assert corpus.metadata["num_tokens"] == corpus.num_tokens == sum(len(s[1]) for s in samples)
    assert [r.sample_id for r in corpus.rows(4, 99)] == SOURCES[4:]
    assert corpus.row(-1).sample_id == SOURCES[-1]
    with pytest.raises(IndexError):
        corpus.row(len(samples))
    report = validate_corpus(corpus, vocab_size=VOCAB)
    assert report.kept_rows.tolist() == list(range(len(samples)))
    assert report.num_supervised_tokens == sum(int(s[2].sum()) for s in samples)


def test_three_formats_read_the_same_rows_and_fingerprint(tmp_path, samples):
    datasets = pytest.importorskip("datasets")
    arrow_corpus = open_corpus(_write(tmp_path / "arrow", samples))
    pq.write_table(_table(samples), tmp_path / "rows.parquet", row_group_size=2)
    parquet_corpus = open_corpus(tmp_path / "rows.parquet")
    # datasets stores python int lists as list<int64>: read as int32/uint8 all the same.
    datasets.Dataset.from_dict({
        "input_ids": [s[1].tolist() for s in samples],
        "loss_mask": [s[2].tolist() for s in samples],
        "sample_id": [s[0] for s in samples],
    }).save_to_disk(str(tmp_path / "saved"))
    saved_corpus = open_corpus(tmp_path / "saved")
    # A plain folder of Parquet parts, in name order.
    (tmp_path / "parts").mkdir()
    pq.write_table(_table(samples[:2]), tmp_path / "parts" / "part-0.parquet")
    pq.write_table(_table(samples[2:], ids_type=pa.int64(), mask_type=pa.bool_()), tmp_path / "parts" / "part-1.parquet")
    parts_corpus = open_corpus(tmp_path / "parts")
    for corpus in (arrow_corpus, parquet_corpus, saved_corpus, parts_corpus):
        _assert_same_rows(corpus, samples)
        assert corpus.fingerprint == arrow_corpus.fingerprint
    # A DatasetDict folder holds several splits: the error says which folder to pass.
    datasets.DatasetDict({"train": datasets.load_from_disk(str(tmp_path / "saved"))}).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(CorpusError, match=r"DatasetDict with splits \['train'\]; pass one split's folder, e.g. .*dict/train"):
        open_corpus(tmp_path / "dict")
    _assert_same_rows(open_corpus(tmp_path / "dict" / "train"), samples)


def test_fingerprint_is_stable_and_content_sensitive(tmp_path, samples):
    first = open_corpus(_write(tmp_path / "a", samples))
    assert first.fingerprint.startswith("sha256:") and len(first.fingerprint) == 7 + 64
    assert open_corpus(_write(tmp_path / "b", samples)).fingerprint == first.fingerprint
    assert open_corpus(tmp_path / "a").fingerprint == first.fingerprint
    # sample_id is a label, not content.
    renamed = [(f"x{i}", ids, mask) for i, (_, ids, mask) in enumerate(samples)]
    assert open_corpus(_write(tmp_path / "c", renamed)).fingerprint == first.fingerprint

    def changed(edit):
        rows = [(s, ids.copy(), mask.copy()) for s, ids, mask in samples]
        edit(rows)
        return open_corpus(_write(tmp_path / f"e{len(list(tmp_path.iterdir()))}", rows)).fingerprint

    def one_token(rows):
        rows[3][1][10] += 1

    def one_mask_bit(rows):
        rows[2][2][0] ^= 1

    def row_order(rows):
        rows[0], rows[1] = rows[1], rows[0]

    def row_boundary(rows):  # same flat tokens and mask, one boundary moved
        (a, ids_a, mask_a), (b, ids_b, mask_b) = rows[0], rows[1]
        rows[0] = (a, ids_a[:-1], mask_a[:-1])
        rows[1] = (b, np.concatenate([ids_a[-1:], ids_b]), np.concatenate([mask_a[-1:], mask_b]))

    prints = {changed(edit) for edit in (one_token, one_mask_bit, row_order, row_boundary)}
    assert len(prints) == 4 and first.fingerprint not in prints


def edit_one_token(file, position=5):
    """Rewrite the Arrow IPC file ``file`` with token ``position`` (of the flat input_ids) changed by one, as an
    editor would: same schema, same rows, a valid file."""
    table = pa.ipc.open_file(pa.BufferReader(file.read_bytes())).read_all()
    ids = table.column("input_ids").combine_chunks()
    values = ids.values.to_numpy().copy()
    values[position] += 1
    columns = [pa.ListArray.from_arrays(ids.offsets, pa.array(values, pa.int32())), *table.columns[1:]]
    edited = pa.Table.from_arrays(columns, schema=table.schema)
    with pa.OSFile(str(file), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(edited)


def test_data_changed_after_writing_is_refused_against_corpus_json(tmp_path, samples):
    """One token edited in the data file: the fingerprint recomputed from the data differs from corpus.json's, so
    validation (what extract and online run first) refuses the corpus; an unedited one and a corpus without a
    recorded fingerprint pass."""
    folder = _write(tmp_path / "c", samples)
    recorded = json.loads((folder / METADATA_FILE).read_text())["fingerprint"]
    validate_corpus(open_corpus(folder), vocab_size=49152)
    edit_one_token(folder / DATA_FILE)
    corpus = open_corpus(folder)
    assert corpus.fingerprint != recorded and len(corpus) == len(samples)
    with pytest.raises(CorpusError) as raised:
        validate_corpus(corpus, vocab_size=49152)
    message = str(raised.value)
    assert message.startswith(f"corpus {folder}: its data (corpus.arrow) has fingerprint {corpus.fingerprint}, but "
                              f"{folder / METADATA_FILE} records {recorded}: the data was changed after the corpus "
                              "was written; restore the original files, or rebuild the corpus")
    with pytest.raises(CorpusError, match="the data was changed after the corpus was written"):
        open_corpus(folder / DATA_FILE).check_fingerprint()  # the data file named directly reads the sidecar too
    pq.write_table(_table(samples), tmp_path / "plain.parquet")
    open_corpus(tmp_path / "plain.parquet").check_fingerprint()  # nothing recorded: nothing to compare


def _bad_parquet(tmp_path, samples, edit, **table_kwargs):
    rows = [(s, ids.copy(), mask.copy()) for s, ids, mask in samples]
    edit(rows)
    path = tmp_path / "bad.parquet"
    pq.write_table(_table(rows, **table_kwargs), path)
    return path


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda rows: rows.__setitem__(2, (rows[2][0], rows[2][1], rows[2][2][:-1])),
         r"bad.parquet row 2 \(sample_id 'bisect.py'\): input_ids has \d+ tokens but loss_mask has \d+ entries; give loss_mask"),
        (lambda rows: rows[4][1].__setitem__(5, VOCAB),
         rf"row 4 \(sample_id 'heapq.py'\): token id {VOCAB} at position 5 is outside \[0, {VOCAB}\); .*re-run prepare"),
        (lambda rows: rows.__setitem__(1, (rows[1][0], rows[1][1][:0], rows[1][2][:0])),
         r"row 1 \(sample_id 'colorsys.py'\): empty input_ids; remove empty samples"),
        (lambda rows: rows[3][2].fill(0),
         r"row 3 \(sample_id 'keyword.py'\): no supervised token \(loss_mask is all 0\); drop samples"),
        (lambda rows: rows[0][2].__setitem__(0, 7), r"row 0 .*loss_mask holds a value other than 0 or 1"),
    ],
    ids=["length-mismatch", "token-id-out-of-vocab", "empty", "no-supervised-token", "mask-not-binary"],
)
def test_validation_names_file_row_and_fix(tmp_path, samples, edit, message):
    corpus = open_corpus(_bad_parquet(tmp_path, samples, edit))
    with pytest.raises(CorpusError, match=message):
        validate_corpus(corpus, vocab_size=VOCAB)


@pytest.mark.parametrize("column", ["input_ids", "loss_mask"])
def test_missing_column_names_file_and_fix(tmp_path, samples, column):
    path = tmp_path / "rows.parquet"
    pq.write_table(_table(samples, drop=(column,)), path)
    with pytest.raises(CorpusError, match=rf"rows.parquet: no column '{column}' \(columns: .*\); .*dflash-stages prepare"):
        open_corpus(path)


def test_wrong_types_and_missing_paths(tmp_path, samples):
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"input_ids": ["1 2 3"], "loss_mask": [[1]]}), path)
    with pytest.raises(CorpusError, match="column 'input_ids' has type string, expected a list of an integer"):
        open_corpus(path)
    with pytest.raises(CorpusError, match="does not exist"):
        open_corpus(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CorpusError, match="holds no .arrow or .parquet files"):
        open_corpus(tmp_path / "empty")
    (tmp_path / "garbage.arrow").write_bytes(b"not arrow at all")
    with pytest.raises(CorpusError, match="garbage.arrow: not an Arrow IPC file"):
        open_corpus(tmp_path / "garbage.arrow")


def test_length_policies(tmp_path, samples):
    corpus = open_corpus(_write(tmp_path / "c", samples))
    max_length = 300
    too_long = [i for i, s in enumerate(samples) if len(s[1]) > max_length]
    assert too_long == [2, 3, 4, 5]
    with pytest.raises(CorpusError, match=rf"tokens > max_length {max_length}; choose a length policy explicitly"):
        validate_corpus(corpus, vocab_size=VOCAB, max_length=max_length)
    dropped = validate_corpus(corpus, vocab_size=VOCAB, max_length=max_length, length_policy="drop")
    assert dropped.num_too_long == len(too_long)
    assert dropped.dropped == {"longer than max_length": len(too_long)}
    assert set(dropped.kept_rows.tolist()) == set(range(len(samples))) - set(too_long)
    truncated = validate_corpus(corpus, vocab_size=VOCAB, max_length=max_length, length_policy="truncate")
    # Masks supervise the second half: rows longer than 2 * max_length lose every supervised token.
    lost = [i for i in too_long if not samples[i][2][:max_length].any()]
    assert lost == [4, 5]
    assert truncated.truncate_to == max_length
    assert truncated.kept_rows.tolist() == [i for i in range(len(samples)) if i not in lost]
    assert truncated.to_dict()["dropped"] == ({"no supervised token after truncation": len(lost)} if lost else {})
    with pytest.raises(ValueError, match="length_policy"):
        validate_corpus(corpus, vocab_size=VOCAB, max_length=10, length_policy="split")


def test_writer_is_atomic(tmp_path, samples):
    target = tmp_path / "out"
    with pytest.raises(RuntimeError), CorpusWriter(target) as writer:
        writer.add(samples[0][1], samples[0][2], "a")
        raise RuntimeError("killed mid-way")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(CorpusError, match="no sample to write"), CorpusWriter(target) as writer:
        writer.commit({})
    assert list(tmp_path.iterdir()) == []
    _write(target, samples[:2])
    with pytest.raises(CorpusError, match="already exists; pass another --output or --overwrite"):
        CorpusWriter(target)
    with CorpusWriter(target, overwrite=True) as writer:
        writer.add(samples[3][1], samples[3][2], "only")
        writer.commit({"note": "replaced"})
    replaced = open_corpus(target)
    assert len(replaced) == 1 and replaced.metadata["note"] == "replaced"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert json.loads((target / METADATA_FILE).read_text())["num_rows"] == 1


def _blake2b_key(text: str) -> int:
    """The contract's document key, computed independently of dflash.corpus.format."""
    import hashlib

    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


def test_document_ids_round_trip_and_give_equal_keys_for_equal_ids(tmp_path, samples):
    from dflash.corpus.format import document_key

    documents = ["stdlib:os.py", "stdlib:os.py", None, "stdlib:re.py", "7", "stdlib:os.py"]
    with CorpusWriter(tmp_path / "corpus", batch_rows=4) as writer:  # the document spans two record batches
        for (sample_id, ids, mask), document in zip(samples, documents, strict=True):
            writer.add(ids, mask, sample_id, document)
        writer.commit({})
    corpus = open_corpus(tmp_path / "corpus")
    assert corpus.has_document_ids
    assert [corpus.document_id(i) for i in range(len(corpus))] == documents
    keys = corpus.document_keys
    assert keys.dtype == np.uint64 and keys.shape == (len(samples),)
    assert keys[0] == keys[1] == keys[5] == _blake2b_key("stdlib:os.py") == document_key("stdlib:os.py")
    assert len({int(keys[0]), int(keys[2]), int(keys[3]), int(keys[4])}) == 4  # different ids, different keys
    assert keys[2] == 2  # no document id: the row is its own document, keyed by its row index
    # A label, not content: the fingerprint is that of the same rows without document ids.
    assert corpus.fingerprint == open_corpus(_write(tmp_path / "plain", samples)).fingerprint

    # Parquet with integer ids (and a null): integers are their decimal text, so 7 and "7" are one document.
    table = _table(samples).append_column("document_id", pa.array([1, 1, None, 2, 7, 1], pa.int64()))
    pq.write_table(table, tmp_path / "ints.parquet", row_group_size=2)
    ints = open_corpus(tmp_path / "ints.parquet")
    assert ints.document_keys.tolist() == [_blake2b_key("1"), _blake2b_key("1"), 2, _blake2b_key("2"),
                                           int(keys[4]), _blake2b_key("1")]


def test_without_document_ids_every_row_is_its_own_document(tmp_path, samples):
    from dflash.corpus.format import CorpusLengths

    pq.write_table(_table(samples), tmp_path / "rows.parquet")
    corpus = open_corpus(tmp_path / "rows.parquet")
    assert not corpus.has_document_ids and corpus.document_id(0) is None
    assert corpus.document_keys.tolist() == list(range(len(samples)))
    assert CorpusLengths(corpus).document_keys() is None  # the loader then splits by row and says so
    written = open_corpus(_write(tmp_path / "written", samples))  # a document_id column of nulls: the same
    assert not written.has_document_ids and written.document_keys.tolist() == list(range(len(samples)))


def test_a_document_id_column_of_another_type_names_the_file_and_column(tmp_path, samples):
    table = _table(samples).append_column("document_id", pa.array([[1]] * len(samples)))
    pq.write_table(table, tmp_path / "bad.parquet")
    with pytest.raises(CorpusError, match=r"bad.parquet: column 'document_id' has type list<.*>, expected string "
                                          r"\(integers accepted\); cast it to string or drop the column"):
        open_corpus(tmp_path / "bad.parquet")
