"""The one Dask worker lifecycle of every target replica (``extract``, ``generate``, the ``online`` producers).

:class:`TargetReplicaPlugin` follows dask/distributed's ``diagnostics/plugin.py`` WorkerPlugin lifecycle: ``setup``
ties the worker's life to its spawning process (locally started clusters), sets its CPU threads, pins its GPU
(``gpu_by_worker`` from ``--target-gpus``) and loads the target once; subclasses build what their tasks use on top
of the loaded target in :meth:`build` and free it in :meth:`release`. Tasks stay pure: a spec in, a small result out.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import time
from typing import Any

import torch
from distributed import WorkerPlugin

from dflash.target.load import LoadedTarget, load_target

__all__ = ["TargetReplicaPlugin", "die_with_parent"]

log = logging.getLogger(__name__)


def die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this worker when the process that spawned it dies, so a killed driver
    never leaves an orphan still writing output that the next run will redo."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() == 1:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)


class TargetReplicaPlugin(WorkerPlugin):
    """Loads the target once per Dask worker and hands it to :meth:`build`.

    Args:
        target_spec: ``"default"``, a transformers folder or a ``.gguf`` file (see ``dflash.target.load``).
        gpu_by_worker: worker name -> physical GPU index; the worker pins it with ``torch.cuda.set_device``.
            ``None``: ``device``.
        device: ``"cuda"`` (the worker's current GPU), ``"cpu"`` or ``"auto"`` (CUDA when present).
        torch_threads: intra-op CPU threads per worker (CPU workers); ``None`` leaves torch's default.
        die_with_parent: SIGKILL the worker when its spawning process dies (locally started clusters only).
        dtype: ``load_target``'s dtype (``None``: its default per device).
    """

    idempotent = False

    def __init__(self, *, target_spec: str, gpu_by_worker: dict[Any, int] | None = None, device: str = "auto",
                 torch_threads: int | None = None, die_with_parent: bool = False, dtype: Any = None) -> None:
        self.target_spec = target_spec
        self.gpu_by_worker = dict(gpu_by_worker or {})
        self.device = device
        self.torch_threads = torch_threads
        self.die_with_parent = die_with_parent
        self.dtype = dtype

    def pick_device(self, worker: Any) -> torch.device:
        gpu = self.gpu_by_worker.get(worker.name, self.gpu_by_worker.get(str(worker.name)))
        if gpu is not None:
            torch.cuda.set_device(gpu)
            return torch.device("cuda", gpu)
        if self.device == "cuda" or (self.device == "auto" and torch.cuda.is_available()):
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def setup(self, worker: Any) -> None:
        if self.die_with_parent:
            die_with_parent()
        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)
        device = self.pick_device(worker)
        started = time.perf_counter()
        kwargs = {"dtype": self.dtype} if self.dtype is not None else {}
        loaded = load_target(self.target_spec, device=device, **kwargs)
        self.build(loaded, device)
        log.info("worker %s: target %s on %s in %.1f s", worker.name, self.target_spec, device, time.perf_counter() - started)

    def build(self, loaded: LoadedTarget, device: torch.device) -> None:
        """Make what this stage's tasks use from the loaded target (subclasses)."""
        raise NotImplementedError

    def release(self) -> torch.device | None:
        """Free what :meth:`build` made; returns its device (subclasses)."""
        raise NotImplementedError

    def teardown(self, worker: Any) -> None:
        device = self.release()
        if device is not None and device.type == "cuda":
            torch.cuda.empty_cache()
