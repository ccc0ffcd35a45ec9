"""The drafter training loop of the ``train`` stage (one process = one data-parallel rank).

:meth:`Trainer.fit` reads top-down: load (cache, target, drafter, optimizer, loaders, checks, resume) -> step ->
save -> evaluate -> log. Details live in :meth:`Trainer.train_step` and in the components (``dflash.batches.stream``,
``dflash.drafter``, ``dflash.training.optim``, ``dflash.training.checkpoint``, ``dflash.training.telemetry``).

Loss normalization (docs/dflash.md; the per-rank normalization bug it warns about): every micro-batch's backward runs on
the UNnormalized objective sum (``weighted_ce_sum``, or ``ce_weight * CE + distill_weight * distill`` with a
distillation term, ``drafter.distill``); after the last micro-batch, the weight sums of all micro-batches of all
ranks are all-reduced and the gradients multiplied by ``world_size / global_weight_sum`` (``world_size`` undoes
DDP's gradient averaging). The update is the gradient of ``sum_ranks sum_micro ce / global weight sum``, the same
for one process with gradient accumulation over the same global batch as for DDP.

Anchors of a batch are drawn from a generator seeded by ``(seed, epoch, global batch index)``: the same batch gets
the same anchors whichever rank reads it, with or without a resume; a new epoch re-samples them.

A non-finite loss (on any rank) or gradient norm skips the update: gradients are dropped, the optimizer state is
untouched, the step is counted in ``skipped_steps`` and logged; the data and the schedule move on.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import signal
import threading
import time
import warnings
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from dflash.batches.buckets import render_bucket_table
from dflash.drafter import (
    DFlashConfig,
    DFlashDrafter,
    attention_backend,
    attention_implementation,
    dflash_loss,
    expected_acceptance_length,
    flash_attention_available,
    sample_anchors,
)
from dflash.drafter.attention_kernels import flash_attention_applies
from dflash.drafter.target_init import default_init_layers, init_from_target_layers
from dflash.errors import CheckpointError, ConfigError, DFlashError, TargetError
from dflash.target.load import resolve_target_path, target_identity
from dflash.target.taps import LAYER_ID_CONVENTION
from dflash.training.checkpoint import (
    Checkpointer,
    capture_rng_state,
    check_target_weights,
    collect_environment,
    load_checkpoint,
    read_latest,
    read_run_record,
    restore_rng_state,
    target_weight_record,
    write_run_json,
)
from dflash.training.checks import check_target_identity, check_training_inputs
from dflash.training.optim import (
    build_optimizer,
    build_scheduler,
    clip_grad_norm,
    extend_schedule,
    restore_scheduler,
    schedule_segments,
)
from dflash.training.telemetry import (
    BucketCounter,
    FeedMeter,
    MetricsWriter,
    StepTimer,
    StepTimeWindow,
    ThroughputWindow,
    training_progress,
)
from stages.train.data import TrainingData, loader_placement, open_cache_data, schedule_steps
from stages.train.hyperparameters import (
    convention_warnings,
    hyperparameter_rows,
    render_hyperparameters,
)
from stages.train.resume import check_resume_changes
from stages.train.target_weights import load_target_embeddings, read_target_tensor, target_weight_map

if TYPE_CHECKING:
    from dflash.batches.packed import PackedBatch
    from stages.train.config import TrainConfig

__all__ = ["Trainer", "check_run_folder"]

log = logging.getLogger(__name__)



def check_run_folder(run_dir: Path, *, resume: bool) -> None:
    """Refuse a run folder that exists and holds files but no ``run.json`` (a cache, the user's files), also with
    ``--resume``: a run is never written into it.

    Raises:
        CheckpointError: naming the folder and the fix.
    """
    run_dir = Path(run_dir)
    if run_dir.is_dir() and not (run_dir / "run.json").is_file() and any(run_dir.iterdir()):
        raise CheckpointError(
            f"--output {run_dir} exists and holds files that are not a dflash run (no run.json); pass a new or empty "
            "folder so nothing of yours is mixed with the run" + (", or the folder of the run to resume" if resume else "")
        )


class _LossModule(nn.Module):
    """``forward(batch, anchors) -> (objective_sum, weight_sum, correct[B-1], count[B-1], weighted_ce_sum,
    distill_sum)`` so DDP wraps it."""

    def __init__(self, drafter: DFlashDrafter, gamma: float, objective: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.drafter = drafter
        self.gamma = gamma
        self.objective = objective or {}  # dflash_loss's distill, distill_weight, ce_weight

    def forward(self, batch: PackedBatch, anchors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = dflash_loss(self.drafter, batch, anchors, gamma=self.gamma, **self.objective)
        objective = out.objective_sum
        if not objective.requires_grad:  # keep every parameter in the graph (DDP waits for all of them)
            objective = objective + sum(p.reshape(-1)[0] * 0.0 for p in self.drafter.parameters())
        return (objective, out.weight_sum, out.correct_per_position, out.count_per_position,
                out.weighted_ce_sum.detach(), out.distill_sum.detach())


def _anchor_seed(seed: int, split: str, epoch: int, batch_index: int) -> int:
    split_code = {"train": 0, "validation": 1}[split]
    state = np.random.SeedSequence([seed, split_code, epoch, batch_index]).generate_state(2, dtype=np.uint32)
    return int(state[0]) << 31 | int(state[1]) >> 1


class Trainer:
    """Trains one drafter on one cache. Construct on every rank (process group already initialized).

    Args:
        config: the resolved :class:`stages.train.config.TrainConfig`.
        rank, world_size: this process's data-parallel rank.
        device: the torch device of this rank.
        data: the batch sources to train on (:class:`TrainingData`: the offline cache's loaders from
            :func:`open_cache_data`, or the online queue's consumer); ``None``: :func:`open_cache_data` of
            ``config.cache``. Closed by :meth:`close`.
    """

    def __init__(self, config: TrainConfig, *, rank: int = 0, world_size: int = 1, device: torch.device,
                 data: TrainingData | None = None) -> None:
        self.config = config
        self.data = data
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.is_main = rank == 0
        self.run_dir = Path(config.output)
        self.step = 0
        self.counters: dict[str, Any] = {"skipped_steps": 0, "empty_steps": 0, "tokens_seen": 0, "data_digest": ""}
        self.metrics: MetricsWriter | None = None  # opened by load(), once the inputs are known to agree
        self.checkpointer: Checkpointer | None = None
        self.throughput = ThroughputWindow(config.telemetry.throughput_window)
        self.feed = FeedMeter()
        self._feed: dict[str, float] = {}  # the last log interval's feed rates (for the progress line)
        self.timer = StepTimer()
        self.step_times = StepTimeWindow(config.telemetry.throughput_window)
        self._interval = self._zero_interval()
        self._logged_loss: float | None = None  # the last train record's loss (the progress line shows it)
        self._train_iter = None
        self._stop_requested = False  # set by SIGTERM
        self._stopped = False  # the ranks agreed to stop after the current step
        self.excluded: dict[str, Any] = {}  # samples excluded for too few supervised tokens (set by load())

    # ================================================================== the loop
    def fit(self) -> dict[str, Any]:
        """Train until ``total_steps`` (or ``stop_at_step``); returns a summary (final metrics, run folder)."""
        self.load()
        config = self.config
        if self.device.type == "cpu" and self.is_main and config.data.token_budget * config.drafter.max_anchors_per_document > 2**20:
            # GPU-sized defaults (16384-token batches, 512 anchors per document) take minutes per step on a CPU.
            # Said after load(): a wrong --cache fails first with its own error, not after this warning.
            log.warning(
                "training on CPU with token budget %d and %d anchors per document: expect minutes per step; "
                "for CPU runs use e.g. --token-budget 1024 --max-anchors-per-document 32 (the cpu-small preset)",
                config.data.token_budget, config.drafter.max_anchors_per_document,
            )
        last_eval: dict[str, float] = {}
        self.throughput.reset_clock()  # setup time is not training throughput
        self.feed.mark(self.counters["tokens_seen"], self.train_loader.stats)
        with self.progress, self._stop_on_sigterm():
            task = self.progress.add_task("train", total=self.total_steps, completed=self.step, status="",
                                          tokens=self.counters["tokens_seen"])
            while self.step < self.total_steps and self.step != config.stop_at_step and not self._stopped:
                step_metrics = self.train_step()
                log_due = self._log_due()
                if log_due:  # the feed rates of the interval, before a checkpoint or an evaluation pauses it
                    self._feed = self.feed.interval(self.counters["tokens_seen"], self.train_loader.stats)
                stopping = step_metrics["stop"]  # SIGTERM on any rank: every rank stops after this same step
                if self.step % config.save_every == 0 or self.step in (self.total_steps, config.stop_at_step) or stopping:
                    self.save()
                evaluated = self.val_loader is not None and (
                    self.step % config.eval_every == 0 or self.step == self.total_steps
                )
                if evaluated:
                    last_eval = self.evaluate()
                    self.checkpointer.report_validation(self.step, last_eval["loss"])
                    self.metrics.log("val", self.step, last_eval)
                self.log(step_metrics)
                if evaluated:
                    self.throughput.reset_clock()  # evaluation time is not training throughput
                if evaluated or log_due:  # the next feed interval starts after this step's checkpoint and evaluation
                    self.feed.mark(self.counters["tokens_seen"], self.train_loader.stats)
                self.progress.update(task, completed=self.step, tokens=self.counters["tokens_seen"],
                                     status=self._status(step_metrics, last_eval))
                if stopping:
                    log.warning("stopped at step %d on SIGTERM or Ctrl-C, with a checkpoint; --resume continues it", self.step)
        self.checkpointer.wait()
        return self.summary(last_eval)

    @contextlib.contextmanager
    def _stop_on_sigterm(self):
        """While training, SIGTERM (a preemption; torchrun forwards it to every rank) or a first Ctrl-C (SIGINT) asks
        for a clean stop: the ranks agree on it through the step's all-reduce, finish that step, checkpoint it and
        return. A second Ctrl-C aborts at once."""
        self._stop_requested = False
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def request_stop(signum, frame):
            self._stop_requested = True
            if signum == signal.SIGINT:  # a second Ctrl-C aborts at once, without the checkpoint
                signal.signal(signal.SIGINT, signal.default_int_handler)
                log.warning("Ctrl-C: stopping after this step with a checkpoint (press Ctrl-C again to abort)")

        previous = {signum: signal.signal(signum, request_stop) for signum in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    # ================================================================== load
    def load(self) -> None:
        """Take the batch sources; load target weights, drafter, optimizer; check they agree; resume if asked."""
        config = self.config
        if self.data is None:  # the train stage's own data: the cache of config.cache
            self.data = open_cache_data(config, rank=self.rank, world_size=self.world_size, device=self.device)
        metadata = self.data.metadata
        self.integrity = self.data.integrity
        self.target_spec = config.target or metadata.target_spec
        target_path = resolve_target_path(self.target_spec)
        self.identity = target_identity(target_path)
        embed, lm_head = load_target_embeddings(target_path)

        resume_from = self._resume_checkpoint()
        if resume_from is not None:
            drafter_config = DFlashConfig.from_dict(resume_from.drafter_config)
            check_target_identity(
                resume_from.target_info.get("identity", {}), self.identity, where=f"checkpoint {resume_from.path}",
                fix="resume with the target the run was trained with",
            )
            check_target_weights(resume_from.target_info, embed, lm_head, where=str(resume_from.path))
        else:
            drafter_config = self._new_drafter_config(target_path, metadata)
        # Before step 1: cache, drafter config and target must agree (raises MismatchError naming the field).
        check_training_inputs(
            metadata, drafter_config, target_identity=self.identity, embedding_rows=int(embed.shape[0]),
            layer_id_convention=LAYER_ID_CONVENTION, cache_path=str(config.cache),
        )
        self.drafter_config = drafter_config
        self.checkpointer = Checkpointer(self.run_dir, keep_last=config.keep_last, enabled=self.is_main)
        torch.manual_seed(config.seed)  # identical initial weights on every rank and in every rerun
        drafter = DFlashDrafter(drafter_config)
        drafter.attach_target(embed, lm_head)
        self.drafter_init = {"init": "random"} if resume_from is None else self._previous_drafter_init()
        if resume_from is None and config.drafter.init == "target":
            self.drafter_init = self._init_from_target(drafter, target_path)
        drafter.residual_in_compute_dtype = config.residual_dtype == "compute"
        self.drafter = drafter.to(self.device)
        self.anchor_slots = config.resolved_anchor_slots()
        self._compiled_graphs_logged = 0
        self._compiled_graphs_epoch: int | None = None
        if config.compile:
            self.drafter.compile_layers()
        self.target_info = {
            "identity": self.identity.to_dict(),
            "target_spec": self.target_spec,
            "target_path": str(target_path),
            **target_weight_record(embed, lm_head),
        }

        self.train_loader = self.data.train
        self.val_loader = self.data.validation
        if self.val_loader is not None:
            self._val_start = self.val_loader.state_dict()
        self.excluded = self._excluded_samples()
        micro_per_epoch = len(self.train_loader)
        if micro_per_epoch < 1:
            raise ConfigError(
                f"the cache gives no full step per epoch for world_size={self.world_size} (batches per rank: "
                f"{micro_per_epoch}); lower token_budget or use fewer ranks"
            )
        self.total_steps = schedule_steps(config, micro_per_epoch)
        # Window of the realized bucket shares: one entry per bucket per step, over the throughput window.
        self.buckets = BucketCounter(window=config.telemetry.throughput_window * self.train_loader.num_buckets)
        self.optimizer = build_optimizer(self.drafter.parameters(), config.optim)
        self.scheduler = build_scheduler(self.optimizer, config.optim, total_steps=self.total_steps)
        if resume_from is not None:
            self._restore(resume_from)

        self.loss_module: nn.Module = _LossModule(self.drafter, config.resolved_gamma(), self._objective())
        if self.world_size > 1:
            from torch.nn.parallel import DistributedDataParallel

            with warnings.catch_warnings():  # torch >= 2.12 renames it; 2.11 (the GPU host) only has this name
                warnings.simplefilter("ignore", FutureWarning)
                self.loss_module = DistributedDataParallel(
                    self.loss_module,
                    device_ids=[self.device.index] if self.device.type == "cuda" else None,
                    broadcast_buffers=False,  # the frozen target embedding/LM head are buffers, identical everywhere
                )
        self.autocast = (
            torch.autocast("cuda", dtype=torch.bfloat16)
            if self.device.type == "cuda" and config.mixed_precision == "bf16"
            else contextlib.nullcontext()
        )
        self.timer = StepTimer()
        self.progress = training_progress(enabled=self.is_main and config.telemetry.progress,
                                          interval=config.telemetry.progress_interval)
        self.environment = collect_environment() | {"world_size": self.world_size, "device": str(self.device),
                                                    "compile": config.compile, **_data_fingerprints(self.data)}
        compute_dtype = torch.bfloat16 if isinstance(self.autocast, torch.autocast) else torch.float32
        head_dim = self.drafter_config.head_dim
        attention = attention_implementation(self.device, compute_dtype, head_dim)
        if self.is_main and attention_backend() == "auto" and attention == "flex-triton" and flash_attention_applies(
                self.device, compute_dtype, head_dim) and not flash_attention_available():
            log.info("flash-attn-4 is not installed: attention runs on inductor's Triton kernels; "
                     "pip install 'dflash-stages[fa4]' runs it on flash-attn-4's, 1.6-1.8%% faster per step on an H200 "
                     "(docs/benchmarks.md)")
        if self.is_main and attention_backend() == "flash" and attention == "dense-sdpa":
            log.warning("--attention-backend flash ignored on %s: off CUDA the drafter uses its dense-mask path",
                        self.device)
        self.resolved = {
            "target_spec": self.target_spec,
            "attention": attention,
            "drafter_config": self.drafter_config.to_dict(),
            "gamma": config.resolved_gamma(),
            "anchor_slots": self.anchor_slots,
            "total_steps": self.total_steps,
            "world_size": self.world_size,
            "device": str(self.device),
            "bucket_boundaries": list(self.train_loader.boundaries),
            "validation": ({"samples": self.val_loader.num_samples, "split_by": self.val_loader.describe().get("validation_split")}
                           if self.val_loader is not None else None),
            "excluded_samples": self.excluded,
            "drafter_init": self.drafter_init,
            "cache_integrity": {key: value for key, value in self.integrity.items() if key != "seconds"},
        }
        # Opened last, so a run refused above writes no metrics or TensorBoard file; from the step resumed (0 when
        # new), dropping what a killed attempt logged past it.
        self.metrics = MetricsWriter(self.run_dir, enabled=self.is_main, start_step=self.step,
                                     trackers=config.telemetry.report_to, config=config.to_dict())
        if self.is_main:
            self._write_run_json()
            self.metrics.log("data", self.step, self.excluded)

    def _excluded_samples(self) -> dict[str, Any]:
        """Samples left out for too few supervised tokens (docs/dflash.md), per split; logged once at start."""
        minimum = self.config.resolved_min_supervised_tokens()
        loaders = {"train": self.train_loader, "validation": self.val_loader}
        record: dict[str, Any] = {"min_supervised_tokens": minimum}
        for split, loader in loaders.items():
            if loader is not None:
                record[f"excluded_short_samples_{split}"] = loader.num_excluded_short
                record[f"excluded_short_tokens_{split}"] = loader.num_excluded_short_tokens
        total = sum(loader.num_excluded_short for loader in loaders.values() if loader is not None)
        kept = sum(loader.num_samples for loader in loaders.values() if loader is not None)
        record["excluded_short_samples"] = total
        if self.is_main:
            log.log(
                logging.WARNING if total else logging.INFO,
                "excluded %d of %d samples with fewer than %d supervised tokens (min_supervised_tokens; "
                "train %d, validation %s)", total, total + kept, minimum, self.train_loader.num_excluded_short,
                self.val_loader.num_excluded_short if self.val_loader is not None else "-",
            )
        return record

    def _resume_checkpoint(self):
        config = self.config
        check_run_folder(self.run_dir, resume=config.resume)
        if not config.resume:
            if (self.run_dir / "latest").is_file():
                raise CheckpointError(
                    f"{self.run_dir} already holds a run (latest -> {read_latest(self.run_dir)}); "
                    "pass --resume to continue it, or another --output"
                )
            return None
        if not (self.run_dir / "latest").is_file():
            log.warning("--resume: %s has no checkpoint yet; starting from step 0", self.run_dir)
            return None
        checkpoint = load_checkpoint(self.run_dir)
        check_resume_changes(checkpoint.path, checkpoint.trainer_state, config, self.world_size)
        return checkpoint

    def _new_drafter_config(self, target_path: Path, metadata) -> DFlashConfig:
        from transformers import AutoConfig, AutoTokenizer

        config = self.config
        tokenizer = AutoTokenizer.from_pretrained(target_path) if config.drafter.mask_token_id is None else None
        return DFlashConfig.from_target_config(
            AutoConfig.from_pretrained(target_path),
            tokenizer=tokenizer,
            num_draft_layers=config.drafter.num_draft_layers,
            block_size=config.drafter.block_size,
            mask_token_id=config.drafter.mask_token_id,
            target_layer_ids=(config.drafter.target_layer_ids if config.drafter.target_layer_ids is not None
                              else metadata.target_layer_ids),
        )

    def _previous_drafter_init(self) -> dict[str, Any]:
        """A resumed run's record of how its drafter was initialized (run.json ``resolved.drafter_init``)."""
        try:
            record = read_run_record(self.run_dir).get("resolved", {}).get("drafter_init")
        except (OSError, ValueError):
            record = None
        return record if isinstance(record, dict) else {"init": "unknown (resumed from a checkpoint)"}

    def _init_from_target(self, drafter: DFlashDrafter, target_path: Path) -> dict[str, Any]:
        """``train.drafter.init = "target"``: draft layers copied from target layers (``dflash.drafter.target_init``)."""
        layers = self.config.drafter.init_target_layers or default_init_layers(
            self.drafter_config.num_target_layers, self.drafter_config.num_hidden_layers)
        weight_map = target_weight_map(target_path)
        if not weight_map:
            raise TargetError(f"train.drafter.init = 'target': {target_path} has no safetensors weights to copy; "
                              "use init = 'random'")
        report = init_from_target_layers(drafter, weight_map, lambda name: read_target_tensor(weight_map, name), layers)
        if self.is_main:
            log.info("draft layers initialized from target layers %s (%d tensors)", report["layers"], report["tensors"])
        return {"init": "target", **report}

    def _loader_placement(self) -> dict[str, Any]:
        return loader_placement(self.rank, self.world_size, self.device)

    def _restore(self, checkpoint) -> None:
        state = checkpoint.trainer_state
        self.drafter.load_state_dict(checkpoint.model_state)
        self.optimizer.load_state_dict(checkpoint.optimizer_state)
        try:
            restore_scheduler(self.scheduler, state["scheduler"])
            self.train_loader.load_state_dict(state["data"])
            self.buckets.load_state_dict(state["buckets"])
            self.counters.update(state["counters"])
        except DFlashError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as error:  # a field of a wrong type
            raise CheckpointError(
                f"{checkpoint.path / 'trainer_state.json'}: cannot resume from it ({type(error).__name__}: "
                f"{str(error)[:120]}); the file is damaged or was edited: resume from another checkpoint (write its "
                "folder name into RUN/latest), or start a new run"
            ) from None
        self.step = checkpoint.step
        if checkpoint.rng_state is not None:
            restore_rng_state(checkpoint.rng_state)
        if self.is_main:
            log.info("resumed %s at step %d (epoch %d)", checkpoint.path, self.step, self.train_loader.epoch)
        self._continue_schedule()

    def _continue_schedule(self) -> None:
        """After a resume with more steps (or epochs) than the saved schedule spans: the added steps re-warm and
        decay again (``dflash.training.optim.extend_schedule``) instead of training on at the schedule's floor (lr 0 by
        default). The saved schedule, extensions included, is what the checkpoint restored; an unchanged config
        leaves it as it is."""
        planned = self.scheduler.lr_lambdas[0].end_step
        saved_peak = float(self.scheduler.base_lrs[0])
        if self.config.optim.lr != saved_peak and self.is_main:
            log.warning("lr %.3g ignored on resume: the restored schedule keeps the run's peak lr %.3g",
                        self.config.optim.lr, saved_peak)
        if extend_schedule(self.scheduler, self.config.optim, total_steps=self.total_steps) is not None:
            segment = schedule_segments(self.scheduler)[-1]
            if self.is_main:
                log.info(
                    "lr schedule extended at step %d: total steps %d -> %d; the added steps re-warm linearly from "
                    "lr %.3g to %.3g over %d steps, then follow the %s schedule to %.3g at step %d", self.step, planned,
                    self.total_steps, segment["start_lr"], segment["peak_lr"], segment["warmup_steps"],
                    segment["schedule"], segment["end_lr"], self.total_steps,
                )
        elif self.total_steps < planned and self.step < self.total_steps and self.is_main:
            log.warning(
                "the run now ends at step %d, before its lr schedule (planned for %d steps) has decayed; the "
                "schedule is kept as it was", self.total_steps, planned,
            )

    # ================================================================== step
    def _next_batch(self, split: str = "train") -> tuple[PackedBatch, torch.Tensor]:
        """Next batch of this rank with its anchors, both on the device (anchors drawn on the host copy)."""
        loader = self.train_loader
        while True:
            if self._train_iter is None:
                self._train_iter = iter(loader)
            try:
                batch = next(self._train_iter)
                break
            except StopIteration:
                self._train_iter = None
        batch_index = (loader.step_in_epoch - 1) * self.world_size + self.rank
        generator = torch.Generator().manual_seed(_anchor_seed(self.config.seed, split, loader.epoch, batch_index))
        anchors = sample_anchors(
            batch, self.drafter_config.block_size, self.config.drafter.max_anchors_per_document, generator,
            num_anchors=self.anchor_slots,
        )
        digest = hashlib.sha256((self.counters["data_digest"] + repr(batch.corpus_rows)).encode()).hexdigest()
        self.counters["data_digest"] = digest
        if batch.input_ids.device != self.device:  # CUDA loaders already yield the batch on the device
            batch = batch.to(self.device, non_blocking=True)
        return batch, anchors.to(self.device, non_blocking=True)

    def train_step(self) -> dict[str, Any]:
        """One optimizer step over ``grad_accum_steps`` micro-batches per rank; returns this step's metrics."""
        config = self.config
        log_step = (self.step + 1) % config.telemetry.log_every == 0
        self.timer = StepTimer(torch.cuda.synchronize if log_step and self.device.type == "cuda" else None)
        self.timer.start_step()
        sums = self._new_step_sums()
        for micro in range(config.grad_accum_steps):
            with self.timer.phase("data_wait"):
                batch, anchors = self._next_batch()
            last = micro == config.grad_accum_steps - 1
            with contextlib.nullcontext() if last or self.world_size == 1 else self.loss_module.no_sync():
                with self.timer.phase("forward"), self.autocast:
                    outputs = self.loss_module(batch, anchors)
                with self.timer.phase("backward"):
                    outputs[0].backward()  # the UNnormalized objective sum; see the module docstring
            self._accumulate(sums, batch, anchors, outputs)
        with self.timer.phase("optimizer"):
            values, grad_norm, finite, lr = self._apply_update(sums)
        self.step += 1
        self._count(values, grad_norm, finite)
        time_split = self.timer.summary()
        buckets = [bucket for bucket, batches in enumerate(values["bucket_batches"]) if batches]
        self.step_times.update(time_split, split=self.device.type != "cuda" or log_step,
                               bucket=buckets[0] if len(buckets) == 1 else None, real_tokens=int(values["real_tokens"]))
        return {
            "loss": values["objective_sum"] / values["weight_sum"] if values["weight_sum"] > 0 else float("nan"),
            "grad_norm": grad_norm,
            "lr": lr,
            "skipped": not finite,
            "stop": self._stopped,
            "time": time_split,
        }

    # Layout of the per-step sums (one float64 vector, so ranks all-reduce it in one call).
    _SCALARS = ("ce_sum", "weight_sum", "real_tokens", "padded_tokens", "supervised_tokens", "block_tokens",
                "distill_sum", "objective_sum")

    def _new_step_sums(self) -> torch.Tensor:
        """``[8 scalars, correct[B-1], count[B-1], bucket tokens[K], bucket batches[K], stop]`` zeros on the
        device."""
        # the last slot is the stop vote (SIGTERM seen by any rank)
        size = len(self._SCALARS) + 2 * (self.drafter_config.block_size - 1) + 2 * self.train_loader.num_buckets + 1
        return torch.zeros(size, dtype=torch.float64, device=self.device)

    def _accumulate(self, sums: torch.Tensor, batch: PackedBatch, anchors: torch.Tensor, outputs) -> None:
        """Add one micro-batch's loss sums and token counts to ``sums`` (device ops only, no host sync)."""
        objective, weight_sum, correct, count, ce_sum, distill_sum = outputs
        positions = self.drafter_config.block_size - 1
        sums[0] += ce_sum.double()
        sums[1] += weight_sum.detach().double()
        sums[2] += batch.num_real_tokens
        sums[3] += batch.num_tokens
        sums[4] += batch.loss_mask.sum()
        sums[5] += (anchors >= 0).sum() * (positions + 1)  # drafted block tokens (padding anchor slots excluded)
        sums[6] += distill_sum.double()
        sums[7] += objective.detach().double()
        at = len(self._SCALARS)
        sums[at : at + positions] += correct.double()
        sums[at + positions : at + 2 * positions] += count.double()
        if batch.bucket_id >= 0:
            bucket_at = at + 2 * positions
            sums[bucket_at + batch.bucket_id] += batch.num_real_tokens
            sums[bucket_at + self.train_loader.num_buckets + batch.bucket_id] += 1

    def _apply_update(self, sums: torch.Tensor) -> tuple[dict[str, Any], float, bool, float]:
        """All-reduce the sums, normalize gradients globally, clip, and step unless something is non-finite.

        Returns ``(values, grad_norm, finite, lr)``; ``values`` has the named scalars plus ``correct``, ``count``,
        ``bucket_tokens`` and ``bucket_batches`` lists, all global (summed over ranks).
        """
        sums[-1] = float(self._stop_requested)
        if self.world_size > 1:
            torch.distributed.all_reduce(sums)
        weight_total = sums[1]
        parameters = [p for p in self.drafter.parameters() if p.grad is not None]
        # grad = (1/W) sum_ranks d ce_r (DDP averages) -> x W / global weight sum = d (sum_ranks ce_r / weight sum)
        scale = torch.where(weight_total > 0, self.world_size / weight_total.clamp(min=1e-12), 0.0)
        torch._foreach_mul_([p.grad for p in parameters], scale.to(torch.float32))
        grad_norm = float(clip_grad_norm(parameters, self.config.optim.grad_clip))
        flat = sums.tolist()  # the step's one host sync
        positions, num_buckets = self.drafter_config.block_size - 1, self.train_loader.num_buckets
        values: dict[str, Any] = dict(zip(self._SCALARS, flat, strict=False))
        cursor = len(self._SCALARS)
        for name, width in (("correct", positions), ("count", positions), ("bucket_tokens", num_buckets),
                            ("bucket_batches", num_buckets)):
            values[name] = flat[cursor : cursor + width]
            cursor += width
        self._stopped = flat[-1] > 0
        finite = math.isfinite(values["objective_sum"]) and math.isfinite(grad_norm)
        if not finite:
            self.counters["skipped_steps"] += 1
            log.warning(
                "step %d: non-finite %s; update skipped (%d skipped so far)", self.step + 1,
                "loss" if not math.isfinite(values["objective_sum"]) else "gradient norm",
                self.counters["skipped_steps"],
            )
        elif values["weight_sum"] <= 0:
            self.counters["empty_steps"] += 1  # nothing supervised in the whole global batch
        else:
            self.optimizer.step()
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()  # the schedule follows the data position, skipped or not
        self.optimizer.zero_grad(set_to_none=True)
        return values, grad_norm, finite, lr

    def _count(self, values: dict[str, Any], grad_norm: float, finite: bool) -> None:
        """Update counters, throughput window, bucket counts and the logging interval with a step's global sums."""
        self.counters["tokens_seen"] += int(values["real_tokens"])
        for bucket, (tokens, batches) in enumerate(zip(values["bucket_tokens"], values["bucket_batches"], strict=True)):
            if batches:
                self.buckets.update(bucket, int(tokens), int(batches))
        self.throughput.update(
            real_tokens=int(values["real_tokens"]), padded_tokens=int(values["padded_tokens"]),
            supervised_tokens=int(values["supervised_tokens"]), block_tokens=int(values["block_tokens"]),
        )
        interval = self._interval
        interval["steps"] += 1
        if finite:  # a skipped step contributes nothing to the interval's loss and accuracy
            interval["ce_sum"] += values["ce_sum"]
            interval["distill_sum"] += values["distill_sum"]
            interval["objective_sum"] += values["objective_sum"]
            interval["weight_sum"] += values["weight_sum"]
            interval["correct"] = np.add(interval["correct"], values["correct"])
            interval["count"] = np.add(interval["count"], values["count"])
            interval["grad_norm_max"] = max(interval["grad_norm_max"], grad_norm)

    # ================================================================== save / evaluate
    def save(self) -> None:
        """Snapshot the state now (all ranks call this; only rank 0 copies and writes, in the background)."""
        if not self.is_main:
            return
        started = time.perf_counter()
        snapshot = self.checkpointer.snapshot(
            step=self.step,
            model=self.drafter,
            optimizer=self.optimizer,
            trainer_state={
                "epoch": self.train_loader.epoch,
                "data": self.train_loader.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "schedule": schedule_segments(self.scheduler),  # readable; the scheduler state is what resumes
                "counters": dict(self.counters),
                "buckets": self.buckets.state_dict(),
                "config": self.config.to_dict(),
                "world_size": self.world_size,
                "total_steps": self.total_steps,
                "resolved": self.resolved,  # the checkpoint describes itself even when copied away from RUN
                "environment": self.environment,
            },
            rng_state=capture_rng_state(),
            drafter_config=self.drafter_config.to_dict(),
            target_info=self.target_info,
        )
        self.checkpointer.save(snapshot)
        # What the loop paid for this checkpoint (host copy, plus any unfinished previous write); the write itself
        # runs in the background and its duration is reported with the next checkpoint.
        self.metrics.log(
            "checkpoint", self.step,
            {"stall_s": time.perf_counter() - started, "previous_write_s": self.checkpointer.last_write_seconds},
        )

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Loss, per-position accuracy and implied acceptance length on the held-out split (fixed anchors)."""
        assert self.val_loader is not None
        block = self.drafter_config.block_size
        loader = self.val_loader
        loader.load_state_dict(self._val_start)
        sums = torch.zeros(4 + 2 * (block - 1), dtype=torch.float64, device=self.device)
        iterator = iter(loader)
        try:
            for index, batch in enumerate(iterator):
                if self.config.max_validation_batches is not None and index >= self.config.max_validation_batches:
                    break
                generator = torch.Generator().manual_seed(
                    _anchor_seed(self.config.seed, "validation", 0, index * self.world_size + self.rank)
                )
                anchors = sample_anchors(
                    batch, block, self.config.drafter.max_anchors_per_document, generator, num_anchors=self.anchor_slots
                )
                batch, anchors = batch.to(self.device), anchors.to(self.device)
                with self.autocast:
                    out = dflash_loss(self.drafter, batch, anchors, gamma=self.config.resolved_gamma(),
                                      **self._objective())
                sums[0] += out.objective_sum.double()
                sums[1] += out.weight_sum.double()
                sums[2] += out.weighted_ce_sum.double()
                sums[3] += out.distill_sum.double()
                sums[4 : 4 + block - 1] += out.correct_per_position.double()
                sums[4 + block - 1 :] += out.count_per_position.double()
        finally:
            iterator.close()
        if self.world_size > 1:
            torch.distributed.all_reduce(sums)
        values = sums.tolist()
        accuracy = [c / n if n else 0.0 for c, n in zip(values[4 : 3 + block], values[3 + block :], strict=True)]
        result = {
            "loss": values[0] / values[1] if values[1] > 0 else float("nan"),
            "accuracy_per_position": accuracy,
            "expected_acceptance_length": expected_acceptance_length(accuracy),
            "supervised_targets": sum(values[3 + block :]),
        }
        if self._objective_parts():
            result["ce_loss"] = values[2] / values[1] if values[1] > 0 else float("nan")
            result["distill_loss"] = values[3] / values[1] if values[1] > 0 else float("nan")
        return result

    # ================================================================== log
    def _zero_interval(self) -> dict[str, Any]:
        return {"steps": 0, "ce_sum": 0.0, "distill_sum": 0.0, "objective_sum": 0.0, "weight_sum": 0.0, "correct": 0.0,
                "count": 0.0, "grad_norm_max": 0.0}

    def _objective(self) -> dict[str, Any]:
        """``dflash_loss``'s objective settings from ``drafter.distill``, ``distill_weight`` and ``ce_weight``."""
        drafter = self.config.drafter
        return {"distill": drafter.distill, "distill_weight": drafter.distill_weight, "ce_weight": drafter.ce_weight}

    def _objective_parts(self) -> bool:
        """The loss is more than the plain CE: the metrics then log its parts, ``ce_loss`` and ``distill_loss``."""
        return self.config.drafter.distill != "none" or self.config.drafter.ce_weight != 1.0

    def _log_due(self) -> bool:
        return self.step % self.config.telemetry.log_every == 0 or self.step == self.total_steps

    def log(self, step_metrics: dict[str, Any]) -> None:
        """Every ``log_every`` steps: interval loss/accuracy/tau, lr, grad norm, skips, throughput, time split."""
        if not self._log_due():
            return
        interval, self._interval = self._interval, self._zero_interval()
        positions = self.drafter_config.block_size - 1
        correct = np.broadcast_to(np.asarray(interval["correct"], dtype=np.float64), (positions,))
        count = np.broadcast_to(np.asarray(interval["count"], dtype=np.float64), (positions,))
        accuracy = [float(c / n) if n else 0.0 for c, n in zip(correct, count, strict=True)]
        weight_sum = interval["weight_sum"]
        loss = interval["objective_sum"] / weight_sum if weight_sum > 0 else step_metrics["loss"]
        parts = {}
        if self._objective_parts():
            parts = {"ce_loss": interval["ce_sum"] / weight_sum if weight_sum > 0 else float("nan"),
                     "distill_loss": interval["distill_sum"] / weight_sum if weight_sum > 0 else float("nan")}
        record: dict[str, Any] = {
            "loss": loss,
            **parts,
            "accuracy_per_position": accuracy,
            "expected_acceptance_length": expected_acceptance_length(accuracy),
            "lr": step_metrics["lr"],
            "grad_norm": step_metrics["grad_norm"],
            "grad_norm_max": interval["grad_norm_max"],
            "skipped_steps": self.counters["skipped_steps"],
            "empty_steps": self.counters["empty_steps"],
            "epoch": self.train_loader.epoch,
            "tokens_seen": self.counters["tokens_seen"],
            "data_digest": self.counters["data_digest"][:16],
            **self.throughput.rates(),
            **self.step_times.summary(),  # time_* = window medians; per-bucket step time and tokens/s
            **self.buckets.summary(),
            "data_wait_total_s": self.train_loader.stats.wait_seconds,
        }
        if hasattr(self.train_loader.stats, "dispatch_wait_seconds"):  # online: producers held back by a full ring
            record["queue_full_wait_total_s"] = self.train_loader.stats.dispatch_wait_seconds
        # Achieved rate, trainer capacity T and (online) producer capacity I, ring occupancy, over this interval
        # (taken by fit() right after the step, so a checkpoint or an evaluation after it is not in it).
        record.update(self._feed)
        if self.config.compile:
            graphs = self.drafter.compiled_graphs
            record["compiled_graphs"] = graphs
            if graphs > self._compiled_graphs_logged:
                if self._compiled_graphs_epoch is None:  # this process's first epoch (a resume recompiles all)
                    self._compiled_graphs_epoch = self.train_loader.epoch
                late = self.train_loader.epoch > self._compiled_graphs_epoch  # every bucket's shapes seen by then
                (log.warning if late else log.info)(
                    "compiled layers: %d graph(s) so far (+%d since the last log, step %d)%s", graphs,
                    graphs - self._compiled_graphs_logged, self.step,
                    "; still rising after the first epoch: new batch shapes recompile" if late else "")
                self._compiled_graphs_logged = graphs
        self.metrics.log("train", self.step, record)
        self._logged_loss = record["loss"]

    def _status(self, step_metrics: dict[str, Any], last_eval: dict[str, float]) -> str:
        rates = self.throughput.rates()
        # The loss shown is the last train record's (dflash.training.telemetry.final_losses): the mean over the last
        # log interval, the figure report, sweep, diff and inspect call the final train loss.
        loss = "-" if self._logged_loss is None else f"{self._logged_loss:.3f}"
        status = f"loss {loss}  lr {step_metrics['lr']:.2e}"
        if rates:
            status += f"  last {self.throughput.window} steps {rates['real_tokens_per_s']:,.0f} tok/s"
        feed = self._feed
        if "producer_capacity_tokens_per_s" in feed:  # online: what each side could do alone, and the ring's fill
            status += (f" (inference alone {feed['producer_capacity_tokens_per_s']:,.0f}"
                       f" training alone {feed.get('trainer_capacity_tokens_per_s', float('nan')):,.0f} tok/s,"
                       f" ring {feed.get('ring_ready_mean', 0.0):.1f} batches ready)")
        if last_eval:
            status += f"  val {last_eval['loss']:.3f} tau {last_eval['expected_acceptance_length']:.2f}"
        if self.counters["skipped_steps"]:
            status += f"  skipped {self.counters['skipped_steps']}"
        return status

    def _write_run_json(self) -> None:
        from rich.console import Console

        rows = self.train_loader.bucket_table()
        console = Console(stderr=True)
        config = self.config
        self.resolved["convention_warnings"] = convention_warnings(
            block_size=self.drafter_config.block_size, gamma=config.resolved_gamma(), betas=config.optim.betas,
            max_anchors_per_document=config.drafter.max_anchors_per_document,
            longest_sample=max((row.max_length for row in rows), default=None),
        )
        console.print(render_hyperparameters(hyperparameter_rows(
            config, self.resolved, schedule=schedule_segments(self.scheduler), attention_backend=attention_backend())))
        for warning in self.resolved["convention_warnings"]:
            log.warning("%s", warning)
        console.print(render_bucket_table(rows, title=f"length buckets (epoch {self.train_loader.epoch})"))
        console.print(
            f"excluded samples (fewer than {self.excluded['min_supervised_tokens']} supervised tokens): "
            f"{self.excluded['excluded_short_samples']} (train {self.train_loader.num_excluded_short}, "
            f"{self.train_loader.num_excluded_short_tokens} tokens)"
        )
        resolved = {
            **self.resolved,
            "train_loader": self.train_loader.describe(),
            "validation_loader": self.val_loader.describe() if self.val_loader is not None else None,
            "bucket_table": [_row_dict(row) for row in rows],
            "cache_metadata": self.data.metadata.to_dict(),
            "data_source": {"kind": self.data.kind, **self.data.provenance},
        }
        write_run_json(self.run_dir, self.config.to_dict(), self.environment, resolved=resolved, target=self.target_info)
        self.metrics.log_text("config", f"```\n{self.config.to_dict()}\n```")

    def summary(self, last_eval: dict[str, float]) -> dict[str, Any]:
        best = self.checkpointer.best if self.checkpointer is not None else None
        return {
            "run_dir": str(self.run_dir),
            "step": self.step,
            "total_steps": self.total_steps,
            "skipped_steps": self.counters["skipped_steps"],
            "excluded_short_samples": self.excluded.get("excluded_short_samples", 0),
            "stopped_by_signal": self._stopped,
            "tokens_seen": self.counters["tokens_seen"],
            "data_digest": self.counters["data_digest"],
            "val": last_eval,
            "best": best,
        }

    def close(self) -> None:
        """Finish background writes and close files (called from the stage's ``finally``)."""
        try:
            if self.checkpointer is not None:
                self.checkpointer.close()
        finally:
            if self.metrics is not None:
                self.metrics.close()
            if self.data is not None:
                self.data.close()


def _data_fingerprints(data: Any) -> dict[str, Any]:
    """What identifies the training data in the environment record: the corpus fingerprint and a hash of the cache's
    metadata (target, taps, dtype, shard plan), so ``dflash-stages diff`` tells runs on other data apart."""
    metadata = data.metadata.to_dict()
    digest = hashlib.sha256(json.dumps(metadata, sort_keys=True, default=str).encode()).hexdigest()
    return {"cache_fingerprint": f"sha256:{digest}", "corpus_fingerprint": metadata.get("corpus_fingerprint")}


def _row_dict(row: Any) -> dict[str, Any]:
    return asdict(row) if is_dataclass(row) else {"row": repr(row)}
