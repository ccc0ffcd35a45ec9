"""The Dask cluster of every target-replica stage (``extract``, ``generate``): one local worker per target GPU, CPU
worker processes, or an existing scheduler (optionally over TLS).

Run by the stages, never alone. Local clusters listen on 127.0.0.1 only, the dashboard included (a bare ``:port``
binds 127.0.0.1 too); ``--tls-ca-file/--tls-cert/--tls-key`` connect to a ``tls://`` scheduler through
``distributed.security.Security`` (docs/cache-format.md, "Running extract on a shared machine or cluster").

Worker processes start as distributed's ``distributed.worker.multiprocessing-method`` says (``spawn`` by default:
each worker imports torch and transformers itself, a few seconds of CPU each). With ``forkserver`` (opt-in:
``DASK_DISTRIBUTED__WORKER__MULTIPROCESSING_METHOD=forkserver`` or dask's config file) the fork server imports torch
and transformers once and every worker forks from it (:func:`worker_process_options`); since the fork server keeps
the environment it started with, each worker is also handed this process's environment as of its cluster's start.
"""

from __future__ import annotations

import inspect
import logging
import multiprocessing
import os
from pathlib import Path
from typing import Any, Protocol

from dflash.errors import ConfigError, ConfigPathNotFoundError

__all__ = ["require_local_gpus", "PlacementSettings", "validate_placement", "start_cluster", "cluster_workers", "security_of",
           "dashboard_address_of", "worker_process_options", "close_cluster", "FORKSERVER_PRELOAD"]

# Imported once by distributed's fork server when workers start by ``forkserver``: what every target worker imports
# (most of a worker's start-up). Third-party modules only: this project's modules (some read the environment at
# import, e.g. dflash.faults) are imported by each worker under its own environment.
FORKSERVER_PRELOAD = ("distributed", "numpy", "torch", "transformers", "transformers.modeling_utils")

log = logging.getLogger(__name__)


class PlacementSettings(Protocol):
    """The placement fields a stage config declares (``ExtractConfig``, ``GenerateConfig``)."""

    scheduler_address: str | None
    target_gpus: list[int] | None
    target_processes: int | None
    dashboard_address: str
    tls_ca_file: str | None
    tls_cert: str | None
    tls_key: str | None


def require_local_gpus(config: PlacementSettings) -> None:
    """Refuse ``--target-gpus`` for a local cluster on a host without CUDA (called before any file is written).

    Raises:
        ConfigError: naming the GPUs and the CPU alternative.
    """
    if config.target_gpus and config.scheduler_address is None:
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"--target-gpus {','.join(map(str, config.target_gpus))}: CUDA is not available on this "
                              "host; use --target-processes N (CPU workers)")


def validate_placement(config: PlacementSettings) -> None:
    """Check the placement fields of a stage config (called from its ``__post_init__``).

    Raises:
        ConfigError: more than one of target_gpus / target_processes / scheduler_address, repeated GPUs, target_processes < 1, or
            incomplete / misplaced / missing TLS files; the message names the field.
    """
    chosen = [name for name in ("target_gpus", "target_processes", "scheduler_address") if getattr(config, name) is not None]
    if len(chosen) > 1:
        raise ConfigError(f"{chosen[0]}: give only one of --target-gpus, --target-processes, --scheduler-address, got {chosen}")
    if config.target_gpus is not None and (not config.target_gpus or len(set(config.target_gpus)) != len(config.target_gpus)
                                           or any(isinstance(g, bool) or not isinstance(g, int) or g < 0
                                                  for g in config.target_gpus)):
        raise ConfigError(f"target_gpus: expected distinct GPU indices >= 0, got {config.target_gpus}")
    if config.target_processes is not None and config.target_processes < 1:
        raise ConfigError(f"target_processes: expected >= 1, got {config.target_processes}")
    tls = {name: getattr(config, name) for name in ("tls_ca_file", "tls_cert", "tls_key")}
    given = [name for name, value in tls.items() if value is not None]
    if given and len(given) != 3:
        missing = sorted(set(tls) - set(given))
        raise ConfigError(f"{missing[0]}: TLS needs --tls-ca-file, --tls-cert and --tls-key together, got only {given}")
    if given and config.scheduler_address is None:
        raise ConfigError(f"{given[0]}: TLS options apply to --scheduler-address only (a local cluster listens on 127.0.0.1)")
    for name in given:
        if not Path(tls[name]).is_file():
            raise ConfigPathNotFoundError(f"{name}: {tls[name]} is not a file")


