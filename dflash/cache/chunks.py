"""Encoding and storing whole ``hidden`` chunks off zarr's event loop, byte-identical to zarr's own encoding.

Why: ``array[lo:hi] = rows`` runs every chunk through zarr's asyncio codec pipeline: one event-loop thread
orchestrates all chunks of the process (selection, the crc32c and its ``np.append`` copy, the store call) and
hands only the compressor to worker threads. At the write rate an 8B target needs (~1.4 GB/s of bf16 hidden
states per GPU) that single thread and its hand-offs cap the write path well below what the cores can compress
(measured on the H200 host: 15 write threads kept only ~7.6 cores busy). Here a chunk job does the whole chain in
its own thread: ``bytes`` (little endian, C order) -> the compressor (numcodecs, GIL released) -> crc32c
(``google_crc32c``, the library zarr uses) -> one store ``set`` of the finished bytes under zarr's own chunk key.

The result is exactly what zarr writes for the same array metadata (``tests/test_cache.py`` compares the stored
bytes of every codec preset), so the cache stays a plain Zarr v3 group that zarr (and any Zarr v3 reader) reads
and checksums. Codec chains outside what this module knows return ``None`` from :func:`chunk_encoder`
and the caller falls back to zarr's own write.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from dflash.cache.store import key_io

__all__ = ["chunk_encoder", "decoder_for", "store_chunk", "stored_chunk_crc32c", "stored_chunk", "crc32c_trailer",
           "keep_chunk_buffers_mapped"]

_SHUFFLE = {"noshuffle": 0, "shuffle": 1, "bitshuffle": 2}


def chunk_encoder(array: Any) -> Callable[[np.ndarray], bytes] | None:
    """A function ``full chunk (array.chunks shape, array dtype, C order) -> stored bytes`` equal to zarr's codec
    pipeline for ``array`` (a zarr v3 ``Array``), or ``None`` if its codec chain is not one of
    ``bytes`` [-> ``blosc`` | ``zstd``] [-> ``crc32c``] (little-endian bytes). Thread-safe: numcodecs codecs and
    google_crc32c hold no per-call state."""
    import google_crc32c
    import numcodecs

    steps: list[Callable[[bytes | np.ndarray], Any]] = []
    codecs = [codec.to_dict() for codec in array.metadata.codecs]
    if not codecs or codecs[0].get("name") != "bytes":
        return None
    endian = (codecs[0].get("configuration") or {}).get("endian", "little")
    if endian != "little" and np.dtype(array.dtype).itemsize > 1:
        return None
    checksum = False
    for position, codec in enumerate(codecs[1:], start=1):
        name, config = codec.get("name"), dict(codec.get("configuration") or {})
        if name == "crc32c" and position == len(codecs) - 1:
            checksum = True
        elif name == "blosc" and not checksum:
            steps.append(numcodecs.Blosc(cname=config["cname"], clevel=int(config["clevel"]),
                                         shuffle=_SHUFFLE[config["shuffle"]], blocksize=int(config.get("blocksize", 0)),
                                         typesize=int(config["typesize"])).encode)  # fmt: skip
        elif name == "zstd" and not checksum:
            steps.append(numcodecs.Zstd(level=int(config.get("level", 0)), checksum=bool(config.get("checksum", False))).encode)
        else:
            return None
    chunk_shape = tuple(array.chunks)
    dtype = np.dtype(array.dtype).newbyteorder("<")

    def encode(chunk: np.ndarray) -> bytes:
        if chunk.shape != chunk_shape or chunk.dtype != dtype:
            raise ValueError(f"chunk has shape {chunk.shape} and dtype {chunk.dtype}; expected {chunk_shape} {dtype}")
        data: Any = np.ascontiguousarray(chunk).reshape(-1).view(np.uint8)
        for step in steps:
            data = step(data)
        data = bytes(data) if not isinstance(data, bytes) else data
        if checksum:
            data += google_crc32c.value(data).to_bytes(4, "little")
        return data

    return encode


def decoder_for(codec: dict[str, Any], dtype: Any, chunk_shape: tuple[int, ...]) -> Callable[[bytes], np.ndarray] | None:
    """A function ``stored bytes -> full chunk`` (``chunk_shape``, ``dtype``) for arrays written with the cache
    codec dict ``codec`` (``dflash.cache.format.codec_config``: ``bytes`` -> [blosc | zstd] -> ``crc32c``), or
    ``None`` for codecs it does not know (gzip: the caller lets zarr decode). It only strips the crc32c: the caller
    checks it first (the reader compares it with the commit record). Raises ``ValueError`` for a chunk that does
    not decode to the chunk's size."""
    name = codec.get("name")
    return _decoder([] if name == "none" else [name], np.dtype(dtype), tuple(chunk_shape))


