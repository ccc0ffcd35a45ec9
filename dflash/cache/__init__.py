"""The hidden-state cache (docs/architecture.md, "Contracts": the cache): Zarr v3 shards of ragged samples in CSR form.

See docs/cache-format.md for the layout, the exactly-once rules and the codec measurements.
``HiddenStateCache`` writes (extract stage), ``CacheReader`` reads (trainer), ``verify_cache`` checks.
"""

from __future__ import annotations

from dflash.cache.format import (
    CODEC_PRESETS,
    DEFAULT_CODEC,
    FORMAT_VERSION,
    STORAGE_DTYPES,
    CacheMetadata,
    HiddenSample,
    codec_config,
    default_chunk_tokens,
    dequantize_fp8,
    find_nonfinite_layers,
    quantize_fp8,
    quarantine_record,
)
from dflash.cache.reader import CacheReader
from dflash.cache.verify import verify_cache, verify_shard
from dflash.cache.writer import HiddenStateCache

__all__ = [
    "CODEC_PRESETS",
    "DEFAULT_CODEC",
    "FORMAT_VERSION",
    "STORAGE_DTYPES",
    "CacheMetadata",
    "HiddenSample",
    "HiddenStateCache",
    "CacheReader",
    "codec_config",
    "default_chunk_tokens",
    "dequantize_fp8",
    "find_nonfinite_layers",
    "quantize_fp8",
    "quarantine_record",
    "verify_cache",
    "verify_shard",
]
