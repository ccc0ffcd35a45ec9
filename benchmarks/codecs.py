"""Compression ratio and speed of candidate cache codecs on REAL hidden states (SmolLM2 on stdlib source text).

Runs the target (default: the embedded SmolLM2-135M-Instruct) on chunks of Python standard-library files with the
DFlash default taps, then, for every codec preset of ``dflash.cache.CODEC_PRESETS`` and both storage dtypes,
writes the hidden states through the same zarr v3 codec chain the cache uses (codec + crc32c, the cache's chunk
shape) into an in-memory store and reads them back. Prints a rich table: ratio (raw / stored), bytes per token,
encode and decode MB/s of raw data (zarr's own thread pool, as the cache uses it), and for the default codec the
full ``HiddenStateCache.write_shard`` / ``CacheReader.read_shard`` throughput (digest and disk included).

    python benchmarks/codecs.py                  # ~32K tokens, 5 taps; a few minutes on 2 CPU cores
    python benchmarks/codecs.py --smoke          # tiny sizes, checks that it runs
    python benchmarks/codecs.py --target PATH --device cuda --tokens 262144 --json codecs.json
"""

from __future__ import annotations

import json
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(add_completion=False, pretty_exceptions_show_locals=False)


def stdlib_token_chunks(tokenizer: Any, num_tokens: int, sample_tokens: int) -> list[np.ndarray]:
    """``sample_tokens``-long chunks of tokenized stdlib ``*.py`` files (sorted paths, deterministic), ``num_tokens`` total."""
    chunks: list[np.ndarray] = []
    total = 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        ids = np.asarray(tokenizer(path.read_text(errors="replace")).input_ids, dtype=np.int64)
        for start in range(0, len(ids) - sample_tokens + 1, sample_tokens):
            chunks.append(ids[start : start + sample_tokens])
            total += sample_tokens
            if total >= num_tokens:
                return chunks
    return chunks


def hidden_states(target_spec: str, device: str, num_tokens: int, sample_tokens: int, num_taps: int) -> tuple[Any, list[int], list[np.ndarray], list[torch.Tensor]]:
    from dflash.target.load import load_target
    from dflash.target.runner import TargetRunner
    from dflash.target.taps import default_target_layer_ids

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    target = load_target(target_spec, dtype=dtype, device=device)
    layer_ids = default_target_layer_ids(target.identity.num_hidden_layers, num_taps)
    chunks = stdlib_token_chunks(target.tokenizer, num_tokens, sample_tokens)
    runner = TargetRunner(target.model, layer_ids, device, token_budget=max(sample_tokens, 4096))
    hidden = [h.to(torch.bfloat16) for h in runner.run(chunks)]
    return target, layer_ids, chunks, hidden


def measure_codec(values: np.ndarray, codec: dict[str, Any], chunk_tokens: int, repeats: int) -> dict[str, float]:
    """Encode+decode ``values [T, W]`` through zarr (codec + crc32c) in memory; best of ``repeats``."""
    import zarr

    from dflash.cache.format import zarr_compressors

    raw = values.nbytes
    best_write, best_read, stored = float("inf"), float("inf"), 0
    for _ in range(repeats):
        objects: dict[str, Any] = {}
        store = zarr.storage.MemoryStore(store_dict=objects)
        array = zarr.create_array(
            store, shape=values.shape, dtype=values.dtype, chunks=(chunk_tokens, values.shape[1]),
            compressors=zarr_compressors(codec), fill_value=0, config={"write_empty_chunks": True},
        )
        start = time.perf_counter()
        array[...] = values
        best_write = min(best_write, time.perf_counter() - start)
        start = time.perf_counter()
        back = array[...]
        best_read = min(best_read, time.perf_counter() - start)
        assert np.array_equal(back.view(np.uint8), values.view(np.uint8))
        stored = sum(len(value) for key, value in objects.items() if not key.endswith("zarr.json"))
    return {"ratio": raw / stored, "stored_bytes": stored, "encode_MBps": raw / best_write / 1e6, "decode_MBps": raw / best_read / 1e6}


