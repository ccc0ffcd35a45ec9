"""The rank launcher of ``train``: one process, ranks under an existing ``torchrun``, or one spawned process per
rank through ``torch.distributed.run``'s elastic launcher."""


from __future__ import annotations

import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from dflash.errors import ConfigError, DFlashError
from dflash.io.locks import output_lock
from stages.train.config import TrainConfig
from stages.train.resume import refuse_changed_resume

__all__ = ["run_training"]

log = logging.getLogger(__name__)


def _pick_device(config: TrainConfig, local_rank: int):
    import torch

    use_cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    if not use_cuda:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("device='cuda' but CUDA is not available here; use --device cpu")
    gpu = config.drafter_gpus[local_rank] if config.drafter_gpus else local_rank
    if os.environ.get("DFLASH_GPUS_REMAPPED"):  # the launcher already narrowed CUDA_VISIBLE_DEVICES to the list
        gpu = local_rank
    torch.cuda.set_device(gpu)
    return torch.device("cuda", gpu)


def _train_worker(config_dict: dict[str, Any], data_factory: Any = None) -> dict[str, Any]:
    """One rank: join the process group (if any), train, close. Picklable entry point of the launcher.

    ``data_factory(config, rank=, world_size=, device=) -> stages.train.data.TrainingData`` builds the rank's batch
    sources (picklable: it travels to spawned ranks); ``None``: the cache's (:func:`stages.train.data.open_cache_data`).
    ``pipelines/online.py`` passes the online queue's."""
    import torch
    import torch.distributed as dist

    from stages.train.data import open_cache_data
    from stages.train.loop import Trainer

    config = TrainConfig.from_dict(config_dict)
    config.apply_kernel_choices()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = _pick_device(config, local_rank)
    initialized_here = False
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", device_id=device if device.type == "cuda" else None)
        initialized_here = True
    if device.type == "cpu" and world_size > 1:
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    trainer = None
    try:
        # The trainer gets its batch sources: the cache's, or (pipelines/online.py) the queue's.
        data = (data_factory or open_cache_data)(config, rank=rank, world_size=world_size, device=device)
        trainer = Trainer(config, rank=rank, world_size=world_size, device=device, data=data)
        return trainer.fit()
    finally:
        if trainer is not None:
            trainer.close()
        if initialized_here:
            dist.destroy_process_group()


def run_training(config: TrainConfig) -> dict[str, Any]:
    """Run the train stage: in this process, under an existing ``torchrun``, or by launching one process per
    rank (``torch.distributed.run``'s elastic launcher, spawn start method). Returns rank 0's summary.

    The run folder's lock (``dflash.io.locks``) is held for the whole run by this process (the launcher, or rank 0
    under ``torchrun``), taken before anything is read or written. A run that creates its folder and fails with a
    :class:`DFlashError` before its first checkpoint (a cache chunk that fails to decode) removes that folder.

    Raises:
        ConfigError: ``output`` exists and is not a folder.
        LockError: another process trains into ``config.output``; the message names it.
    """
    output = Path(config.output)
    if output.exists() and not output.is_dir():
        raise ConfigError(
            f"output: {output} exists and is not a folder (a run folder is expected); pass --output a new or existing "
            "run folder"
        )
    if "TORCHELASTIC_RUN_ID" in os.environ and int(os.environ.get("RANK", "0")) != 0:
        return _run_training(config)  # under torchrun: rank 0 holds the lock for the run
    from stages.train.data import check_training_samples

    with output_lock(config.output, what="run", break_lock=config.break_lock):
        check_training_samples(config)  # degenerate data is refused before anything loads or is written
        created = not output.exists()
        try:
            return _run_training(config)
        except DFlashError:
            # Refused input found once the run had started (a chunk that fails to decode): a folder this run
            # created and left without a checkpoint holds nothing to resume, so it goes; anything else is kept.
            if created and output.is_dir() and not (output / "latest").exists():
                shutil.rmtree(output, ignore_errors=True)
            raise


def _run_training(config: TrainConfig, data_factory: Any = None) -> dict[str, Any]:
    """The ranks of a run (the caller holds the run folder's lock): this process alone, or one spawned process per
    rank. ``data_factory``: see :func:`_train_worker`."""
    config_dict = config.to_dict()
    if "TORCHELASTIC_RUN_ID" in os.environ or config.world_size == 1:
        return _train_worker(config_dict, data_factory)
    refuse_changed_resume(config)  # here, not in each rank: one error: line instead of a failed launch per rank
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    previous = {key: os.environ.get(key) for key in ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "DFLASH_GPUS_REMAPPED")}
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does for several processes per node
    if config.drafter_gpus:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in config.drafter_gpus)
        os.environ["DFLASH_GPUS_REMAPPED"] = "1"
    launch = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=config.world_size,
        run_id=f"dflash-train-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
    )
    try:
        results = elastic_launch(launch, _train_worker)(config_dict, data_factory)
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return results[0]