def start_cluster(config: PlacementSettings, *, daemonic_workers: bool = True) -> tuple[Any, Any, dict[str, Any]]:
    """Client, cluster (``None`` for an external scheduler) and the plugin/placement settings.

    A LocalCluster gets one worker per GPU of ``target_gpus`` (resource ``GPU=1``; all visible GPUs when neither
    ``target_gpus`` nor ``target_processes`` is given and CUDA is present), else ``target_processes`` CPU processes; it listens on
    127.0.0.1 only. ``daemonic_workers=False`` lets workers start processes of their own (extract's writers).
    """
    import torch
    from distributed import Client, LocalCluster

    if not log.isEnabledFor(logging.DEBUG):  # the scheduler and nannies log into this process
        logging.getLogger("distributed").setLevel(logging.WARNING)

    if config.scheduler_address is not None:
        client = Client(config.scheduler_address, security=security_of(config))
        workers = cluster_workers(client)
        has_gpu_resource = any(info.get("resources", {}).get("GPU") for info in workers.values())
        return client, None, {"device": "auto", "resources": {"GPU": 1} if has_gpu_resource else None, "die_with_parent": False}
    if not daemonic_workers:  # workers start processes of their own: daemonic processes may not have children
        import dask

        dask.config.set({"distributed.worker.daemon": False})
    gpus = config.target_gpus
    if gpus is None and config.target_processes is None and torch.cuda.is_available():
        gpus = list(range(torch.cuda.device_count()))
    if gpus is not None:
        # memory_limit=0: our host memory is pinned output buffers we bound ourselves; the nanny must not kill on it.
        cluster = LocalCluster(
            host="127.0.0.1",
            n_workers=len(gpus),
            threads_per_worker=1,
            processes=True,
            resources={"GPU": 1},
            memory_limit=0,
            dashboard_address=dashboard_address_of(config.dashboard_address),
            **worker_process_options(),
        )
        placement = {"gpu_by_worker": dict(enumerate(gpus)), "device": "cuda", "resources": {"GPU": 1}, "num_workers": len(gpus)}
    else:
        num_workers = config.target_processes or 1
        cluster = LocalCluster(
            host="127.0.0.1",
            n_workers=num_workers,
            threads_per_worker=1,
            processes=True,
            memory_limit=0,
            dashboard_address=dashboard_address_of(config.dashboard_address),
            **worker_process_options(),
        )
        threads = max(1, (os.cpu_count() or 1) // num_workers)
        placement = {"device": "cpu", "torch_threads": threads, "resources": None, "num_workers": num_workers}
    placement["die_with_parent"] = True
    return Client(cluster), cluster, placement


class _QuietWorkerKill(logging.Filter):
    """Drops the nanny's ``Worker process still alive after N seconds, killing`` while :func:`close_cluster` closes
    a finished run's workers: a process holding a target may take longer than the nanny's fixed 4 s to exit, and
    killing it then loses nothing (its work is committed). Logged at debug level instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "still alive after" in record.getMessage():
            log.debug("closing the cluster: %s", record.getMessage())
            return False
        return True


def close_cluster(client: Any, cluster: Any) -> None:
    """Close a stage's client and its local cluster (``None`` for an external scheduler, which stays up) without
    the nanny's kill warning, which at this point means nothing (:class:`_QuietWorkerKill`)."""
    quiet = _QuietWorkerKill()
    nanny = logging.getLogger("distributed.nanny")
    nanny.addFilter(quiet)
    try:
        client.close()
        if cluster is not None:
            cluster.close()
    finally:
        nanny.removeFilter(quiet)


def worker_process_options() -> dict[str, Any]:
    """Extra ``LocalCluster`` keyword arguments for how its worker processes start: none under ``spawn`` (the
    default; a spawned worker inherits this process's environment) or ``fork``.

    Under ``forkserver``: the fork server (started by the first worker of this process) preloads
    :data:`FORKSERVER_PRELOAD` instead of distributed's own list, and ``env`` carries this process's environment,
    which a forked worker would otherwise miss where it changed after the fork server started. Variables that
    distributed's ``distributed.nanny.pre-spawn-environ`` / ``distributed.nanny.environ`` set are left to those, as
    under ``spawn``; a variable removed since the fork server started stays set in the workers.
    """
    import dask

    if dask.config.get("distributed.worker.multiprocessing-method") != "forkserver":
        return {}

    from distributed.utils import get_mp_context

    get_mp_context()  # distributed sets its preload list on its first call; ours replaces it (before the server starts)
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(FORKSERVER_PRELOAD))
    own = set(dask.config.get("distributed.nanny.pre-spawn-environ") or {}) | set(dask.config.get("distributed.nanny.environ") or {})
    own.add("PYTHONHASHSEED")  # the nanny fixes it before the process starts
    return {"env": {name: value for name, value in os.environ.items() if name not in own}}


def dashboard_address_of(address: str) -> str:
    """``:port`` -> ``127.0.0.1:port``: distributed binds a bare port on all interfaces; we bind this machine only
    unless the user names a host."""
    return f"127.0.0.1{address}" if address.startswith(":") else address


def security_of(config: PlacementSettings) -> Any:
    """``distributed.security.Security`` from ``--tls-*`` (encryption required), else ``None``: distributed's
    config (``distributed.comm.tls.*``, ``DASK_DISTRIBUTED__COMM__TLS__...``) then decides."""
    if config.tls_ca_file is None:
        return None
    from distributed.security import Security

    return Security(
        tls_ca_file=config.tls_ca_file,
        tls_client_cert=config.tls_cert,
        tls_client_key=config.tls_key,
        require_encryption=True,
    )




def cluster_workers(client: Any) -> dict[str, dict[str, Any]]:
    """Every worker of the client's cluster: address -> the scheduler's info on it (``name``, ``resources``, ...).
    All of them: recent distributed releases list only the first 5 unless asked for all (``n_workers=-1``)."""
    if _accepts_n_workers(client):
        return client.scheduler_info(n_workers=-1)["workers"]
    return client.scheduler_info()["workers"]


def _accepts_n_workers(client: Any) -> bool:
    return "n_workers" in inspect.signature(client.scheduler_info).parameters
