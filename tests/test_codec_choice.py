"""``dflash.cache.codec_choice``: the chooser on given rates, and the calibration on the real SmolLM2 (CPU).

The end-to-end ``extract --codec auto`` runs (metadata, resume, verify) are in tests/test_extract.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash.cache import DEFAULT_CODEC, default_chunk_tokens
from dflash.cache.codec_choice import (
    CODEC_CANDIDATES,
    KEEP_UP_MARGIN,
    calibrate_codecs,
    calibration_row_count,
    choose_codec,
    describe_choice,
    measure_encode,
    measure_production,
    uncalibrated_choice,
)
from dflash.cache.format import stored_row_bytes
from dflash.target.runner import TargetRunner
from dflash.target.taps import default_target_layer_ids

GB = 1e9


def _calibration(production: float, zstd: float, lz4: float, none: float) -> dict:
    """A worker's calibrate_codecs result with the given rates (bytes/s) and SmolLM2-like ratios."""
    rates, ratios = (zstd, lz4, none), (1.43, 1.06, 0.9999)
    return {"production_bytes_per_s": production,
            "candidates": {name: {"encode_bytes_per_s": rate, "ratio": ratio}
                           for name, rate, ratio in zip(CODEC_CANDIDATES, rates, ratios, strict=True)}}  # fmt: skip


def test_candidates_start_with_the_default_and_end_with_no_compression():
    assert CODEC_CANDIDATES[0] == DEFAULT_CODEC and CODEC_CANDIDATES[-1] == "none" and KEEP_UP_MARGIN > 1


def test_the_default_is_kept_when_it_keeps_up():
    choice = choose_codec({"w0": _calibration(1 * GB, zstd=KEEP_UP_MARGIN * GB, lz4=3 * GB, none=9 * GB)})
    assert (choice["chosen"], choice["keeps_up"], choice["requested"]) == (DEFAULT_CODEC, True, "auto")
    assert choice["margin"] == KEEP_UP_MARGIN and choice["production_bytes_per_s"] == {"w0": 1 * GB}
    assert choice["candidates"][DEFAULT_CODEC] == {"encode_bytes_per_s": 1.25 * GB, "ratio": 1.43, "keeps_up": True}
    assert "the default" in choice["reason"]


def test_lz4_when_zstd_cannot_keep_up_and_none_when_neither_can():
    choice = choose_codec({"w0": _calibration(2 * GB, zstd=2.4 * GB, lz4=3 * GB, none=9 * GB)})  # 2.4 < 1.25 x 2
    assert (choice["chosen"], choice["keeps_up"]) == ("blosc-lz4-shuffle", True)
    assert not choice["candidates"][DEFAULT_CODEC]["keeps_up"]
    assert "blosc-zstd1-shuffle encodes below 1.25x" in choice["reason"] and "w0" in choice["reason"]
    choice = choose_codec({"w0": _calibration(2 * GB, zstd=1 * GB, lz4=2 * GB, none=9 * GB)})
    assert (choice["chosen"], choice["keeps_up"]) == ("none", True)
    assert "blosc-lz4-shuffle encodes below" in choice["reason"]
    # The margin decides: at margin 1 lz4's 2 GB/s keeps up with 2 GB/s.
    assert choose_codec({"w0": _calibration(2 * GB, zstd=1 * GB, lz4=2 * GB, none=9 * GB)}, margin=1.0)["chosen"] == "blosc-lz4-shuffle"


def test_none_with_a_warning_when_even_none_cannot_keep_up():
    choice = choose_codec({"w0": _calibration(8 * GB, zstd=1 * GB, lz4=3 * GB, none=9 * GB)})  # 9 < 1.25 x 8
    assert (choice["chosen"], choice["keeps_up"]) == ("none", False)
    assert "--storage-dtype fp8" in choice["reason"] and "online" in choice["reason"]
    assert "too slow" in describe_choice(choice) and "keeps up" not in describe_choice(choice)


