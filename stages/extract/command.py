"""``dflash-stages extract``: tapped target hidden states of a corpus into a Zarr v3 cache, scheduled with Dask.

Run::

    dflash-stages extract --corpus data/corpus --output data/cache --target-gpus 0,1,2,3   # one worker per GPU
    dflash-stages extract --corpus data/corpus --output data/cache --target-processes 2    # CPU processes
    dflash-stages extract --corpus data/corpus --output data/cache --scheduler-address tcp://host:8786

Order of work: lock the output (``dflash.io.locks``: one extract per cache; the driver holds the lock until it returns
and the workers write under it), open and validate the corpus against the target's vocabulary (no GPU touched), plan shards
(contiguous row ranges of about ``--shard-size`` tokens), reopen an existing cache (a rerun resumes: committed
shards are skipped; it keeps its own codec), print the size estimate and refuse when it exceeds the free space
(``--force-space`` overrides), start the cluster, load the target once per worker (WorkerPlugin); for a new cache
choose its codec (``--codec auto``: a calibration task on every worker at once, ``dflash.cache.codec_choice``) and
only then create it; submit one task per pending shard, follow them with a rich progress bar in tokens/s, then
collect the last pending writes and trust only the cache's commit records: shards still uncommitted are
resubmitted once, and any left are reported (rerun to finish). An error the user must fix that a shard's task meets
(a corpus the worker may not read, a full disk: ``stages.replicas.tasks``) stops the run without another round:
the pending writes are collected, the committed shards kept, and that error is the one ``error:`` line.
A local cluster listens on 127.0.0.1 only (its dashboard included); ``--tls-*`` connect to a TLS scheduler
(docs/cache-format.md, "Running extract on a shared machine or cluster").
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np
import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    ProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

from dflash.drafter.config import DEFAULT_NUM_DRAFT_LAYERS
from dflash.errors import CacheError, ConfigError, DFlashError
from dflash.io.locks import output_lock
from dflash.progress import DEFAULT_PROGRESS_INTERVAL, LogProgress, check_progress_interval
from dflash.target.load import PACKED_ATTENTION, resolve_target_path, target_identity
from dflash.target.taps import LAYER_ID_CONVENTION, tapped_layer_ids
from stages.config.check import dtype_spelling
from stages.config.exit_status import ExitCode, print_error
from stages.config.options import CommandSettings, config_options, setting
from stages.config.resolve import print_and_exit, resolve_stage_config
from stages.replicas.cluster import (
    close_cluster,
    cluster_workers,
    require_local_gpus,
    start_cluster,
    validate_placement,
)
from stages.replicas.tasks import task_result, user_error_of

__all__ = ["ExtractConfig", "CachePlan", "run_extract", "plan_cache", "create_cache", "prepare_cache", "plan_shards",
           "estimate_cache_bytes", "register"]

log = logging.getLogger(__name__)

_STORAGE_DTYPES = {"bf16": "bfloat16", "fp8": "float8_e4m3fn"}
_MAX_ROUNDS = 2
CodecCalibration = Literal["auto", "always", "never"]
_CODEC_CALIBRATION: tuple[str, ...] = get_args(CodecCalibration)


@dataclass(kw_only=True, slots=True)
class ExtractConfig:
    """Everything ``extract`` needs; saved into the cache's ``extra`` provenance. Each field's help is its one
    description (``--help``, docs/config-reference.md)."""

    corpus: str = setting(help='Corpus folder (Arrow/Parquet, contract 1). Required (here or in --config/--preset/--set).')
    output: str = setting(short='-o', help='Cache path or fsspec URL; an existing cache of the same plan is resumed. Required (here or in --config/--preset/--set).')
    target: str = setting("default", help="'default' (SmolLM2-135M-Instruct), a transformers folder or a .gguf file.")
    target_layer_ids: list[int] | None = setting(None, help='Tapped decoder layers, e.g. 1,9,17,25,33 (output of decoder layer l = hidden_states\\[l+1]).')
    num_taps: int = setting(DEFAULT_NUM_DRAFT_LAYERS, help="Taps for DFlash's default layer rule when --target-layer-ids is not given: one per draft layer of the drafter to train.")
    target_gpus: list[int] | None = setting(None, help='GPUs, one Dask worker each, e.g. 0,1,2,3 (default: all visible GPUs, else --target-processes 1).')
    target_processes: int | None = setting(None, help='CPU processes for target replicas, one Dask worker each.')
    scheduler_address: str | None = setting(None, help='Existing Dask scheduler (workers with resource GPU=1 get one task at a time).')
    shard_size: int = setting(65536, help='Target tokens per shard (one task, one commit).')
    forward_tokens: int = setting(16384, help='Padded tokens per forward batch (rows x longest); with --packing, tokens per packed row.')
    packing: bool = setting(False, help="Packed forward batches: samples back to back with attention confined to each, no padding. Same hidden states; on a long-tailed corpus about as fast as padded batches, and short samples such as SmolLM2's replies gain little, so off by default (docs/benchmarks.md, Packed vs padded batches).")
    packed_attention: Literal["auto", "flex_attention", "sdpa", "varlen"] = setting("auto", help='Attention kernel of --packing: auto (varlen on GPU workers whose torch has it, else flex_attention; sdpa on CPU workers) | flex_attention (document mask) | sdpa (block-diagonal mask; the slowest on GPU) | varlen (FlashAttention varlen over the sample boundaries; GPU workers, torch >= 2.10; the fastest on GPU). Measured: docs/benchmarks.md, Packed vs padded batches.')
    storage_dtype: Literal["bf16", "fp8"] = setting("bf16", help='bf16 (bit-exact) or fp8 (lossy e4m3, per-token per-tap scale); bfloat16 and float8_e4m3fn also accepted.')
    codec: str = setting("auto", help='auto, or a codec preset of dflash.cache.CODEC_PRESETS, e.g. none, zstd-1, blosc-zstd1-shuffle (an unknown name lists them). auto: measured on the workers before the cache is created, the best-compressing of blosc-zstd1-shuffle, blosc-lz4-shuffle, none that encodes >= 1.25x the rate hidden states are produced (CUDA runners; CPU runners get blosc-zstd1-shuffle unmeasured); recorded in the cache and printed; an existing cache keeps its codec. If even none cannot keep up, use --storage-dtype fp8 or the online mode (docs/cache-format.md).')
    codec_calibration: CodecCalibration = setting("auto", help='When --codec auto measures: auto (CUDA runners only), always (CPU runners too), never (the default codec, unmeasured).')
    max_length: int | None = setting(None, help='Longest row accepted (see --length-policy).')
    length_policy: Literal["error", "drop", "truncate"] = setting("error", help='Rows over --max-length: error, drop or truncate.')
    force_space: bool = setting(False, option='--force-space', help='Start even if the estimate exceeds the free space.')
    expected_ratio: float = setting(1.0, help='Compression ratio assumed by the size estimate.')
    dashboard_address: str = setting("127.0.0.1:0", runtime=True, help='Dashboard of a local cluster, HOST:PORT (its link is printed); the default (a free port) and a bare :PORT bind 127.0.0.1 (this machine only), 0.0.0.0:PORT serves every interface, unauthenticated; port 0 = any free port.')
    tls_ca_file: str | None = setting(None, help='With --scheduler-address tls://...: CA certificate of the cluster (with --tls-cert, --tls-key; docs/cache-format.md).')
    tls_cert: str | None = setting(None, help='Client certificate for a TLS scheduler.')
    tls_key: str | None = setting(None, help='Client private key for a TLS scheduler.')
    break_lock: bool = setting(False, runtime=True, option='--break-lock', help="Take over the cache's lock left by a run on another host that is known dead (docs/cache-format.md).")
    write_threads: int | None = setting(None, help='Chunk-write threads per worker: gather, compress, checksum, store (default: CPU cores per worker - 1, at most 32).')
    writes_in_flight: int = setting(3, help='Shard writes per worker overlapping its compute (each holds one shard in host memory).')
    write_processes: int | None = setting(None, help='Write shards in N processes per worker that read the hidden states from shared memory (/dev/shm; if it is too small, threads are used with a warning); 0: in threads of the worker (default: 2 on GPU workers, 0 on CPU workers). An external cluster (--scheduler-address) needs distributed.worker.daemon: false in its config, else its workers write in threads.')
    final_tap: bool = field(default=False, metadata={"help": (
        "Also store the target's final normed hidden state (the input of its LM head) as one more slot per token, "
        "which train's drafter.distill needs; the cache grows by one tap's share.")})
    #: Free-form entries recorded in the cache metadata (provenance a caller adds; extract does not read them).
    extra: dict[str, Any] = field(default_factory=dict)
    progress_interval: float = field(default=DEFAULT_PROGRESS_INTERVAL, metadata={"runtime": True,
        "help": "Seconds between two progress lines (tokens, shards, rate, ETA) when output is not a terminal; 0: none."})

    def __post_init__(self) -> None:
        check_progress_interval(self.progress_interval)
        validate_placement(self)
        for name in ("num_taps", "shard_size", "forward_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: expected >= 1, got {getattr(self, name)}")

        self.storage_dtype = dtype_spelling(self.storage_dtype, tuple(_STORAGE_DTYPES))
        if self.storage_dtype not in _STORAGE_DTYPES:
            raise ConfigError(f"storage_dtype: expected one of {sorted(_STORAGE_DTYPES)}, got {self.storage_dtype!r}")

        if self.packed_attention not in PACKED_ATTENTION:
            raise ConfigError(f"packed_attention: expected one of {'|'.join(PACKED_ATTENTION)}, "
                              f"got {self.packed_attention!r}")
        if self.packing and self.packed_attention == "varlen" and not self.target_gpus and not self.scheduler_address:
            raise ConfigError("packed_attention: varlen runs FlashAttention on GPU workers only, and this extract "
                              "has CPU workers (no target_gpus); set target_gpus, or use flex_attention or sdpa")
        from dflash.cache import CODEC_PRESETS

        if self.codec != "auto" and self.codec not in CODEC_PRESETS:
            raise ConfigError(f"codec: expected auto or one of {', '.join(CODEC_PRESETS)}, got {self.codec!r}")
        if self.codec_calibration not in _CODEC_CALIBRATION:
            raise ConfigError(f"codec_calibration: expected one of {'|'.join(_CODEC_CALIBRATION)}, got "
                              f"{self.codec_calibration!r}")
        if self.length_policy not in ("error", "drop", "truncate"):
            raise ConfigError(f"length_policy: expected error|drop|truncate, got {self.length_policy!r}")
        if self.max_length is not None and self.max_length < 1:
            raise ConfigError(f"max_length: expected >= 1, got {self.max_length}")
        if self.write_threads is not None and self.write_threads < 1:
            raise ConfigError(f"write_threads: expected >= 1, got {self.write_threads}")
        if self.writes_in_flight < 1:
            raise ConfigError(f"writes_in_flight: expected >= 1, got {self.writes_in_flight}")
        if self.write_processes is not None and self.write_processes < 0:
            raise ConfigError(f"write_processes: expected >= 0, got {self.write_processes}")
        if not self.expected_ratio > 0:
            raise ConfigError(f"expected_ratio: expected > 0, got {self.expected_ratio}")


def plan_shards(lengths: np.ndarray, shard_size: int) -> list[list[int]]:
    """Contiguous ``[start, stop)`` row ranges holding about ``shard_size`` tokens each (at least one row).

    Deterministic in the corpus lengths and ``shard_size``, so a rerun finds the same plan.
    """
    cumulative = np.concatenate([[0], np.cumsum(np.asarray(lengths, dtype=np.int64))])
    ranges, start = [], 0
    while start < len(lengths):
        # Last row whose end stays within the budget, at least one row.
        stop = int(np.searchsorted(cumulative, cumulative[start] + shard_size, side="right")) - 1
        stop = max(stop, start + 1)
        ranges.append([start, stop])
        start = stop
    return ranges


def estimate_cache_bytes(num_tokens: int, row_bytes: int, expected_ratio: float) -> int:
    """Bytes a cache of ``num_tokens`` tokens needs: ``tokens x (n*H*bytes [+ fp8 scales]) / ratio`` plus 13
    bytes per token for ``input_ids`` (int32), ``loss_mask`` (uint8) and CSR offsets/rows (upper bound)."""
    return int(num_tokens * row_bytes / expected_ratio) + 13 * int(num_tokens)


def _free_bytes(output: str) -> int | None:
    """Free bytes at the output's filesystem (nearest existing ancestor); ``None`` for remote URLs."""
    if "://" in output and not output.startswith("file://"):
        return None
    path = Path(output.removeprefix("file://")).expanduser().resolve()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def _human(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if num_bytes < 1024 or unit == "TiB":
            return f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")


class _TokensPerSecond(ProgressColumn):
    """Throughput of a progress task counted in tokens."""

    def render(self, task: Any) -> Text:
        # rich estimates speed from the last updates; with one or two shard updates (small or resumed runs) it has
        # none, so fall back to the task's average over its elapsed time.
        speed = task.finished_speed or task.speed
        if not speed and task.completed and task.elapsed:
            speed = task.completed / task.elapsed
        return Text(f"{speed or 0:,.0f} tok/s", style="progress.data.speed")


def _default_write_threads(placement: dict[str, Any]) -> int | None:
    """CPU cores per worker - 1 (at most 32) for a LocalCluster (cores split evenly between its workers); ``None`` for
    an external scheduler (each worker then uses its own CPU count)."""
    workers = placement.get("num_workers")
    if not workers:
        return None
    from stages.extract.worker import default_write_threads

    return default_write_threads(max(1, (os.cpu_count() or 1) // workers))


@dataclass(slots=True)
class CachePlan:
    """What :func:`plan_cache` found, before anything is created.

    Fields:
        metadata: the cache's ``CacheMetadata``: an existing cache's codec when it is resumed with ``codec
            "auto"``; for a new cache with ``"auto"`` the default codec until :func:`create_cache` records the choice.
        cache: the existing cache at ``output`` (reopened and checked resumable against ``metadata``), or ``None``.
        corpus: the opened corpus.
        shard_rows: the shard plan, ``[start, stop)`` corpus rows per shard.
        report: the corpus's ``CorpusReport`` (kept rows, truncation).
    """

    metadata: Any
    cache: Any
    corpus: Any
    shard_rows: list[list[int]]
    report: Any


def plan_cache(config: ExtractConfig, console: Console) -> CachePlan:
    """Validate corpus and target (no model weights loaded), build the metadata, reopen an existing cache (it must
    be resumable with these settings), print the size estimate and refuse when it exceeds the free space. Creates
    nothing: a new cache is made by :func:`create_cache` once its codec is known.

    Raises:
        CorpusError, TargetError: see :func:`run_extract`.
        CacheError: ``output`` is a file or holds something else than a dflash cache, the existing cache differs
            in a setting a resume must keep (named), or the estimate exceeds the free space.
    """
    from dflash.cache import DEFAULT_CODEC, CacheMetadata, HiddenStateCache
    from dflash.cache.codec_choice import AUTO_CODEC
    from dflash.cache.format import codec_preset_name
    from dflash.corpus.format import open_corpus, validate_corpus

    output = config.output[len("file://"):] if config.output.startswith("file://") else config.output
    if "://" not in output and os.path.exists(output) and not os.path.isdir(output):
        raise CacheError(
            f"output: {config.output} exists and is not a folder (a cache is a folder); pass --output a new folder or "
            "the cache to finish"
        )
    corpus = open_corpus(config.corpus)
    identity = target_identity(resolve_target_path(config.target))
    report = validate_corpus(
        corpus, vocab_size=identity.vocab_size, max_length=config.max_length, length_policy=config.length_policy
    )
    layer_ids = tapped_layer_ids(identity.num_hidden_layers, config.num_taps, config.target_layer_ids)
    lengths = _stored_lengths(corpus, report)
    shard_rows = plan_shards(lengths, config.shard_size)
    try:
        existing = HiddenStateCache.open(config.output)
    except (CacheError, FileNotFoundError):
        existing = None
        HiddenStateCache.check_creatable(config.output)  # refused now, not after the workers loaded the target
    auto = config.codec == AUTO_CODEC
    metadata = CacheMetadata(
        target=identity.to_dict(),
        target_spec=str(config.target),
        target_layer_ids=layer_ids,
        layer_id_convention=LAYER_ID_CONVENTION,
        hidden_size=identity.hidden_size,
        num_taps=len(layer_ids),
        storage_dtype=_STORAGE_DTYPES[config.storage_dtype],
        # "auto": an existing cache keeps its own codec (a resume never re-chooses); a new one gets its choice in
        # create_cache, the default until then.
        codec=(existing.metadata.codec if existing is not None else DEFAULT_CODEC) if auto else config.codec,
        corpus_fingerprint=corpus.fingerprint,
        corpus_path=str(config.corpus),
        num_shards=len(shard_rows),
        shard_rows=shard_rows,
        final_tap=config.final_tap,
        extra={"extract_config": {**asdict(config), "extra": None}, "corpus_report": report.to_dict(), **config.extra},
    )
    console.print(
        f"corpus {config.corpus}: {len(corpus):,} rows, {int(lengths.sum()):,} tokens, {len(shard_rows)} shards; "
        f"target {identity.name} ({identity.num_hidden_layers} layers, H={identity.hidden_size}), "
        f"taps {layer_ids} (output of decoder layer l = hidden_states[l+1])",
        markup=False,
    )
    committed = existing.committed_shards() if existing is not None else set()
    pending_tokens = int(sum(lengths[a:b].sum() for k, (a, b) in enumerate(shard_rows) if k not in committed))
    estimate = estimate_cache_bytes(pending_tokens, metadata.row_bytes, config.expected_ratio)
    free = _free_bytes(config.output)
    console.print(
        f"size estimate: {pending_tokens:,} tokens x {metadata.stored_taps} taps x {metadata.hidden_size} x "
        f"{metadata.row_bytes // metadata.row_width} B / ratio {config.expected_ratio:g} = {_human(estimate)}"
        + (f"; free at destination: {_human(free)}" if free is not None else "; free space unknown (remote store)")
    )
    if free is not None and estimate > free and not config.force_space:
        raise CacheError(
            f"the cache needs about {_human(estimate)} but {config.output} has {_human(free)} free; free space, "
            "choose another --output, use --storage-dtype fp8, or pass --force-space (or --expected-ratio R if "
            "you know the codec's ratio on this data)"
        )
    cache = None
    if existing is not None:
        # Reopens it, refusing a setting a resume changes; document keys it lacks are added (see create_cache).
        cache = HiddenStateCache.create(config.output, metadata, document_keys=_document_keys(corpus))
        if auto:
            first = cache.metadata.extra.get("codec_choice") or {}
            console.print(f"codec auto: {config.output} exists and keeps its codec "
                          f"{codec_preset_name(cache.metadata.codec)} (no calibration)"
                          + (f"; chosen when it was created: {first['reason']}" if first.get("reason") else ""),
                          markup=False)  # fmt: skip
    return CachePlan(metadata=metadata, cache=cache, corpus=corpus, shard_rows=shard_rows, report=report)


def _stored_lengths(corpus: Any, report: Any) -> np.ndarray:
    """Tokens each corpus row gets in the cache (rows cut to ``max_length`` under ``length_policy="truncate"``)."""
    return corpus.lengths if report.truncate_to is None else np.minimum(corpus.lengths, report.truncate_to)


def create_cache(config: ExtractConfig, plan: CachePlan, choice: dict[str, Any] | None = None) -> Any:
    """Create the new cache :func:`plan_cache` planned (``plan.cache is None``), with ``choice`` (a
    ``dflash.cache.codec_choice`` record) as its codec and ``extra["codec_choice"]`` when the codec was ``auto``.

    Raises:
        CacheError: ``config.output`` holds something else meanwhile (``HiddenStateCache.create``).
    """
    from dflash.cache import HiddenStateCache, codec_config

    assert plan.cache is None, "create_cache is for a new cache"
    if choice is not None:
        plan.metadata.codec = codec_config(choice["chosen"])
        plan.metadata.extra["codec_choice"] = choice
    # The corpus's document keys go in before any shard, so train splits validation by source document without
    # the corpus.
    return HiddenStateCache.create(config.output, plan.metadata, document_keys=_document_keys(plan.corpus))


def _document_keys(corpus: Any) -> Any:
    """``uint64 [rows]`` document keys of a corpus that names its documents (``document_id``), else ``None``."""
    return corpus.document_keys if corpus.has_document_ids else None


def prepare_cache(config: ExtractConfig, console: Console, *,
                  auto_reason: str = "decided without extract workers to measure on") -> tuple[Any, Any, list[list[int]], Any]:  # fmt: skip
    """:func:`plan_cache`, then create a new cache right away: without workers to measure on, ``codec "auto"``
    resolves to the default codec, recorded with ``auto_reason`` (``online --cache-to`` gives its own). Returns
    ``(cache, corpus, shard_rows, report)``. Raises as :func:`plan_cache`."""
    from dflash.cache.codec_choice import AUTO_CODEC, uncalibrated_choice

    plan = plan_cache(config, console)
    cache = plan.cache
    if cache is None:
        cache = create_cache(config, plan, uncalibrated_choice(auto_reason) if config.codec == AUTO_CODEC else None)
    return cache, plan.corpus, plan.shard_rows, plan.report


def run_extract(config: ExtractConfig, console: Console | None = None) -> dict[str, Any]:
    """Run the extract stage (see the module docstring). Returns a summary dict (counts, tokens/s, cache size).

    Raises:
        CorpusError: the corpus fails its schema/vocab check (before any GPU work).
        TargetError: the target cannot be found or the layer ids are out of range.
        CacheError: the output holds another cache or not enough free space; shards still uncommitted at the
            end (rerun the same command to finish them).
        LockError: another extract writes the same output (``dflash.io.locks``; this run holds the lock from before
            the cache is opened until it returns, its Dask workers write under it).
    """
    with output_lock(config.output, what="cache", break_lock=config.break_lock):
        return _run_extract_locked(config, console)


def _remove_staging(output: str) -> None:
    """An online ``--cache-to`` run's staging folder, obsolete once every shard is committed (we hold the lock)."""
    from dflash.cache.staging import remove_staging

    if remove_staging(output):
        log.info("removed %s/staging, the staged batches of an online --cache-to run (every shard is committed)", output)


def _run_extract_locked(config: ExtractConfig, console: Console | None) -> dict[str, Any]:
    from distributed import as_completed

    from dflash.cache.codec_choice import AUTO_CODEC
    from dflash.cache.format import codec_preset_name
    from dflash.cache.store import remove_partial_files
    from stages.extract.worker import ShardSpec, TargetWorkerPlugin, extract_shard, flush_worker

    console = console or Console()

    require_local_gpus(config)  # local GPU workers on a host without CUDA: refused before any file exists
    plan = plan_cache(config, console)
    cache, corpus, shard_rows, report = plan.cache, plan.corpus, plan.shard_rows, plan.report
    lengths = _stored_lengths(corpus, report)
    kept = np.zeros(len(corpus), dtype=bool)
    kept[report.kept_rows] = True

    def spec_of(shard_id: int) -> ShardSpec:
        start, stop = shard_rows[shard_id]
        return ShardSpec(
            shard_id=shard_id,
            row_start=start,
            row_stop=stop,
            num_tokens=int(lengths[start:stop][kept[start:stop]].sum()),
            cache_path=str(config.output),
            corpus_path=str(config.corpus),
            max_length=config.max_length,
            length_policy=config.length_policy,
        )

    staged: list[int] = []
    if cache is not None:  # a new cache is created below, once the workers have loaded the target
        # Temporaries of a writer killed between write and rename (e.g. during finalize): ours to clear, we hold
        # the lock.
        for leftover in remove_partial_files(config.output):
            log.warning("removed %s/%s, a temporary file left by an interrupted write", config.output, leftover)
        if report.truncate_to is None and len(report.kept_rows) == len(corpus):  # staged rows are whole rows
            from dflash.cache.staging import commit_staged_shards

            staged = commit_staged_shards(cache, corpus)
            if staged:
                console.print(f"committed {len(staged)} shards from the batches an online --cache-to run left staged "
                              f"in {config.output}")
    pending = sorted(set(range(len(shard_rows))) - (cache.committed_shards() if cache is not None else set()))
    summary: dict[str, Any] = {"planned_shards": len(shard_rows), "from_staging": len(staged),
                               "skipped_committed": len(shard_rows) - len(pending) - len(staged)}  # fmt: skip
    if not pending:
        console.print(f"all {len(shard_rows)} shards of {config.output} are committed; nothing to do")
        _remove_staging(config.output)
        summary.update(cache.finalize())
        summary["codec"] = codec_preset_name(cache.metadata.codec)
        summary["codec_choice"] = cache.metadata.extra.get("codec_choice")
        return summary
    if summary["skipped_committed"]:
        console.print(f"resuming: {summary['skipped_committed']} shards already committed, {len(pending)} to do")

    client, cluster, placement = start_cluster(config, daemonic_workers=config.write_processes == 0)
    failures: dict[int, str] = {}
    user_error: BaseException | None = None  # the first error the user must fix that a shard's task returned
    tokens_done = 0
    compute_seconds = write_wait_seconds = 0.0  # summed over tasks (telemetry: where the workers spent their time)
    batching: set[str] = set()  # how the workers batched ("padded" or "packed (<kernel resolved on the worker>)")
    try:
        console.print(f"Dask dashboard: {client.dashboard_link}")
        plugin = TargetWorkerPlugin(
            target_spec=str(config.target),
            target_layer_ids=plan.metadata.target_layer_ids,
            forward_tokens=config.forward_tokens,
            gpu_by_worker=placement.get("gpu_by_worker"),
            device=placement["device"],
            torch_threads=placement.get("torch_threads"),
            die_with_parent=placement["die_with_parent"],
            write_threads=config.write_threads or _default_write_threads(placement),
            writes_in_flight=config.writes_in_flight,
            write_processes=config.write_processes,
            packing=config.packing,
            packed_attention=config.packed_attention,
            final_tap=config.final_tap,
        )
        loading = time.perf_counter()
        client.register_plugin(plugin)  # runs setup on every worker; re-raises a worker's loading error here
        console.print(f"target loaded on {len(cluster_workers(client))} workers in {time.perf_counter() - loading:.1f} s")
        if cache is None:  # a new cache: its codec is chosen now (nothing is written before it is created)
            choice = None
            if config.codec == AUTO_CODEC:
                rows = _calibration_rows(pending, shard_rows, lengths, kept, config.forward_tokens, config.packing)
                choice = _choose_codec(client, config, plan, rows, placement["resources"], console)
            cache = create_cache(config, plan, choice)

        started = time.perf_counter()
        columns = [TextColumn("[bold]extract"), BarColumn(), TextColumn("{task.completed:,.0f}/{task.total:,.0f} tok"),
                   _TokensPerSecond(), TextColumn("{task.fields[shards]}"), TimeElapsedColumn(), TimeRemainingColumn()]
        # On a terminal a bar; in a log a line every progress_interval seconds (dflash.progress).
        with LogProgress(*columns, console=console, transient=False, unit="tokens",
                         interval=config.progress_interval) as progress:
            todo = pending
            for attempt in range(_MAX_ROUNDS):
                specs = [spec_of(k) for k in todo]
                bar = progress.add_task("extract", total=sum(s.num_tokens for s in specs), shards=f"0/{len(specs)} shards")
                futures = [
                    client.submit(extract_shard, spec, key=f"dflash-extract-{spec.shard_id:06d}-r{attempt}", pure=False,
                                  resources=placement["resources"])
                    for spec in specs
                ]
                done = 0
                for future in as_completed(futures):
                    shard_id = int(future.key.split("-")[2])
                    try:
                        result = future.result()
                    except Exception as error:  # the shard stays uncommitted; reported and retried below
                        failures[shard_id] = f"{type(error).__name__}: {error}"
                        log.error("shard %d failed: %s", shard_id, failures[shard_id])
                        continue
                    returned = user_error_of(result)
                    if returned is not None:  # the user's to fix (stages.replicas.tasks): every later shard would
                        user_error = returned  # fail the same way, and so would another round
                        failures[shard_id] = f"{type(returned).__name__}: {returned}"
                        client.cancel([f for f in futures if not f.done()])
                        break
                    done += 1
                    tokens_done += result["tokens"]
                    compute_seconds += float(result.get("compute_seconds", 0.0))
                    write_wait_seconds += float(result.get("write_wait_seconds", 0.0))
                    batching.add(str(result.get("batching", "padded")))
                    _report_write_errors(result["committed"], failures)
                    progress.update(bar, advance=result["tokens"], shards=f"{done}/{len(specs)} shards computed")
                    future.release()
                    if any(_disk_full(failure) for failure in failures.values()):
                        client.cancel([f for f in futures if not f.done()])  # the rest would fail the same way
                        break
                for writes in client.run(flush_worker).values():
                    _report_write_errors(writes, failures)
                todo = sorted(set(range(len(shard_rows))) - cache.committed_shards())
                if not todo or user_error is not None or any(_disk_full(failures.get(k, "")) for k in todo):
                    break  # done, or the user's to fix (a full disk...): another round would only fail again
                console.print(f"[yellow]{len(todo)} shards not committed after round {attempt + 1}: {todo[:10]}; retrying")
        elapsed = time.perf_counter() - started
    finally:
        close_cluster(client, cluster)

    counts = cache.finalize()
    summary.update(counts)
    # Quarantined samples of every committed shard, from the commit records (a shard's last batch is finished by
    # its write, after the shard's task returned: stages.extract.worker.ShardExtractor.process).
    quarantined = [{**entry, "shard": shard} for shard in sorted(cache.committed_shards())
                   for entry in (cache.commit_record(shard) or {}).get("quarantined", [])]  # fmt: skip
    summary["codec"] = codec_preset_name(cache.metadata.codec)
    summary["codec_choice"] = cache.metadata.extra.get("codec_choice")
    if not set(range(len(shard_rows))) - cache.committed_shards():
        _remove_staging(config.output)
    summary.update({"tokens_computed": tokens_done, "seconds": elapsed, "tokens_per_second": tokens_done / max(elapsed, 1e-9),
                    "compute_seconds": compute_seconds, "write_wait_seconds": write_wait_seconds,
                    "batching": ", ".join(sorted(batching))})
    _print_summary(console, config, summary, quarantined)
    missing = sorted(set(range(len(shard_rows))) - cache.committed_shards())
    if missing and any(_disk_full(failures.get(k, "")) for k in missing):
        rest = estimate_cache_bytes(int(sum(spec_of(k).num_tokens for k in missing)), cache.metadata.row_bytes,
                                    config.expected_ratio)  # fmt: skip
        free = _free_bytes(config.output)
        raise CacheError(
            f"no space left at {config.output}: {len(shard_rows) - len(missing)} of {len(shard_rows)} shards are "
            f"committed and kept; the other {len(missing)} (first: {missing[:10]}) need about {_human(rest)} more"
            + (f" ({_human(free)} free now)" if free is not None else "")
            + "; free space (or use --storage-dtype fp8) and rerun the same command to finish them"
        )
    if missing and user_error is not None:  # the committed shards stay; the rerun resumes once it is fixed
        raise user_error
    if missing:
        reasons = "; ".join(f"shard {k}: {failures[k]}" for k in missing[:5] if k in failures)
        raise CacheError(
            f"{len(missing)} of {len(shard_rows)} shards of {config.output} are not committed (first: {missing[:10]})"
            + (f" ({reasons})" if reasons else "")
            + "; rerun the same command to finish them"
        )
    return summary


def _calibration_rows(pending: list[int], shard_rows: list[list[int]], lengths: np.ndarray, kept: np.ndarray,
                      forward_tokens: int, packing: bool) -> list[int]:  # fmt: skip
    """The corpus rows the codec calibration runs: the first kept rows of the first pending shard that make one
    forward batch (``dflash.cache.codec_choice.calibration_row_count``), continued into the next pending shards
    when a shard is smaller than a batch."""
    from dflash.cache.codec_choice import calibration_row_count

    rows: list[int] = []
    for shard_id in pending:  # each row holds a token, so forward_tokens rows are always enough
        start, stop = shard_rows[shard_id]
        rows += [row for row in range(start, stop) if kept[row]][: forward_tokens - len(rows)]
        if len(rows) >= forward_tokens:
            break
    return rows[: calibration_row_count(lengths[rows], forward_tokens, packing)]


def _choose_codec(client: Any, config: ExtractConfig, plan: CachePlan, rows: list[int], resources: Any,
                  console: Console) -> dict[str, Any]:  # fmt: skip
    """``codec "auto"`` for a new cache: a calibration task on every worker at once (``codec_calibration``
    permitting), then ``dflash.cache.codec_choice.choose_codec``; prints the choice in one line and warns when even
    ``none`` cannot keep up. Returns the ``extra["codec_choice"]`` record."""
    from dflash.cache.codec_choice import (
        CPU_RUNNER_REASON,
        choose_codec,
        describe_choice,
        uncalibrated_choice,
    )
    from stages.extract.worker import CalibrationSpec, calibrate_worker_codecs

    if config.codec_calibration == "never":
        choice = uncalibrated_choice("codec_calibration=never: the default codec, not measured")
    else:
        spec = CalibrationSpec(corpus_path=str(config.corpus), rows=tuple(rows), truncate_to=plan.report.truncate_to,
                               storage_dtype=plan.metadata.storage_dtype, chunk_tokens=plan.metadata.chunk_tokens,
                               on_cpu=config.codec_calibration == "always")  # fmt: skip
        # One task pinned to each worker that runs shard tasks (those holding the resources they ask for).
        workers = [address for address, info in sorted(cluster_workers(client).items())
                   if all(info.get("resources", {}).get(name, 0) >= amount for name, amount in (resources or {}).items())]  # fmt: skip
        # A worker that dies meanwhile hands its task to another (measured twice there, counted once), as Dask
        # does for any task, instead of leaving it waiting for a worker that is gone.
        futures = [client.submit(calibrate_worker_codecs, spec, key=f"dflash-codec-calibration-{index}", pure=False,
                                 workers=[address], allow_other_workers=True, resources=resources)
                   for index, address in enumerate(workers)]  # fmt: skip
        try:
            results = [task_result(future) for future in futures]
        except Exception as error:  # measuring is an optimisation: the shard tasks report real failures themselves
            log.warning("codec auto: the calibration failed (%s: %s); using the default codec", type(error).__name__,
                        error)
            choice = uncalibrated_choice(f"calibration failed ({type(error).__name__}): the default codec, unmeasured")
        else:
            measured = {result["worker"]: result for result in results if result["calibrated"]}
            choice = choose_codec(measured) if measured else uncalibrated_choice(CPU_RUNNER_REASON)
    console.print(describe_choice(choice), markup=False)
    if not choice.get("keeps_up", True):
        log.warning("codec auto: %s", choice["reason"])
        console.print(f"warning: {choice['reason']}", style="yellow", markup=False)
    return choice


def _disk_full(failure: str) -> bool:
    """Whether a shard's failure text (errors cross process boundaries as text) is a full disk or quota."""
    return any(f"[Errno {code}]" in failure for code in (errno.ENOSPC, errno.EDQUOT)) or "No space left" in failure


def _report_write_errors(writes: list[dict], failures: dict[int, str]) -> None:
    for write in writes:
        if "error" in write:
            # A full disk fails every later write the same way: said once (the final error gives the counts).
            repeated = _disk_full(write["error"]) and any(_disk_full(failure) for failure in failures.values())
            failures[int(write["shard"])] = write["error"]
            if not repeated:
                log.error("writing shard %s failed: %s", write["shard"], write["error"])


def _print_summary(console: Console, config: ExtractConfig, summary: dict[str, Any], quarantined: list[dict]) -> None:
    table = Table(title=f"extract -> {config.output}", show_header=False)
    raw, stored = summary.get("raw_bytes", 0), summary.get("stored_bytes", 0)
    rows = [
        ("committed shards", f"{summary.get('committed_shards', 0)}/{summary['planned_shards']}"),
        ("samples", f"{summary.get('num_samples', 0):,}"),
        ("tokens", f"{summary.get('num_tokens', 0):,}"),
        ("tokens this run", f"{summary['tokens_computed']:,} in {summary['seconds']:.1f} s = {summary['tokens_per_second']:,.0f} tok/s"),
        ("quarantined (non-finite)", str(summary.get("num_quarantined", 0))),
        ("skipped (length policy)", str(summary.get("num_skipped", 0))),
        ("stored", f"{_human(stored)} ({stored / max(1, summary.get('num_tokens', 0)):,.0f} B/token, ratio {raw / max(1, stored):.3f})"),
        ("codec", summary.get("codec", "") + (" (auto)" if summary.get("codec_choice") else "")),
    ]
    if summary.get("batching"):
        rows.append(("batches", summary["batching"]))
    busy = summary.get("compute_seconds", 0.0) + summary.get("write_wait_seconds", 0.0)
    if busy > 0:
        share = summary.get("write_wait_seconds", 0.0) / busy
        rows.append(("workers blocked on writes", f"{summary.get('write_wait_seconds', 0.0):.1f} s = {share:.0%} of task time"
                     + (" (the write path is the bottleneck: more --write-threads, a lighter --codec, or fp8)" if share > 0.1 else "")))
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    for entry in quarantined[:20]:
        console.print(f"[yellow]quarantined: sample {entry['sample_id']} (corpus row {entry['corpus_row']}), non-finite at tapped layers {entry['layers']}")


def register(app: typer.Typer) -> None:
    """Add the ``extract`` command to the CLI."""

    @app.command("extract")
    @config_options(ExtractConfig, "extract")
    def extract_command(settings: CommandSettings) -> None:
        """Extract tapped target hidden states of a corpus into a compressed Zarr v3 cache (Dask workers).

        Rerun the same command to resume: committed shards are skipped, the rest redone (exactly once).
        Exit status: 0 done, 2 bad input (also one a worker meets, such as a full disk or a corpus it may not read:
        committed shards stay), shards left uncommitted (the message says which and why) or the cache locked by
        another run (named), 130 interrupted (committed shards stay; rerun to resume).
        """
        console = Console()
        try:
            config = resolve_stage_config(ExtractConfig, "extract", given=settings.given,
                                          config_file=settings.config_file, preset=settings.preset,
                                          overrides=settings.sets, required=("corpus", "output"),
                                          option_names=settings.spellings)  # fmt: skip
            if settings.print_config:
                print_and_exit("extract", config)
            run_extract(config, console)
        except DFlashError as error:
            print_error(error)
            raise typer.Exit(ExitCode.USAGE) from None
