"""The batches a training run consumes: :class:`TrainingData` (the sources the loop reads, built outside it), the
offline sources over a hidden-state cache (:func:`open_cache_data`) and the schedule length they give
(:func:`planned_total_steps`)."""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from dflash.batches.source import BatchSource, StreamConfig
from dflash.batches.stream import StreamingLoader
from dflash.cache import CacheReader
from dflash.cache.integrity import check_cache
from dflash.errors import ConfigError

if TYPE_CHECKING:
    from stages.train.config import TrainConfig

__all__ = ["TrainingData", "open_cache_data", "stream_config", "loader_placement", "schedule_steps",
           "planned_total_steps", "check_training_samples"]

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class TrainingData:
    """What the training loop consumes, built outside it and handed to :class:`Trainer`."""

    metadata: Any
    """``dflash.cache.CacheMetadata`` of the hidden states: the cache's, or (online) the one the producers compute
    to (target identity, taps, hidden size, corpus fingerprint); checked against the drafter before step 1."""
    train: BatchSource
    """This rank's training batches (shuffled, plan order); its state is the checkpoint's data cursor."""
    validation: BatchSource | None = None
    """This rank's held-out batches (fixed order), or ``None`` (no validation, no best checkpoint)."""
    integrity: dict[str, Any] = field(default_factory=dict)
    """The cache check's record (``dflash.cache.integrity.check_cache``); ``{}`` when there is no cache."""
    kind: str = "cache"
    """Where the hidden states come from: ``"cache"`` (offline) or ``"online"`` (target replicas), for run.json."""
    provenance: dict[str, Any] = field(default_factory=dict)
    """What built the sources (e.g. the online producers' config), saved in run.json under ``data_source``."""
    on_close: list[Any] = field(default_factory=list)
    """Callables run after the sources are closed (e.g. the online mode's Dask client)."""

    def close(self) -> None:
        """Close both sources (threads, processes, shared memory), then run ``on_close``; idempotent."""
        try:
            self.train.close()
        finally:
            try:
                if self.validation is not None:
                    self.validation.close()
            finally:
                while self.on_close:
                    self.on_close.pop()()


def loader_placement(rank: int, world_size: int, device: torch.device) -> dict[str, Any]:
    """Rank, world size and device of a rank's loaders. On CUDA the loader gets ``device=``: it packs into
    pinned memory and copies the next batch to the GPU on its side stream while the current one trains
    (what ``benchmarks/train_stream.py`` measures), instead of a copy on the default stream in the step. On
    CPU batches stay where they are read (``device=None``)."""
    return {"rank": rank, "world_size": world_size, "device": device if device.type == "cuda" else None}


def stream_config(config: TrainConfig, split: str, device: torch.device) -> StreamConfig:
    """The :class:`StreamConfig` of ``split`` (``"train"``: shuffled; ``"validation"``: fixed order) for a run."""
    return StreamConfig(
        **asdict(config.data),  # the run's LoaderConfig: budget, buckets, split fraction, read-ahead
        seed=config.seed,
        shuffle=split == "train",
        split=split,  # type: ignore[arg-type]
        min_supervised_tokens=config.resolved_min_supervised_tokens(),
        pad_to_budget=config.compile,  # fixed shapes: one compiled graph for every step
        pin_memory=device.type == "cuda",
    )


def open_cache_data(config: TrainConfig, *, rank: int = 0, world_size: int = 1,
                    device: torch.device) -> TrainingData:  # fmt: skip
    """The offline batch sources: ``config.cache`` checked (every commit record against its chunks, completeness;
    before anything is written) and streamed by :class:`dflash.batches.stream.StreamingLoader`.

    Raises:
        CacheError: the cache is missing, incomplete (without ``allow_incomplete``) or corrupt.
        ConfigError: the training split is empty or a sample is longer than the token budget; ``drafter.distill``
            on a cache without the final tap.
    """
    # A distillation term reads the cache's final tap (refused here, before anything loads, when it has none).
    reader = CacheReader(config.cache, final_tap=config.drafter.distill != "none")
    integrity = check_cache(reader, allow_incomplete=config.allow_incomplete)
    if rank == 0 and integrity["uncommitted_shards"]:
        log.warning(
            "--allow-incomplete: training on %d samples of %d planned corpus rows (%d of %d shards committed; "
            "not committed: %s); finish the cache with `dflash-stages extract` to train on all of them",
            integrity["num_samples"], integrity["planned_rows"], integrity["committed_shards"],
            integrity["planned_shards"], integrity["uncommitted_shards"][:10],
        )
    placement = loader_placement(rank, world_size, device)
    train = StreamingLoader(reader, stream_config(config, "train", device), **placement)
    validation = None
    if config.data.validation_fraction > 0:
        try:
            validation = StreamingLoader(reader, stream_config(config, "validation", device), **placement)
        except ConfigError as error:  # e.g. a tiny cache where 1% of the rows is no row at all
            log.warning("validation disabled (no best checkpoint, no validation loss): %s", error)
    return TrainingData(metadata=reader.metadata, train=train, validation=validation, integrity=integrity)