def _decoder(names: list[Any], dtype: np.dtype, chunk_shape: tuple[int, ...]) -> Callable[[bytes], np.ndarray] | None:
    from numcodecs import blosc, zstd

    # The module functions, not the codec objects: their argument checks cost more than decoding a small chunk.
    steps: list[Callable[[Any], Any]] = []
    for name in names:
        if name == "blosc":
            steps.append(blosc.decompress)  # blosc frames carry their own settings
        elif name == "zstd":
            steps.append(zstd.decompress)
        else:
            return None
    dtype = dtype.newbyteorder("<")
    expected = int(np.prod(chunk_shape)) * dtype.itemsize

    def decode(data: bytes) -> np.ndarray:
        body: Any = memoryview(data)[:-4]
        for step in reversed(steps):
            body = step(body)
        raw = np.frombuffer(body, dtype=np.uint8)
        if raw.size != expected:
            raise ValueError(f"chunk decodes to {raw.size} bytes, expected {expected} ({chunk_shape} {dtype})")
        return raw.view(dtype).reshape(chunk_shape)

    return decode


def _chunk_path(array: Any, coords: tuple[int, ...]) -> str:
    """Store key of chunk ``coords`` of ``array``: its path in the store plus zarr's own chunk key encoding."""
    key = array.metadata.encode_chunk_key(coords)
    return f"{array.store_path.path}/{key}" if array.store_path.path else key


def crc32c_trailer(data: bytes) -> str:
    """The crc32c a ``crc32c``-codec chunk ends with (4 bytes, little endian), as 8 hex digits."""
    return data[-4:][::-1].hex()


def store_chunk(array: Any, coords: tuple[int, ...], data: bytes) -> None:
    """Store finished chunk bytes under ``array``'s own chunk key for ``coords`` (its store, its key encoding)."""
    key_io(array.store_path.store).set(_chunk_path(array, coords), data)


def stored_chunk(array: Any, coords: tuple[int, ...]) -> bytes | None:
    """The stored (encoded) bytes of chunk ``coords`` of ``array``, or ``None`` if the chunk is missing."""
    return key_io(array.store_path.store).get(_chunk_path(array, coords))


def stored_chunk_crc32c(array: Any, coords: tuple[int, ...]) -> str | None:
    """The crc32c trailer of a stored chunk (codec chains ending in ``crc32c``) as 8 hex digits, ``None`` if the
    chunk is missing."""
    data = stored_chunk(array, coords)
    return None if data is None or len(data) < 4 else crc32c_trailer(data)


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters (malloc.h)


def keep_chunk_buffers_mapped(max_chunk_bytes: int = 32 << 20) -> bool:
    """glibc only: serve allocations up to ``max_chunk_bytes`` (chunk buffers, codec outputs) from the heap and keep
    freed heap memory instead of returning it to the OS, so a writer process reuses its ~10 MB chunk buffers
    instead of page-faulting fresh ones for every chunk (measured: ~0.5 fewer kernel CPU-seconds per GB written on
    the 2-core CI box, where it raised write-only throughput 10-20%). Costs at most a few hundred MB of resident
    memory per process (chunk-sized buffers of the write threads). Call once per writer process; returns whether
    it took effect (False off glibc). Same effect as ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_``."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    threshold = min(int(max_chunk_bytes), 32 << 20)  # glibc caps the mmap threshold at 32 MiB on 64-bit
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, 1 << 30))
