"""The hidden-state cache format (docs/architecture.md, "Contracts": the cache): metadata, samples, layout, codecs, fp8 scaling.

Layout of one Zarr v3 hierarchy (a local folder or any fsspec URL)::

    zarr.json                      root group; attribute ``dflash_cache`` = CacheMetadata.to_dict(),
                                   ``dflash_cache_counts`` = totals written by HiddenStateCache.finalize()
    shards/000007/                 one group per shard, written by exactly one task
        offsets      int64  [S+1]  CSR offsets: sample i is tokens offsets[i]:offsets[i+1]
        corpus_rows  int64  [S]    corpus row index of each sample
        input_ids    int32  [T]    flat token ids
        loss_mask    uint8  [T]    flat loss mask (1 = supervised token)
        hidden       uint16 [T, n*H]  bf16 bit patterns (storage_dtype "bfloat16"), or
                     uint8  [T, n*H]  float8_e4m3fn bit patterns (storage_dtype "float8_e4m3fn")
        hidden_scale float32 [T, n]   fp8 only: per-token, per-tap dequantization scale
    commits/shard-000007.json      commit record of shard 7, written LAST and atomically
    document_keys    uint64 [R]    optional: the corpus's ``Corpus.document_keys`` (source document of each of the
                                   R planned corpus rows), written at creation before any shard; it counts only
                                   once the root attribute ``dflash_document_keys`` (rows, documents, sha256) that
                                   is written after it exists. Absent: the cache was made from a corpus without
                                   ``document_id`` (or by older code) and the validation split goes by row.

Legend: S = samples in a shard, T = tokens in a shard, n = tapped layers, H = target hidden size, R = corpus rows.
The format version stays 1 with ``document_keys``: it is optional, and readers that do not know it ignore it.
A shard counts only when its commit record exists. Every chunk ends with a crc32c checksum (zarr v3 ``crc32c``
codec) and the commit record holds counts, per-array shapes and chunk counts, and a sha256 digest of the decoded
data, so a deleted, truncated or altered chunk is detected by ``verify`` and by the reader.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from dflash.errors import CacheError, ConfigError, DFlashError

__all__ = [
    "CORRUPT_SHARD_REPAIR",
    "DOCUMENT_KEYS_ARRAY",
    "DOCUMENT_KEYS_ATTRIBUTE",
    "METADATA_ATTRIBUTE",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "STORAGE_DTYPES",
    "CODEC_PRESETS",
    "DEFAULT_CODEC",
    "StorageDtype",
    "CacheMetadata",
    "HiddenSample",
    "codec_config",
    "codec_preset_name",
    "zarr_compressors",
    "default_chunk_tokens",
    "stored_row_bytes",
    "shard_group_key",
    "commit_key",
    "quantize_fp8",
    "dequantize_fp8",
    "find_nonfinite_layers",
    "quarantine_record",
]

#: What a CacheCorruptError tells the user to do about a corrupt shard (one wording for the reader and verify).
CORRUPT_SHARD_REPAIR = "withdraw the shard (`dflash-stages cache verify CACHE --uncommit-corrupt`) and rerun extract"

FORMAT_NAME = "dflash-hidden-state-cache"
FORMAT_VERSION = 1
#: Root-level array of the corpus's per-row document keys (optional; module docstring).
DOCUMENT_KEYS_ARRAY = "document_keys"
#: Root attribute committing :data:`DOCUMENT_KEYS_ARRAY`: ``{"num_rows", "num_documents", "sha256"}``, written after it.
DOCUMENT_KEYS_ATTRIBUTE = "dflash_document_keys"
#: The root attribute holding :meth:`CacheMetadata.to_dict`.
METADATA_ATTRIBUTE = "dflash_cache"
StorageDtype = Literal["bfloat16", "float8_e4m3fn"]
STORAGE_DTYPES: tuple[str, ...] = ("bfloat16", "float8_e4m3fn")
_FP8_MAX = 448.0  # largest finite float8_e4m3fn

# Named codecs (bytes -> bytes, applied before the crc32c checksum). The default is picked from
# benchmarks/codecs.py on real SmolLM2 hidden states; the figures are in docs/cache-format.md.
# Blosc blocks of 1 MiB: with blosc's automatic (small) blocks, byte-shuffled bf16 compresses to 1.24x only;
# 256 KiB+ blocks give 1.42x at the same speed (measured, docs/cache-format.md).
_BLOCK = 1 << 20
CODEC_PRESETS: dict[str, dict[str, Any]] = {
    "none": {"name": "none"},
    "zstd-1": {"name": "zstd", "level": 1},
    "blosc-lz4-shuffle": {"name": "blosc", "cname": "lz4", "clevel": 5, "shuffle": "shuffle", "blocksize": _BLOCK},
    "blosc-zstd1-shuffle": {"name": "blosc", "cname": "zstd", "clevel": 1, "shuffle": "shuffle", "blocksize": _BLOCK},
    "blosc-zstd3-shuffle": {"name": "blosc", "cname": "zstd", "clevel": 3, "shuffle": "shuffle", "blocksize": _BLOCK},
    "blosc-zstd1-bitshuffle": {"name": "blosc", "cname": "zstd", "clevel": 1, "shuffle": "bitshuffle", "blocksize": _BLOCK},
    "blosc-zstd1-shuffle-autoblock": {"name": "blosc", "cname": "zstd", "clevel": 1, "shuffle": "shuffle", "blocksize": 0},
    "gzip-1": {"name": "gzip", "level": 1},
}
DEFAULT_CODEC = "blosc-zstd1-shuffle"


def codec_config(codec: str | dict[str, Any]) -> dict[str, Any]:
    """Resolve a codec name from :data:`CODEC_PRESETS` (or a codec dict) into a validated codec dict.

    Raises:
        ConfigError: unknown name or malformed dict; the message lists the valid names.
    """
    if isinstance(codec, str):
        if codec not in CODEC_PRESETS:
            raise ConfigError(f"codec: unknown codec {codec!r}; choose one of {sorted(CODEC_PRESETS)}")
        return dict(CODEC_PRESETS[codec])
    if not isinstance(codec, dict) or codec.get("name") not in {"none", "zstd", "blosc", "gzip"}:
        raise ConfigError(f"codec: expected a dict with name none|zstd|blosc|gzip, got {codec!r}")
    return dict(codec)


def codec_preset_name(codec: dict[str, Any]) -> str:
    """The :data:`CODEC_PRESETS` name of a codec dict (as a cache records it), or its JSON text when no preset
    matches (a hand-made dict)."""
    resolved = codec_config(codec)
    return next((name for name, preset in CODEC_PRESETS.items() if preset == resolved), json.dumps(resolved))


def zarr_compressors(codec: dict[str, Any]) -> list[Any]:
    """The zarr v3 bytes->bytes codec chain for ``codec``, always ending with the crc32c checksum."""
    from zarr.codecs import BloscCodec, Crc32cCodec, GzipCodec, ZstdCodec

    name = codec["name"]
    chain: list[Any] = []
    if name == "zstd":
        chain.append(ZstdCodec(level=int(codec.get("level", 1))))
    elif name == "blosc":
        chain.append(
            BloscCodec(
                cname=codec.get("cname", "zstd"),
                clevel=int(codec.get("clevel", 1)),
                shuffle=codec.get("shuffle", "shuffle"),
                blocksize=int(codec.get("blocksize", 0)),
            )
        )
    elif name == "gzip":
        chain.append(GzipCodec(level=int(codec.get("level", 1))))
    chain.append(Crc32cCodec())
    return chain


def default_chunk_tokens(row_bytes: int, target_chunk_bytes: int = 8 << 20) -> int:
    """Tokens per ``hidden`` chunk: a power of two near ``target_chunk_bytes`` uncompressed, in [256, 8192].

    ``row_bytes`` is the stored size of one token's hidden row (n*H*2 for bf16). SmolLM2 with 5 taps -> 1024;
    an 8B target (H=4096) with 5 taps -> 256.
    """
    tokens = max(1, target_chunk_bytes // max(1, row_bytes))
    return int(min(8192, max(256, 2 ** int(math.log2(tokens)))))


def stored_row_bytes(storage_dtype: str, num_taps: int, hidden_size: int) -> int:
    """Stored bytes of one token's hidden row before compression: ``n*H*2`` for ``"bfloat16"``, ``n*H + 4n`` for
    ``"float8_e4m3fn"`` (one byte per value plus its float32 per-tap scales)."""
    width = num_taps * hidden_size
    return width * 2 if storage_dtype == "bfloat16" else width + 4 * num_taps


def shard_group_key(shard_id: int) -> str:
    """Zarr group path of shard ``shard_id`` inside the cache (``shards/000042``)."""
    return f"shards/{shard_id:06d}"


def commit_key(shard_id: int) -> str:
    """Store key of shard ``shard_id``'s commit record, written last and atomically; the shard counts only once
    it exists (docs/architecture.md, "Contracts": the cache)."""
    return f"commits/shard-{shard_id:06d}.json"


@dataclass(kw_only=True, slots=True)
class CacheMetadata:
    """Root metadata of a cache (contract 2); stored as the root attribute ``dflash_cache``.

    Fields:
        target: the target's ``TargetIdentity.to_dict()`` (name, content_hash, num_hidden_layers, hidden_size,
            vocab_size, model_type).
        target_spec: the spec string the target was loaded from (``"default"``, a path), so later stages can
            reload it without a flag.
        target_layer_ids: tapped decoder layers, strictly increasing.
        layer_id_convention: ``dflash.target.taps.LAYER_ID_CONVENTION`` (tap l = output of decoder layer l).
        hidden_size: H of the target.
        num_taps: n = len(target_layer_ids); hidden rows hold n taps of H values, concatenated in id order.
        final_tap: the rows hold one more slot after the n taps: the target's final normed hidden state
            (transformers' ``hidden_states[-1]``, the input of its LM head), for training against the target's
            own next-token distribution (``drafter.distill``). Rows are then (n+1)*H wide (:attr:`stored_taps`).
            Recorded only when true: a cache without it reads as before.
        storage_dtype: ``"bfloat16"`` (bit-exact) or ``"float8_e4m3fn"`` (lossy, per-token per-tap scale).
        codec: codec dict (see :data:`CODEC_PRESETS`); crc32c is always appended.
        corpus_fingerprint: ``Corpus.fingerprint`` of the corpus the cache was extracted from.
        corpus_path: where that corpus was read from (informative).
        num_shards: shards in the plan.
        shard_rows: ``[start, stop)`` corpus row range of each shard, ``len == num_shards``.
        chunk_tokens: tokens per chunk of the per-token arrays; 0 = :func:`default_chunk_tokens`.
        format_version: :data:`FORMAT_VERSION`.
        extra: free-form provenance (extract config, versions).
    """

    target: dict[str, Any]
    target_spec: str
    target_layer_ids: list[int]
    layer_id_convention: str
    hidden_size: int
    num_taps: int
    storage_dtype: str = "bfloat16"
    codec: dict[str, Any] = field(default_factory=lambda: codec_config(DEFAULT_CODEC))
    corpus_fingerprint: str
    corpus_path: str = ""
    num_shards: int
    shard_rows: list[list[int]]
    chunk_tokens: int = 0
    format_version: int = FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)
    final_tap: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.final_tap, bool):
            raise ConfigError(f"final_tap: expected true or false, got {self.final_tap!r}")
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        self.shard_rows = [[int(a), int(b)] for a, b in self.shard_rows]
        if self.format_version != FORMAT_VERSION:
            raise CacheError(
                f"format_version: cache format {self.format_version} is not supported (this code reads {FORMAT_VERSION}); "
                "re-extract the cache with this version of dflash-stages"
            )
        if self.storage_dtype not in STORAGE_DTYPES:
            raise ConfigError(f"storage_dtype: expected one of {STORAGE_DTYPES}, got {self.storage_dtype!r}")
        if self.num_taps != len(self.target_layer_ids) or self.num_taps < 1:
            raise ConfigError(f"num_taps: expected len(target_layer_ids) = {len(self.target_layer_ids)} >= 1, got {self.num_taps}")
        if self.hidden_size < 1:
            raise ConfigError(f"hidden_size: expected >= 1, got {self.hidden_size}")
        if self.num_shards != len(self.shard_rows):
            raise ConfigError(f"num_shards: expected len(shard_rows) = {len(self.shard_rows)}, got {self.num_shards}")
        previous_stop = 0
        for shard_id, (start, stop) in enumerate(self.shard_rows):
            if not previous_stop <= start <= stop:
                raise ConfigError(
                    f"shard_rows[{shard_id}]: expected sorted, non-overlapping [start, stop) ranges with start >= "
                    f"{previous_stop} (end of the previous shard) and start <= stop, got [{start}, {stop})"
                )
            previous_stop = stop
        if self.chunk_tokens < 0:
            raise ConfigError(f"chunk_tokens: expected >= 0 (0 = automatic), got {self.chunk_tokens}")
        if self.chunk_tokens == 0:
            self.chunk_tokens = default_chunk_tokens(self.row_bytes)
        self.codec = codec_config(self.codec)

    @property
    def stored_taps(self) -> int:
        """Slots of H values in a stored row: the n taps, plus the final normed hidden state with ``final_tap``."""
        return self.num_taps + int(self.final_tap)

    @property
    def row_width(self) -> int:
        """Width of one token's stored hidden row: ``stored_taps * H`` (n*H without the final tap)."""
        return self.stored_taps * self.hidden_size

    @property
    def row_bytes(self) -> int:
        """Stored bytes of one token's hidden row before compression (scales included for fp8)."""
        return stored_row_bytes(self.storage_dtype, self.stored_taps, self.hidden_size)

    @property
    def lossy(self) -> bool:
        return self.storage_dtype != "bfloat16"

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        if not self.final_tap:
            del data["final_tap"]  # recorded only when true: caches without it keep their metadata as it was
        data["format"] = FORMAT_NAME
        data["lossy"] = self.lossy
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CacheMetadata:
        """The metadata recorded in a cache's root attribute ``dflash_cache``.

        Raises:
            CacheError: not an object, another format, a required field missing or of the wrong type (e.g.
                ``hidden_size`` a string), naming the attribute and the fix; ``ConfigError`` for a value out of range.
        """
        if not isinstance(data, dict):
            raise CacheError(f"root attribute dflash_cache is a {type(data).__name__}, not an object; the cache's "
                             "metadata is damaged: re-extract the cache")
        if data.get("format", FORMAT_NAME) != FORMAT_NAME:
            raise CacheError(f"root attribute dflash_cache.format is {data.get('format')!r}, expected {FORMAT_NAME!r}")
        try:
            return cls(**{key: data[key] for key in cls.__dataclass_fields__ if key in data})
        except DFlashError:
            raise
        except (TypeError, ValueError, KeyError, AttributeError, OverflowError) as error:  # a field of a wrong type
            raise CacheError(f"root attribute dflash_cache: a field is missing or of the wrong type "
                             f"({type(error).__name__}: {str(error)[:120]}); the cache's metadata is damaged: "
                             "re-extract the cache") from None


@dataclass(slots=True)
class HiddenSample:
    """One cached sample.

    Fields:
        corpus_row: row index in the corpus the cache was extracted from.
        input_ids: ``Tensor[L] int32``.
        loss_mask: ``Tensor[L] uint8`` (1 = supervised token).
        hidden: ``Tensor[L, n*H] bfloat16``, taps concatenated in ``target_layer_ids`` order.
    """

    corpus_row: int
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    hidden: torch.Tensor

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def quantize_fp8(hidden: torch.Tensor, num_taps: int) -> tuple[np.ndarray, np.ndarray]:
    """Quantize ``hidden [T, n*H]`` (any float dtype) to float8_e4m3fn with one float32 scale per token and tap.

    ``scale = amax(|h|) / 448`` over each tap's H values (1.0 for an all-zero row), ``q = h / scale`` rounded to
    nearest by torch. Returns ``(bits uint8 [T, n*H], scale float32 [T, n])``. Lossy: relative error per value
    up to 2**-4 of the row's amax scale.
    """
    rows = hidden.shape[0]
    grouped = hidden.detach().to(torch.float32).reshape(rows, num_taps, -1)
    amax = grouped.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / _FP8_MAX, torch.ones_like(amax))
    quantized = (grouped / scale.unsqueeze(-1)).clamp_(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
    bits = quantized.reshape(rows, -1).view(torch.uint8).cpu().numpy()
    return bits, scale.cpu().numpy()


def dequantize_fp8(bits: np.ndarray, scale: np.ndarray, num_taps: int) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8`: ``uint8 [T, n*H]`` bits and ``float32 [T, n]`` scales -> ``bf16 [T, n*H]``."""
    rows = bits.shape[0]
    values = torch.from_numpy(np.ascontiguousarray(bits)).view(torch.float8_e4m3fn).to(torch.float32)
    values = values.reshape(rows, num_taps, -1) * torch.from_numpy(np.ascontiguousarray(scale)).unsqueeze(-1)
    return values.reshape(rows, -1).to(torch.bfloat16)


def find_nonfinite_layers(hidden: torch.Tensor, target_layer_ids: list[int]) -> list[int]:
    """Tapped layer ids whose slice of ``hidden [L, n*H]`` holds a NaN or an infinity (empty list: all finite)."""
    grouped = hidden.reshape(hidden.shape[0], len(target_layer_ids), -1)
    bad = (~torch.isfinite(grouped)).any(dim=-1).any(dim=0)
    return [layer_id for layer_id, is_bad in zip(target_layer_ids, bad.tolist(), strict=True) if is_bad]


def quarantine_record(corpus_row: int, sample_id: str | None, layer_ids: list[int], reason: str = "non-finite hidden states") -> dict[str, Any]:
    """The entry a quarantined sample gets in its shard's commit record (``write_shard(quarantined=[...])``)."""
    return {"corpus_row": int(corpus_row), "sample_id": sample_id, "layers": [int(i) for i in layer_ids], "reason": reason}