def schedule_steps(config: TrainConfig, micro_batches_per_epoch: int) -> int:
    """Optimizer steps of a run of ``config`` whose ranks each get ``micro_batches_per_epoch`` batches per epoch:
    ``max_steps`` when set, else ``ceil(epochs x micro_batches_per_epoch / grad_accum_steps)``, at least 1."""
    return config.max_steps or max(1, math.ceil(config.epochs * micro_batches_per_epoch / config.grad_accum_steps))


def planned_total_steps(config: TrainConfig, *, world_size: int | None = None) -> int:
    """The schedule length (optimizer steps) that a new run of ``config`` on its cache gets, from epoch 0's batch
    plan alone (sample lengths; no model, no device, nothing written): what :class:`Trainer` computes at its start
    and saves as ``total_steps`` in every checkpoint, known before step 1 (the pipeline places its per-epoch
    evaluations with it). ``world_size``: the ranks the run trains on (default: ``config.world_size``, i.e.
    ``drafter_gpus`` or ``drafter_processes``); each rank's epoch is its share of the batches.

    Raises:
        CacheError: the cache is missing or unreadable.
        ConfigError: the training split is empty or a sample is longer than the token budget.
    """
    if config.max_steps:
        return int(config.max_steps)

    loader = StreamingLoader(CacheReader(config.cache), stream_config(config, "train", torch.device("cpu")),
                             **loader_placement(0, world_size or config.world_size, torch.device("cpu")))
    try:
        return schedule_steps(config, len(loader))
    finally:
        loader.close()


def check_training_samples(config: TrainConfig) -> dict[str, int]:
    """Count the cache's samples as the run will split them (lengths only: no hidden state, no model) and refuse a
    run left with fewer than ``config.min_train_samples`` training samples. Returns the counts: ``samples``,
    ``excluded`` (fewer than min_supervised_tokens supervised tokens), ``validation`` and ``train``.

    Raises:
        CacheError: the cache is missing or unreadable.
        ConfigError: too few training samples; the message names every count and the settings that change them.
    """
    reader = CacheReader(config.cache)
    cpu = torch.device("cpu")

    def count(stream: StreamConfig) -> tuple[int, int]:
        try:
            loader = StreamingLoader(reader, stream)
        except ConfigError:  # an empty split: counted as 0 here, named in the message below
            return 0, 0
        try:
            return loader.num_samples, loader.num_excluded_short
        finally:
            loader.close()

    everything = replace(stream_config(config, "train", cpu), split="all")
    samples, excluded = count(replace(everything, min_supervised_tokens=0))[0], count(everything)[1]
    train = count(stream_config(config, "train", cpu))[0]
    counts = {"samples": samples, "excluded": excluded, "validation": samples - excluded - train, "train": train}
    if train >= config.min_train_samples:
        return counts
    minimum = config.resolved_min_supervised_tokens()
    validation = (f"{counts['validation']} held out for validation (--validation-fraction "
                  f"{config.data.validation_fraction:g})" if config.data.validation_fraction > 0 else
                  "none held out for validation")
    fewer_held = "set --validation-fraction 0, " if counts["validation"] else ""
    raise ConfigError(
        f"cache {config.cache} has {samples} samples: {excluded} excluded for fewer than {minimum} supervised tokens "
        f"(--min-supervised-tokens), {validation}, {train} left for training; training needs at least "
        f"{config.min_train_samples} (--min-train-samples): add data (more conversations or files to prepare and "
        f"extract), lower --min-supervised-tokens, {fewer_held}or lower --min-train-samples"
    )