def test_the_cache_gets_the_lightest_codec_any_worker_needs():
    calibrations = {
        "fast-cpu": _calibration(1 * GB, zstd=2 * GB, lz4=4 * GB, none=9 * GB),  # needs nothing lighter than zstd
        "slow-cpu": _calibration(1 * GB, zstd=1 * GB, lz4=2 * GB, none=9 * GB),  # needs lz4
    }
    choice = choose_codec(calibrations)
    assert (choice["chosen"], choice["keeps_up"]) == ("blosc-lz4-shuffle", True)
    assert choice["production_bytes_per_s"] == {"fast-cpu": 1 * GB, "slow-cpu": 1 * GB}
    assert choice["candidates"][DEFAULT_CODEC]["encode_bytes_per_s"] == 1 * GB  # the slowest worker's figure
    assert not choice["candidates"][DEFAULT_CODEC]["keeps_up"] and "slow-cpu" in choice["reason"]
    assert "fast-cpu" not in choice["reason"] and set(choice["workers"]) == set(calibrations)
    line = describe_choice(choice)
    assert all(name in line for name in CODEC_CANDIDATES) and line.endswith(
        f"-> blosc-lz4-shuffle (keeping up = encoding >= {KEEP_UP_MARGIN:g}x production)")
    with pytest.raises(ValueError, match="at least one calibration"):
        choose_codec({})


def test_an_uncalibrated_choice_is_the_default_with_its_reason():
    choice = uncalibrated_choice("CPU runner")
    assert choice == {"requested": "auto", "chosen": DEFAULT_CODEC, "reason": "CPU runner"}
    assert describe_choice(choice) == f"codec auto -> {DEFAULT_CODEC} (CPU runner)"


def test_calibration_rows_fill_one_forward_batch():
    assert calibration_row_count([10, 10, 30], 40, packing=False) == 2  # 3 rows x longest 30 > 40
    assert calibration_row_count([10, 10, 30], 60, packing=False) == 2  # 90 > 60 padded ...
    assert calibration_row_count([10, 10, 30], 60, packing=True) == 3  # ... but 50 <= 60 packed
    assert calibration_row_count([50, 1], 40, packing=False) == 1  # a row longer than the budget: itself
    assert calibration_row_count([], 40, packing=True) == 0


# The machine's forwards are slow when its cores are shared: two short rows, and each forward shared by the tests.
@pytest.fixture(scope="module")
def runner(target):
    layer_ids = default_target_layer_ids(target.model.config.num_hidden_layers, 5)
    return TargetRunner(target.model, layer_ids, "cpu", token_budget=64)


@pytest.fixture(scope="module")
def input_ids(tokenizer):
    texts = ["def double(x):\n    return 2 * x\n", "import os\nprint(os.getcwd())"]
    return [np.asarray(tokenizer(text)["input_ids"], dtype=np.int32) for text in texts]


@pytest.fixture(scope="module")
def produced(runner, input_ids):
    """``measure_production`` for fp8 storage, and the runner's own outputs of the same rows."""
    hidden, figures = measure_production(runner, input_ids, "float8_e4m3fn")
    return hidden, figures, torch.cat(runner.run(input_ids))


def test_calibration_on_the_real_target_measures_every_candidate(runner, input_ids):
    """The real SmolLM2 on the CPU, the cache's own chunk shape and write threads: positive rates and ratios for
    every candidate; ``none`` stores the raw bytes plus one 4-byte crc32c per chunk."""
    ids = input_ids[: calibration_row_count([len(i) for i in input_ids], runner.token_budget, runner.packing)]
    assert len(ids) == len(input_ids)
    row_bytes = stored_row_bytes("bfloat16", runner.num_taps, runner.hidden_size)
    result = calibrate_codecs(runner, ids, storage_dtype="bfloat16", chunk_tokens=default_chunk_tokens(row_bytes),
                              write_threads=2)  # fmt: skip
    tokens = sum(len(i) for i in ids)
    assert (result["tokens"], result["device"], result["write_threads"]) == (tokens, "cpu", 2)
    assert result["seconds"] > 0 and result["production_bytes_per_s"] == pytest.approx(tokens * row_bytes / result["seconds"])
    assert set(result["candidates"]) == set(CODEC_CANDIDATES)
    for name, figures in result["candidates"].items():
        assert figures["encode_bytes_per_s"] > 0 and figures["ratio"] > 0, name
        assert (figures["chunks"], figures["chunk_tokens"]) == (1, tokens)  # fewer tokens than a chunk: one chunk
        assert figures["jobs"] >= 2 * 2 and figures["jobs"] % 2 == 0  # two rounds of jobs on each thread
    raw = tokens * row_bytes
    assert result["candidates"]["none"]["ratio"] == pytest.approx(raw / (raw + 4), abs=1e-12)
    # Real hidden states compress (shuffled exponent bytes); the default does best.
    assert result["candidates"][DEFAULT_CODEC]["ratio"] > result["candidates"]["blosc-lz4-shuffle"]["ratio"] > 0.99


