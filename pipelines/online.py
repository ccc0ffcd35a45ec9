"""The online pipeline: target replicas feed drafter training through the shared-memory queue (no disk cache).

Run::

    dflash-stages online --corpus CORPUS --output RUN --target-processes 1   # CPU: 1 producer process + trainer
    dflash-stages online --preset online-1gpu --corpus CORPUS --output RUN   # one GPU for producer and drafter
    dflash-stages online --corpus CORPUS --output RUN --target-gpus 0,1,2,3,4 --drafter-gpus 5,6,7   # DDP
    dflash-stages online --corpus CORPUS --output RUN --target-processes 1 --cache-to CACHE   # also write the cache
    dflash-stages online --output RUN --resume                                # continue a stopped or killed run

Layout: Dask schedules the producers exactly as ``extract`` does (a LocalCluster, one worker per target GPU or
``--target-processes`` CPU processes; :class:`stages.replicas.online_worker.OnlineProducerPlugin`, a ``TargetReplicaPlugin``, loads
the target once per worker and runs the extract stage's ``TargetRunner``). The trainer is the ``train`` stage's
launcher and :class:`stages.train.loop.Trainer` (same loop, DDP, checkpoints, telemetry, validation): this process for
one rank, one spawned process per rank otherwise; each rank builds its batch sources with :class:`OnlineData`
(:class:`dflash.batches.online.OnlineBatches`, its own rings, connected to the producers' scheduler) instead of the cache's
loaders. Batches move through the ring of :mod:`dflash.batches.ring` (contract: docs/online-queue.md).

Mixing and order are the offline ones (the plan comes from the corpus lengths, :class:`dflash.corpus.format.CorpusLengths`):
the same corpus, config and seed give the same samples in the same batches as ``extract`` then ``train``.

Resume: ``--resume`` reads RUN/run.json (training config, and the producers' config under
``resolved.data_source``) and continues from the latest checkpoint's data cursor; producers recompute the batches
of the plan from there. N steps + resume + N steps equals 2N steps straight, bit for bit on CPU.

``--cache-to``: producers stage the first epoch's batches and a launcher thread commits each shard of extract's plan
once its rows are staged (:mod:`dflash.cache.staging`). Layout presets: :data:`ONLINE_PRESETS`.

Limits (docs/online-queue.md): multi-GPU layouts are wired and CPU-tested, not yet run on a multi-GPU host; a sample
with non-finite hidden states stops the run (offline extract quarantines it).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import typer

from dflash.batches.source import PlannedCursor
from dflash.errors import ConfigError, ProducerError
from dflash.io.locks import output_lock
from dflash.target.load import resolve_target_path, target_identity
from dflash.target.taps import LAYER_ID_CONVENTION, tapped_layer_ids
from stages.config.check import check_fields, read_config_file
from stages.config.options import CommandSettings, config_options, setting
from stages.config.presets import read_preset_json
from stages.config.resolve import resolve_stage_config
from stages.replicas.cluster import close_cluster, worker_process_options
from stages.replicas.tasks import task_result
from stages.train.command import config_from_cli as train_config_from_cli
from stages.train.command import exit_if_interrupted
from stages.train.config import TrainConfig
from stages.train.launch import _run_training

__all__ = ["OnlineConfig", "ONLINE_CACHE_PREFIX", "ONLINE_PRESETS", "OnlineData", "online_metadata", "online_sections",
           "online_training_data", "load_online_preset", "planned_online_steps", "printable_config", "producer_plugin",
           "run_online", "register"]

log = logging.getLogger(__name__)

#: ``TrainConfig.cache`` of an online run: ``online:<corpus>`` (there is no cache; the marker says so in run.json).
ONLINE_CACHE_PREFIX = "online:"

#: ``OnlineConfig.on_producer_death`` values: rerun the lost batch elsewhere, or stop the run.
PRODUCER_DEATH_POLICIES = ("recompute", "stop")

#: Tasks a batch may lose to dying producers before the run stops (Dask's ``allowed-failures``), per policy.
_ALLOWED_FAILURES = {"recompute": 5, "stop": 0}

#: Why ``--cache-to``'s ``codec "auto"`` resolves to the default without measuring (recorded in the cache).
CACHE_TO_CODEC_REASON = ("online --cache-to: the launcher encodes each shard from the staged batches in the "
                         "background; no producer or training step waits on it")


@dataclass(kw_only=True, slots=True)
class OnlineConfig:
    """The producer side of an online run; the trainer side is ``train`` (a :class:`stages.train.config.TrainConfig`)."""

    corpus: str = setting(help="Corpus folder (contract 1) the plan is made from and the producers read (in run's online section: set by the pipeline, WORKDIR/corpus).")
    #: The training loop's config (``cache`` is ``online:<corpus>``; ``output`` is the run folder; in ``run``: its
    #: ``train`` section).
    train: TrainConfig
    target: str = setting("default", help="Target spec: 'default' (SmolLM2-135M-Instruct), a transformers folder or a .gguf file (in run: the pipeline's target).")
    target_layer_ids: list[int] | None = setting(None, help="Tapped layer ids, e.g. 1,3 (default: DFlash's rule, one tap per draft layer).")
    target_processes: int | None = setting(None, help="CPU producer processes (target replicas), one Dask worker each (default: one per --target-gpus entry, else 1).")
    target_gpus: list[int] | None = setting(None, help="Producer GPU ids, one Dask worker each, e.g. 0,1.")
    ring_slots: int = setting(8, help="Shared-memory ring slots per rank: batches in flight between producers and trainer (memory: slots x token_budget x taps x hidden size x 2 bytes). A producer task takes at most half of them (producer_group_tokens).")
    #: Padded tokens per target forward of a producer (with ``producer_packing``: real tokens per forward); ``None``:
    #: twice the training ``data.token_budget`` (packed: the token budget), so that a planned batch runs as one
    #: forward (``producer_forward_tokens``).
    runner_token_budget: int | None = None
    producer_packing: bool = setting(False, help="Producers run packed forwards (extract's --packing with its automatic kernel: varlen on GPU producers whose torch has it, else flex_attention; sdpa on CPU producers): a planned batch's samples back to back, attention confined to each, no padding; runner_token_budget then counts real tokens per forward. The same batches and hidden states (within the runner's bf16 tolerance); off by default: slower on a GPU (docs/online-queue.md, Throughput).")
    producer_group_tokens: int = setting(65536, help="A producer task runs consecutive planned batches of an epoch through the target together, up to this many real tokens and at most half the ring slots, so that their rows share forwards (a forward costs about the same whatever its rows) as extract's rows of one shard do; each batch still goes to its own slot, so the batches, their order and the exact resume do not change (hidden states within the runner's bf16 tolerance of a task per batch). Default: extract's default shard size, about as many forwards per token as extract (docs/online-queue.md, Producer tasks over groups of planned batches). 0: one planned batch per task.")
    cache_to: str | None = setting(None, help="Also write the corpus's hidden-state cache (extract's shard plan) here while training: producers stage the first epoch's batches and a shard is committed once its rows are all staged, so a later train or sweep reuses it (docs/online-queue.md). Refused in run's online section, which trains without a cache.")
    cache_shard_size: int = setting(65536, help="--cache-to: tokens per cache shard (extract's --shard-size).")
    on_producer_death: str = setting("recompute", help="A producer process that dies (OOM killer, a GPU fault): recompute (Dask reruns its batch on another producer; a batch lost with 5 producers in turn stops the run, as Dask blames every task a dying producer held) | stop (the run stops at once with one error line). Its latest checkpoint is kept and --resume continues from it.")

    def __post_init__(self) -> None:
        if not self.corpus:
            raise ConfigError("corpus: give the corpus folder (--corpus)")
        if self.target_processes is not None and self.target_gpus is not None:
            raise ConfigError(f"target_processes: give --target-processes (CPU) or --target-gpus, not both; got {self.target_processes} and "
                              f"{self.target_gpus}")
        if self.target_processes is not None and (not isinstance(self.target_processes, int) or self.target_processes < 1):
            raise ConfigError(f"target_processes: expected >= 1, got {self.target_processes!r}")
        if self.target_gpus is not None and (not self.target_gpus or len(set(self.target_gpus)) != len(self.target_gpus)):
            raise ConfigError(f"target_gpus: expected distinct GPU ids, got {self.target_gpus}")
        if not isinstance(self.ring_slots, int) or self.ring_slots < 2:
            raise ConfigError(f"ring_slots: expected an integer >= 2, got {self.ring_slots!r}")
        if self.runner_token_budget is not None and self.runner_token_budget < 1:
            raise ConfigError(f"runner_token_budget: expected >= 1, got {self.runner_token_budget}")
        if not isinstance(self.producer_group_tokens, int) or isinstance(self.producer_group_tokens, bool) \
                or self.producer_group_tokens < 0:
            raise ConfigError(f"producer_group_tokens: expected an integer >= 0 (0: one planned batch per producer "
                              f"task), got {self.producer_group_tokens!r}")
        if self.cache_to is not None and self.train.output:
            run, cache = Path(self.train.output).resolve(), Path(self.cache_to).resolve()
            if run == cache or run in cache.parents or cache in run.parents:
                raise ConfigError(f"cache_to: {self.cache_to} and the run folder {self.train.output} overlap; give "
                                  "--cache-to a folder of its own (beside the run, not in it)")
        if not isinstance(self.cache_shard_size, int) or self.cache_shard_size < 1:
            raise ConfigError(f"cache_shard_size: expected an integer >= 1, got {self.cache_shard_size!r}")
        if self.on_producer_death not in PRODUCER_DEATH_POLICIES:
            raise ConfigError(f"on_producer_death: expected one of {', '.join(PRODUCER_DEATH_POLICIES)}, got "
                              f"{self.on_producer_death!r}")
        if self.train.data.shard_window is not None:
            raise ConfigError("data.shard_window: the online mode plans globally (no cache shards); leave it unset")
        if self.train.drafter.distill != "none":
            raise ConfigError(
                f"drafter.distill: the online mode trains on the CE alone (its producers send no final tap), got "
                f"{self.train.drafter.distill!r}; set train.drafter.distill = none here, or run extract --final-tap "
                "then train"
            )

    @property
    def producer_forward_tokens(self) -> int:
        """Padded tokens per target forward of a producer (packed: real tokens per forward): ``runner_token_budget``,
        by default twice the training token budget (packed: the token budget).

        A producer task runs the documents of one planned batch (at most ``token_budget`` real tokens, of one length
        bucket), or of a group of them (``producer_group_tokens``), through extract's runner, whose padded forwards
        hold at most this many ``rows x longest`` tokens: at twice the token budget a planned batch alone is one
        forward unless its rows x longest exceed that, at the token budget it is nearly always two, the second
        small; a group's documents, sorted by length together, fill fuller forwards. Each forward has a cost that does not shrink with its size (the same
        ~1,500 operations to launch whatever the rows; docs/online-queue.md, "The producer's forward against
        extract's"), so fewer forwards per planned batch. Packed rows hold real tokens only: a planned batch fits
        one at the token budget."""
        if self.runner_token_budget is not None:
            return self.runner_token_budget
        token_budget = self.train.data.token_budget
        return token_budget if self.producer_packing else 2 * token_budget

    def producer_dict(self) -> dict[str, Any]:
        """The producer fields (saved in run.json under ``resolved.data_source``, read back by ``--resume``)."""
        data = asdict(self)
        data.pop("train")
        return data


def online_metadata(config: OnlineConfig) -> tuple[Any, Any]:
    """``(corpus, metadata)``: the opened corpus (validated against the target's vocabulary) and the
    ``dflash.cache.CacheMetadata`` describing the hidden states the producers compute (what a cache of this corpus
    would record), so the trainer checks the drafter against it before step 1 exactly as offline."""
    from dflash.cache import CacheMetadata
    from dflash.corpus.format import open_corpus, validate_corpus

    corpus = open_corpus(config.corpus)
    identity = target_identity(resolve_target_path(config.target))
    validate_corpus(corpus, vocab_size=identity.vocab_size)
    layer_ids = tapped_layer_ids(identity.num_hidden_layers, config.train.drafter.num_draft_layers,
                                 config.target_layer_ids)
    metadata = CacheMetadata(
        target=identity.to_dict(), target_spec=str(config.target), target_layer_ids=layer_ids,
        layer_id_convention=LAYER_ID_CONVENTION, hidden_size=identity.hidden_size, num_taps=len(layer_ids),
        corpus_fingerprint=corpus.fingerprint, corpus_path=str(config.corpus), num_shards=1,
        shard_rows=[[0, len(corpus)]], extra={"online": config.producer_dict()},
    )  # fmt: skip
    return corpus, metadata


def online_training_data(config: OnlineConfig, *, submit: Any, device: Any, corpus: Any = None,
                         metadata: Any = None, rank: int = 0, world_size: int = 1,
                         health_check: Any = None) -> Any:  # fmt: skip
    """The trainer's :class:`stages.train.data.TrainingData` of an online run: this rank's training (and validation)
    batches from :class:`dflash.batches.online.OnlineBatches` over ``config.corpus``, computed by
    ``submit(BatchTask) -> future``. Each rank has its own rings; ranks take disjoint batches of the plan."""
    import torch

    from dflash.batches.online import OnlineBatches
    from dflash.corpus.format import CorpusLengths
    from stages.train.data import TrainingData, stream_config

    if metadata is None:
        corpus, metadata = online_metadata(config)
    lengths = CorpusLengths(corpus)
    width = metadata.num_taps * metadata.hidden_size
    common = {"submit": submit, "width": width, "dtype": torch.bfloat16, "num_slots": config.ring_slots,
              "rank": rank, "world_size": world_size, "staging": staging_dir(config),
              "health_check": health_check, "group_tokens": config.producer_group_tokens or None}  # fmt: skip
    train = OnlineBatches(lengths, stream_config(config.train, "train", device), **common)
    validation = None
    if config.train.data.validation_fraction > 0:
        try:
            validation = OnlineBatches(lengths, stream_config(config.train, "validation", device), **common)
        except ConfigError as error:  # e.g. a tiny corpus where 1% of the rows is no row at all
            log.warning("validation disabled (no best checkpoint, no validation loss): %s", error)
    return TrainingData(metadata=metadata, train=train, validation=validation, kind="online",
                        provenance={"online": config.producer_dict()})  # fmt: skip


def planned_online_steps(config: OnlineConfig, *, world_size: int | None = None) -> int:
    """The schedule length (optimizer steps) a new online run of ``config`` gets, from epoch 0's batch plan over
    the corpus lengths alone (:class:`dflash.corpus.format.CorpusLengths`; no target, no producer, nothing
    written): what the trainer computes from :class:`dflash.batches.online.OnlineBatches` at its start, and what
    ``stages.train.data.planned_total_steps`` gives for a cache of the same corpus. ``world_size``: the ranks the
    run trains on (default: ``config.train.world_size``).

    Raises:
        CorpusError: the corpus is missing or unreadable.
        ConfigError: the training split is empty or a sample is longer than the token budget.
    """
    import torch

    from dflash.corpus.format import CorpusLengths, open_corpus
    from stages.train.data import schedule_steps, stream_config

    train = config.train
    if train.max_steps:
        return int(train.max_steps)
    cursor = PlannedCursor(CorpusLengths(open_corpus(config.corpus)), stream_config(train, "train", torch.device("cpu")),
                           rank=0, world_size=world_size or train.world_size)
    return schedule_steps(train, len(cursor))


def staging_dir(config: OnlineConfig) -> str | None:
    """``--cache-to``'s staging folder (``CACHE/staging``), or ``None``."""
    from dflash.cache.staging import STAGING_DIR

    return str(Path(config.cache_to) / STAGING_DIR) if config.cache_to else None


def _open_cache_to(config: OnlineConfig, metadata: Any) -> Any:
    """``--cache-to``: the cache (created, or reopened with its committed shards: it must be of the same corpus,
    target and taps) and a :class:`dflash.cache.staging.ShardAssembler` over it."""
    import torch
    from rich.console import Console

    from dflash.cache.staging import ShardAssembler
    from dflash.corpus.format import CorpusLengths
    from stages.extract.command import ExtractConfig, prepare_cache
    from stages.train.data import stream_config

    train = config.train
    extract = ExtractConfig(corpus=config.corpus, output=str(config.cache_to), target=config.target,
                            target_layer_ids=list(metadata.target_layer_ids), shard_size=config.cache_shard_size,
                            forward_tokens=config.producer_forward_tokens,
                            extra={"written_by": "online --cache-to"})  # fmt: skip
    console = Console(file=io.StringIO())  # prepare_cache's size report: logged below instead
    # The codec: an existing cache keeps its own; a new one gets the default, unmeasured. Nothing waits on these
    # writes: producers stage raw batches, and a thread of this launcher encodes each shard once its rows are all
    # staged, so a slow codec delays only the shard's commit, never a producer or a training step.
    cache, corpus, shard_rows, _ = prepare_cache(extract, console, auto_reason=CACHE_TO_CODEC_REASON)
    log.info("cache-to: %s", console.file.getvalue().strip().replace("\n", "; "))
    lengths = CorpusLengths(corpus)
    planned: set[int] = set()
    for split in ("train", "validation"):
        if split == "validation" and train.data.validation_fraction <= 0:
            continue
        try:
            cursor = PlannedCursor(lengths, stream_config(train, split, torch.device("cpu")))
            planned.update(int(r) for r in cursor.sample_row)
        except ConfigError:  # no validation split on a tiny corpus (the trainer says so)
            pass
    excluded = sorted(set(range(len(corpus))) - planned)
    return ShardAssembler(cache, corpus, excluded, reason=(
        f"online --cache-to: fewer than min_supervised_tokens={train.resolved_min_supervised_tokens()} supervised tokens (the "
        "run never computes it)"))


def _assemble_while_training(assembler: Any, stop: Any, every: float = 2.0) -> None:
    """The assembler's loop (a thread of the launcher): commit each shard as soon as its rows are staged."""
    while not stop.wait(every):
        try:
            assembler.poll()
        except Exception:  # reported by the final poll, which runs in the launcher itself
            log.exception("cache-to: writing a shard failed; retried at the end of the run")


class _ProducerFuture:
    """A Dask future whose ``result()`` turns a batch lost with its producers into one clear error, and raises the
    error the user must fix that its task returned (``stages.replicas.tasks``)."""

    def __init__(self, future: Any, task: Any, policy: str) -> None:
        self._future, self._task, self._policy = future, task, policy

    def result(self, timeout: float | None = None) -> Any:
        from distributed import KilledWorker

        try:
            return task_result(self._future, timeout=timeout)
        except KilledWorker as error:
            how = ("on_producer_death=stop" if self._policy == "stop"
                   else f"its task was rerun on {_ALLOWED_FAILURES['recompute']} producers in turn and each died")
            raise ProducerError(
                f"producer lost: the process computing {self._task.name} died ({how}; {error}); the run stopped without training on it and keeps its latest checkpoint: "
                "see the producer's log for the cause (out of memory?), then rerun with --resume"
            ) from None

    def done(self) -> bool:
        return self._future.done()

    def cancel(self) -> Any:
        return self._future.cancel()

    def add_done_callback(self, callback: Any) -> None:
        self._future.add_done_callback(lambda _: callback(self))


def dask_health(client: Any, grace: float = 180.0) -> Any:
    """``health_check() -> message | None`` for :class:`dflash.batches.online.OnlineBatches`: a message once no producer
    (Dask worker) has been alive for ``grace`` seconds (a nanny restarting a killed producer reloads the target
    within it; one that gave up never comes back)."""
    state = {"seen": time.monotonic()}

    def health_check() -> str | None:
        if client.scheduler_info().get("workers"):
            state["seen"] = time.monotonic()
            return None
        gone = time.monotonic() - state["seen"]
        if gone < grace:
            return None
        return (f"no producer is alive: every target replica's process died and none came back within {grace:.0f} s "
                "(see the worker log lines above: out of memory? the target failing to load?); the run stopped and "
                "keeps its latest checkpoint: fix the cause, then rerun with --resume")

    return health_check


def dask_submit(client: Any, policy: str = "recompute") -> Any:
    """``submit(BatchTask) -> future`` running :func:`stages.replicas.online_worker.produce_batch` on ``client``'s workers."""
    from stages.replicas.online_worker import produce_batch

    def submit(task: Any) -> Any:
        # Unique per ring and hand-out (a group's: its first batch's): Dask returns the existing future for a key it
        # already holds.
        key = f"dflash-online-{task.ring_name}-e{task.epoch}-b{task.batch_index}-t{task.ticket}"
        return _ProducerFuture(client.submit(produce_batch, task, pure=False, key=key), task, policy)

    return submit


@dataclass(frozen=True, slots=True)
class OnlineData:
    """One rank's online batch sources, built in the rank's process (picklable: it travels to spawned DDP ranks).

    ``producer``: :meth:`OnlineConfig.producer_dict`; ``metadata``: the producers' ``CacheMetadata.to_dict()``
    (computed once by the launcher: the target's content hash is not recomputed per rank); ``scheduler_address``:
    the producers' Dask scheduler, which every rank submits its own batches to.
    """

    producer: dict[str, Any]
    metadata: dict[str, Any]
    scheduler_address: str

    def __call__(self, config: TrainConfig, *, rank: int, world_size: int, device: Any) -> Any:
        from distributed import Client

        from dflash.cache import CacheMetadata
        from dflash.corpus.format import open_corpus

        online = OnlineConfig(train=config, **self.producer)
        client = Client(self.scheduler_address, set_as_default=False)
        try:
            data = online_training_data(
                online, submit=dask_submit(client, online.on_producer_death), device=device,
                corpus=open_corpus(online.corpus), metadata=CacheMetadata.from_dict(self.metadata), rank=rank,
                world_size=world_size, health_check=dask_health(client),
            )  # fmt: skip
        except BaseException:
            client.close()
            raise
        data.on_close.append(client.close)
        return data


def _start_cluster(config: OnlineConfig, metadata: Any) -> tuple[Any, Any]:
    """A LocalCluster of producers (as ``extract`` starts one) with the producer plugin registered on every worker."""
    import dask
    import torch
    from distributed import Client, LocalCluster

    if not log.isEnabledFor(logging.DEBUG):
        logging.getLogger("distributed").setLevel(logging.WARNING)
    gpus = config.target_gpus
    num_workers = len(gpus) if gpus else (config.target_processes or 1)
    # The scheduler (in this process) reads allowed-failures when it is made: a task whose producers died that
    # often fails with KilledWorker, which _ProducerFuture reports.
    with dask.config.set({"distributed.scheduler.allowed-failures": _ALLOWED_FAILURES[config.on_producer_death]}):
        cluster = LocalCluster(host="127.0.0.1", n_workers=num_workers, threads_per_worker=1, processes=True,
                               resources={"GPU": 1} if gpus else None, memory_limit=0,
                               dashboard_address="127.0.0.1:0", **worker_process_options())  # fmt: skip
    client = Client(cluster)
    plugin = producer_plugin(config, metadata)
    del torch
    client.register_plugin(plugin)  # loads the target on every worker; re-raises a worker's loading error here
    return client, cluster


def producer_plugin(config: OnlineConfig, metadata: Any) -> Any:
    """The :class:`stages.replicas.online_worker.OnlineProducerPlugin` every producer (Dask worker) of ``config``
    loads: its target, taps, forward budget and packing, GPU or CPU placement and torch threads."""
    from stages.replicas.online_worker import OnlineProducerPlugin

    gpus = config.target_gpus
    num_workers = len(gpus) if gpus else (config.target_processes or 1)
    threads = None if gpus else max(1, (os.cpu_count() or 1) // (num_workers + 1))
    return OnlineProducerPlugin(
        target_spec=config.target, target_layer_ids=list(metadata.target_layer_ids),
        token_budget=config.producer_forward_tokens, corpus_path=config.corpus,
        gpu_by_worker=dict(enumerate(gpus)) if gpus else None, device="cuda" if gpus else "cpu",
        torch_threads=threads, die_with_parent=True, packing=config.producer_packing,
    )  # fmt: skip


def _check_before_start(config: OnlineConfig) -> None:
    """What the trainer would refuse only after the producers loaded the target (seconds to minutes in), checked
    before anything starts or is created: GPUs asked for on a host without CUDA, a run folder that is no run."""
    import torch

    train = config.train
    wants_cuda = bool(config.target_gpus) or bool(train.drafter_gpus) or train.device == "cuda"
    if wants_cuda and not torch.cuda.is_available():
        given = "--target-gpus" if config.target_gpus else "--drafter-gpus" if train.drafter_gpus else "--device cuda"
        raise ConfigError(f"{given}: CUDA is not available on this host; use --target-processes N (CPU producers) and "
                          "--device cpu, or the online-cpu preset")
    from stages.train.loop import check_run_folder

    run = Path(train.output)
    if run.exists() and not run.is_dir():
        raise ConfigError(f"output: {run} exists and is not a folder (a run folder is expected)")
    check_run_folder(run, resume=train.resume)


def run_online(config: OnlineConfig) -> dict[str, Any]:
    """Run an online training: producers on a LocalCluster, the training loop in this process. Returns the
    trainer's summary (as ``train``'s).

    Raises:
        ConfigError, CorpusError, TargetError, CheckpointError, MismatchError: before any step (one ``error:`` line
            from the CLI); SharedMemoryFull: ``/dev/shm`` too small for the ring (the message gives the fix).
    """
    train = config.train
    with contextlib.ExitStack() as locks:
        locks.enter_context(output_lock(train.output, what="run", break_lock=train.break_lock))
        if config.cache_to:
            locks.enter_context(output_lock(config.cache_to, what="cache", break_lock=train.break_lock))
        _check_before_start(config)
        _, metadata = online_metadata(config)
        assembler = _open_cache_to(config, metadata) if config.cache_to else None
        client, cluster = _start_cluster(config, metadata)
        stop = threading.Event()
        writer = None
        if assembler is not None:
            writer = threading.Thread(target=_assemble_while_training, args=(assembler, stop),
                                      name="dflash-cache-to", daemon=True)  # fmt: skip
            writer.start()
        try:
            # The ranks (this process, or one spawned process per drafter GPU / CPU process: the train stage's
            # launcher and DDP) each connect to the producers' scheduler and hand out their own batches.
            factory = OnlineData(producer=config.producer_dict(), metadata=metadata.to_dict(),
                                 scheduler_address=cluster.scheduler_address)  # fmt: skip
            summary = _run_training(train, factory)
        finally:
            stop.set()
            if writer is not None:
                writer.join()
            close_cluster(client, cluster)
        if assembler is not None:
            summary["cache_to"] = _finish_cache_to(config, assembler)
        return summary


def _finish_cache_to(config: OnlineConfig, assembler: Any) -> dict[str, Any]:
    """The last assembly pass (after the producers stopped); what is committed and what is missing."""
    pending = assembler.finish()
    record = {"path": str(config.cache_to), "planned_shards": assembler.cache.metadata.num_shards,
              "committed_shards": assembler.cache.metadata.num_shards - len(pending), "pending_shards": pending}
    if not pending:
        assembler.cache.finalize()
        log.info("cache-to: %s complete (%d shards); `dflash-stages train --cache %s` reuses it", config.cache_to,
                 record["planned_shards"], config.cache_to)
    else:
        missing = sum(len(assembler.missing_rows(k)) for k in pending)
        layers = ",".join(str(i) for i in assembler.cache.metadata.target_layer_ids)
        log.warning(
            "cache-to: %d of %d shards committed; %d lack %d rows this run did not compute (it stopped inside its "
            "first epoch, or validation read only max_validation_batches): `dflash-stages extract --corpus %s "
            "--output %s --target %s --target-layer-ids %s --shard-size %d` computes the rest",
            record["committed_shards"], record["planned_shards"], len(pending), missing, config.corpus,
            config.cache_to, config.target, layers, config.cache_shard_size,
        )
    return record


# ====================================================================== CLI


#: The online layouts of ``stages/config/presets/``: ``online --preset NAME`` (or a .json file of the same shape).
ONLINE_PRESETS = ("online-cpu", "online-1gpu", "online-2gpu", "online-8gpu")


def load_online_preset(name_or_path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(online fields, train fields)`` of an online preset: ``{"online": {...}, "train": {...}}`` (keys starting
    with ``_`` are comments), by name (:data:`ONLINE_PRESETS`) or JSON path.

    Raises:
        ConfigError: unknown preset, unreadable JSON, or a section or key that is not an online or train setting
            (the message names it).
    """
    return online_sections(read_preset_json(name_or_path, ONLINE_PRESETS), f"preset {name_or_path}")


def online_sections(data: dict[str, Any], where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(online fields, train fields)`` of a preset or ``--config`` mapping ``{"online": {...}, "train": {...}}``,
    checked: unknown sections or keys (with a did-you-mean) and wrong types name the key and ``where``.

    Raises:
        ConfigError: as above.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected an object with the sections 'online' and 'train', got "
                          f"{type(data).__name__}")
    sections = {k: v for k, v in data.items() if not k.startswith("_")}
    if set(sections) - {"online", "train"} or not all(isinstance(v, dict) for v in sections.values()):
        raise ConfigError(f"{where}: expected the sections 'online' and 'train' (tables of settings), got "
                          f"{sorted(sections)}")
    online = {k: v for k, v in sections.get("online", {}).items() if not k.startswith("_")}
    train = {k: v for k, v in sections.get("train", {}).items() if not k.startswith("_")}
    check_fields(OnlineConfig, online, section="online", source=lambda key: where, reserved={"train"})
    # cache is online:<corpus>; resume is an option (--resume), never a saved setting
    check_fields(TrainConfig, train, section="train", source=lambda key: where, reserved={"cache", "resume"})
    return online, train


def printable_config(config: OnlineConfig) -> dict[str, Any]:
    """The resolved config as ``online --config`` reads it back (``--print-config``)."""
    train = config.train.to_dict()
    for key in ("cache", "resume"):
        train.pop(key, None)
    return {"online": config.producer_dict(), "train": train}


def config_from_cli(online: dict[str, Any], train_overrides: dict[str, Any], preset: str | None = None,
                    config_file: str | Path | None = None, sets: Sequence[str] = (),
                    announce: bool = True, option_names: dict[str, str] | None = None) -> OnlineConfig:  # fmt: skip
    """The run's config, each section resolved by ``stages.config.resolve.resolve_stage_config``: defaults < the
    preset < the ``--config`` file < the options given (``online``, ``train_overrides``: field -> value, a train
    field by its dotted path; None for an option not given) < ``--set online.FIELD=VALUE`` /
    ``train.FIELD=VALUE``; with ``--resume`` all of them over the run's saved config (RUN/run.json), so resume a
    run with the same preset and file, or none. ``option_names``: ``online`` field or ``train.`` path -> its option.

    Raises:
        ConfigError: an unknown key or section, a wrong type or a refused value, named with its source.
    """
    online_sets, train_sets = [], []
    for item in sets:
        section = item.partition("=")[0].strip().partition(".")[0]
        if section not in ("online", "train"):
            raise ConfigError(f"--set {item!r}: expected online.FIELD=VALUE or train.FIELD=VALUE")
        (online_sets if section == "online" else train_sets).append(item)
    if config_file is not None:  # only the sections online and train, and no train.cache or train.resume
        online_sections(read_config_file(config_file), f"--config {config_file}")
    names = dict(option_names or {})
    # The trainer's side first: its output and --resume say which saved run the producer side resumes. Its cache
    # is the corpus's marker, known once the producer side is resolved.
    train = train_config_from_cli(
        {**train_overrides, "cache": ONLINE_CACHE_PREFIX}, config_file, preset=preset, sets=train_sets,
        announce=announce, read_preset=load_online_preset_sections,
        option_names={key[len("train."):]: option for key, option in names.items() if key.startswith("train.")})

    def saved_run(upper: dict[str, Any]) -> tuple[dict[str, Any], str] | None:
        run_json = Path(train.output) / "run.json"
        if not train.resume or not run_json.is_file():
            return None
        from dflash.training.checkpoint import read_run_record  # loads torch: only for a resume

        resolved = read_run_record(run_json.parent).get("resolved", {})
        saved = dict(resolved.get("data_source", {}).get("online", {}))
        if not saved:
            raise ConfigError(f"--resume: {train.output} is not an online run (run.json has no online data source); "
                              "resume it with `dflash-stages train --output ... --resume`")
        saved.pop("train", None)
        unknown = sorted(set(saved) - {f.name for f in fields(OnlineConfig)})
        if unknown:
            raise ConfigError(f"unknown online config fields {unknown} in {run_json}: the run was made by another "
                              "version of dflash-stages; resume it with that version or start a new run")
        return saved, f"the saved run {run_json}"

    def absolute_paths(merged: dict[str, Any]) -> None:
        if not merged.get("corpus"):
            raise ConfigError("corpus: give the corpus folder (--corpus), or --resume with --output of an online run")
        for key in ("corpus", "cache_to"):  # saved in run.json: a resume from another folder must find them
            if merged.get(key) and "://" not in str(merged[key]):
                merged[key] = str(Path(merged[key]).expanduser().resolve())

    def build(merged: dict[str, Any]) -> OnlineConfig:
        return OnlineConfig(train=replace(train, cache=f"{ONLINE_CACHE_PREFIX}{merged['corpus']}"), **merged)

    config, _ = resolve_stage_config(
        OnlineConfig, "online", given={k: v for k, v in online.items() if v is not None}, config_file=config_file,
        preset=preset, overrides=online_sets, option_names=names, build=build, base=saved_run, fill=absolute_paths,
        read_preset=load_online_preset_sections, reserved=("train",))
    return config


def load_online_preset_sections(name_or_path: str) -> dict[str, Any]:
    """An online preset's sections ``{"online": {...}, "train": {...}}``, checked (:func:`online_sections`), for
    ``resolve_stage_config``'s ``read_preset``."""
    data = read_preset_json(name_or_path, ONLINE_PRESETS)
    online_sections(data, f"preset {name_or_path}")
    return data


#: The train options ``online`` takes (dotted ``TrainConfig`` paths); the rest are set in the train section.
ONLINE_TRAIN_OPTIONS = frozenset({
    "output", "resume", "drafter_gpus", "drafter_processes", "device", "drafter.num_draft_layers", "drafter.block_size",
    "drafter.max_anchors_per_document", "data.token_budget", "data.num_buckets", "data.validation_fraction",
    "data.validation_split_by", "epochs", "max_steps", "stop_at_step", "optim.lr", "seed", "min_supervised_tokens",
    "save_every", "telemetry.log_every", "telemetry.progress", "grad_accum_steps", "eval_every", "keep_last",
    "allow_config_change", "break_lock",
})  # fmt: skip


def register(app: typer.Typer) -> None:
    """Add ``dflash-stages online``."""
    @app.command("online")
    @config_options(OnlineConfig, "online", include={
        *(f.name for f in fields(OnlineConfig)), *(f"train.{path}" for path in ONLINE_TRAIN_OPTIONS)}, shared_help={
        "preset": f"A layout: {', '.join(ONLINE_PRESETS)}, or a .json file ({{online: {{...}}, train: {{...}}}}); "
                  "options given override it.",
        "config": "Settings in a .toml, .yaml or .json file with the sections online and train (what --print-config "
                  "prints); over --preset, under the options given.",
        "set": "online.FIELD=VALUE or train.FIELD=VALUE (JSON value, else a string), over everything else. "
               "Repeatable.",
        "print_config": "Print the resolved config (JSON, readable by --config) and exit; nothing runs."})
    def online_command(settings: CommandSettings) -> None:
        """Train a drafter with target replicas feeding it through shared memory (no disk cache; --cache-to writes one).

        Same batches as extract + train on the same corpus and seed; DDP over --drafter-gpus; exact resume
        (--output RUN --resume); layouts: --preset.
        """
        from rich.console import Console

        given = settings.given
        online = {key: value for key, value in given.items() if not key.startswith("train.")}
        train_overrides = {key[len("train."):]: value for key, value in given.items() if key.startswith("train.")}
        config = config_from_cli(online, train_overrides, settings.preset, settings.config_file, settings.sets,
                                 announce=not settings.print_config, option_names=settings.spellings)
        if settings.print_config:
            print(json.dumps(printable_config(config), indent=2))
            return
        summary = run_online(config)
        Console().print_json(json.dumps(summary, default=str))
        exit_if_interrupted(summary, config.train, command="online")