@app.command()
def main(
    target: str = typer.Option("default", help="Target spec (default: embedded SmolLM2-135M-Instruct)."),
    device: str = typer.Option("cuda" if torch.cuda.is_available() else "cpu", help="Where the target runs."),
    tokens: int = typer.Option(32768, help="Tokens of stdlib text to run through the target."),
    sample_tokens: int = typer.Option(512, help="Tokens per sample."),
    num_taps: int = typer.Option(5, help="Tapped layers (DFlash default rule)."),
    repeats: int = typer.Option(3, help="Timing repeats per codec (best is reported)."),
    smoke: bool = typer.Option(False, help="Tiny sizes: 1K tokens, 1 repeat, to check the script runs."),
    states: Path | None = typer.Option(
        None, help="Save the hidden states (and token ids) to this .pt file, or load them from it if it exists (skips the forward)."
    ),
    json_path: Path | None = typer.Option(None, "--json", help="Also write the figures to this JSON file."),
) -> None:
    """Measure every codec preset on real hidden states; print ratio and speed."""
    from dflash.cache import (
        CODEC_PRESETS,
        DEFAULT_CODEC,
        CacheMetadata,
        CacheReader,
        HiddenSample,
        HiddenStateCache,
    )
    from dflash.cache.format import default_chunk_tokens, quantize_fp8
    from dflash.target.taps import LAYER_ID_CONVENTION

    if smoke:
        tokens, sample_tokens, repeats = 1024, 256, 1
    console = Console(width=160)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    start = time.perf_counter()
    if states is not None and states.is_file():
        from dflash.target.load import load_target

        saved = torch.load(states, weights_only=True)  # tensors and lists only: never unpickle code
        loaded = load_target(target, device="cpu")
        layer_ids, chunks, hidden = saved["layer_ids"], [ids.numpy() for ids in saved["input_ids"]], saved["hidden"]
    else:
        loaded, layer_ids, chunks, hidden = hidden_states(target, device, tokens, sample_tokens, num_taps)
        if states is not None:
            torch.save({"layer_ids": layer_ids, "input_ids": [torch.from_numpy(ids) for ids in chunks], "hidden": hidden}, states)
    flat = torch.cat(hidden)
    num_tokens, width = flat.shape
    console.print(
        f"{loaded.identity.name}: {num_tokens:,} tokens of stdlib text, taps {layer_ids}, row {width} x bf16, "
        f"forward {time.perf_counter() - start:.1f} s on {device}; torch threads {torch.get_num_threads()}"
    )
    bf16_bits = flat.view(torch.uint16).numpy()
    fp8_bits, fp8_scale = quantize_fp8(flat, len(layer_ids))
    results: list[dict[str, Any]] = []
    for storage, values, extra_bytes in (("bfloat16", bf16_bits, 0), ("float8_e4m3fn", fp8_bits, fp8_scale.nbytes)):
        chunk_tokens = default_chunk_tokens(values.shape[1] * values.itemsize + (4 * len(layer_ids) if extra_bytes else 0))
        for name, codec in CODEC_PRESETS.items():
            figures = measure_codec(values, codec, chunk_tokens, repeats)
            bytes_per_token = (figures["stored_bytes"] + extra_bytes) / num_tokens
            results.append({"storage_dtype": storage, "codec": name, "chunk_tokens": chunk_tokens, "bytes_per_token": bytes_per_token, **figures})

    table = Table(title=f"hidden-state codecs on {num_tokens:,} real tokens ({loaded.identity.name}, {len(layer_ids)} taps)")
    for column in ("storage", "codec", "ratio", "bytes/token", "vs raw bf16", "encode MB/s", "decode MB/s"):
        table.add_column(column, justify="right" if column not in ("storage", "codec") else "left")
    raw_bf16_per_token = width * 2
    for row in results:
        table.add_row(
            row["storage_dtype"], row["codec"] + (" (default)" if row["codec"] == DEFAULT_CODEC else ""),
            f"{row['ratio']:.3f}", f"{row['bytes_per_token']:,.0f}", f"{raw_bf16_per_token / row['bytes_per_token']:.2f}x",
            f"{row['encode_MBps']:,.0f}", f"{row['decode_MBps']:,.0f}",
        )
    console.print(table)

    # End to end through the cache API with the default codec (digest, commit record, local disk).
    end_to_end = {}
    samples = [
        HiddenSample(i, torch.from_numpy(ids.astype(np.int32)), torch.ones(len(ids), dtype=torch.uint8), h)
        for i, (ids, h) in enumerate(zip(chunks, hidden, strict=True))
    ]
    for storage in ("bfloat16", "float8_e4m3fn"):
        with tempfile.TemporaryDirectory() as folder:
            meta = CacheMetadata(
                target=loaded.identity.to_dict(), target_spec=target, target_layer_ids=layer_ids, layer_id_convention=LAYER_ID_CONVENTION,
                hidden_size=loaded.identity.hidden_size, num_taps=len(layer_ids), storage_dtype=storage,
                corpus_fingerprint="sha256:benchmark", num_shards=1, shard_rows=[[0, len(samples)]],
            )
            cache = HiddenStateCache.create(Path(folder) / "cache", meta)
            start = time.perf_counter()
            record = cache.write_shard(0, samples, [])
            write_s = time.perf_counter() - start
            start = time.perf_counter()
            CacheReader(Path(folder) / "cache").read_shard(0)
            read_s = time.perf_counter() - start
        raw = num_tokens * raw_bf16_per_token
        end_to_end[storage] = {
            "write_shard_MBps": raw / write_s / 1e6, "write_shard_tokens_per_s": num_tokens / write_s,
            "read_shard_MBps": raw / read_s / 1e6, "read_shard_tokens_per_s": num_tokens / read_s,
            "stored_bytes_per_token": record["stored_bytes"] / num_tokens,
        }
        console.print(
            f"write_shard/read_shard ({storage}, {DEFAULT_CODEC}): write {end_to_end[storage]['write_shard_tokens_per_s']:,.0f} tokens/s "
            f"({end_to_end[storage]['write_shard_MBps']:,.0f} MB/s of bf16), read {end_to_end[storage]['read_shard_tokens_per_s']:,.0f} tokens/s "
            f"({end_to_end[storage]['read_shard_MBps']:,.0f} MB/s), {end_to_end[storage]['stored_bytes_per_token']:,.0f} bytes/token stored"
        )
    if json_path is not None:
        json_path.write_text(json.dumps({"target": loaded.identity.to_dict(), "layer_ids": layer_ids, "num_tokens": num_tokens,
                                         "codecs": results, "end_to_end": end_to_end}, indent=2))


if __name__ == "__main__":
    app()