def test_production_returns_the_hidden_states_in_input_order_and_counts_stored_bytes(runner, input_ids, produced):
    hidden, figures, outputs = produced
    assert torch.equal(hidden, outputs)  # the samples in input order, as the runner computes them
    assert figures["tokens"] == sum(len(i) for i in input_ids)
    fp8_row = runner.num_taps * runner.hidden_size + 4 * runner.num_taps
    assert figures["production_bytes_per_s"] == pytest.approx(figures["tokens"] * fp8_row / figures["seconds"])
    with pytest.raises(ValueError, match="at least one sample"):
        measure_production(runner, [], "bfloat16")


def test_encode_cuts_the_real_chunk_shape_and_quantizes_for_fp8(runner, produced):
    hidden = produced[0]
    tokens, width = hidden.shape
    assert tokens >= 16 and tokens % 8
    figures = measure_encode(hidden, "none", storage_dtype="bfloat16", num_taps=runner.num_taps, chunk_tokens=8, threads=3)
    assert (figures["chunks"], figures["chunk_tokens"]) == (tokens // 8, 8)  # the tail that fills no chunk left out
    assert figures["jobs"] == max(6, -(-(tokens // 8) // 3) * 3)  # at least two jobs per thread, whole rounds
    assert figures["ratio"] == pytest.approx(8 * width * 2 / (8 * width * 2 + 4))
    fp8 = measure_encode(hidden, "none", storage_dtype="float8_e4m3fn", num_taps=runner.num_taps, chunk_tokens=8, threads=1)
    assert fp8["ratio"] == pytest.approx(8 * width / (8 * width + 4))  # one byte a value once quantized
    zstd = measure_encode(hidden, DEFAULT_CODEC, storage_dtype="bfloat16", num_taps=runner.num_taps, chunk_tokens=8,
                          threads=1)  # fmt: skip
    assert zstd["ratio"] > figures["ratio"]
    with pytest.raises(ValueError, match="threads >= 1"):
        measure_encode(hidden, "none", storage_dtype="bfloat16", num_taps=runner.num_taps, chunk_tokens=8, threads=0)


def test_a_calibration_that_fails_on_a_worker_leaves_the_default_codec_and_says_why(tmp_path, caplog):
    """Measuring is an optimisation: a calibration task that raises (here: a worker with no target loaded) gives
    the default codec, with the failure as the recorded reason and a warning, instead of stopping extract."""
    import io
    import logging
    from types import SimpleNamespace

    from distributed import Client, LocalCluster
    from rich.console import Console

    from stages.extract.command import ExtractConfig, _choose_codec

    config = ExtractConfig(corpus=str(tmp_path / "corpus"), output=str(tmp_path / "cache"), codec_calibration="always")
    plan = SimpleNamespace(report=SimpleNamespace(truncate_to=None),
                           metadata=SimpleNamespace(storage_dtype="bfloat16", chunk_tokens=1024))
    console = Console(file=io.StringIO(), width=300)
    with LocalCluster(n_workers=1, processes=False, dashboard_address=":0") as cluster, Client(cluster) as client, \
            caplog.at_level(logging.WARNING, logger="stages.extract.command"):
        choice = _choose_codec(client, config, plan, [0], None, console)
    assert choice["chosen"] == DEFAULT_CODEC and "candidates" not in choice
    assert choice["reason"] == "calibration failed (RuntimeError): the default codec, unmeasured"
    assert "has no target loaded" in caplog.text
    assert f"codec auto -> {DEFAULT_CODEC} (calibration failed (RuntimeError)" in console.file.getvalue()
