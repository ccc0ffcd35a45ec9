"""Run folders and checkpoints (docs/architecture.md, "Contracts": the run folder): consistent snapshots written in the background.

Layout of a run folder::

    RUN/run.json                      resolved config + environment (written at start, atomically)
    RUN/metrics.jsonl, RUN/tb/        telemetry (dflash.training.telemetry)
    RUN/checkpoints/step_00000100/    one checkpoint (below)
    RUN/latest                        text: the newest complete checkpoint's folder name (written last)
    RUN/best, RUN/best.json           the checkpoint with the lowest validation loss, and that loss

A checkpoint folder holds ``model.safetensors`` (drafter parameters under their serving names, fp32, no
embedding / LM head), ``drafter_config.json`` (``DFlashConfig.to_dict()``), ``target.json`` (target identity,
``target_spec``, embedding/LM-head hashes), ``optimizer.safetensors`` (the optimizer's state), ``trainer_state.json``
(step, epoch, data cursor, scheduler, counters, resolved config) and ``rng.safetensors`` (torch/CUDA/numpy/python
generator states). Nothing is pickled: the two state files are safetensors with their structure as JSON metadata
(:mod:`dflash.training.state_files`), so loading a checkpoint, anyone's, cannot execute code.

Consistency: :meth:`Checkpointer.save` copies every tensor to host memory synchronously, between two optimizer
steps, so a checkpoint never mixes weights of two steps; the copy of a CUDA state goes into pinned buffers reused
from one save to the next (fast: no allocation, DMA transfers). Writing the files happens on a single background
thread (``concurrent.futures``), into ``checkpoints/.tmp-<name>-<pid>`` renamed to its final name when complete;
``latest`` is replaced atomically after the rename, so readers never see a partial checkpoint. The training loop
only stalls for the host copy, and for a previous write that is still running when the next save is due.
Retention keeps the last ``keep_last`` checkpoints plus the best by validation loss.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import platform
import random
import shutil
import shutil as _shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dflash.drafter.model import tensor_hash
from dflash.errors import CheckpointError, CheckpointNotFoundError, MismatchError
from dflash.faults import fault_point
from dflash.io.files import (  # atomic_write_text re-exported: callers import it from here too
    atomic_write_text,
    load_json,
    read_bounded,
)
from dflash.io.weights import load_safetensors, save_safetensors
from dflash.training.state_files import load_state_tree, save_state_tree

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = [
    "CHECKPOINT_FORMAT_VERSION",
    "OPTIMIZER_FILE",
    "PARAM_NAMES_KEY",
    "RNG_FILE",
    "TrainingSnapshot",
    "LoadedCheckpoint",
    "Checkpointer",
    "atomic_write_text",
    "capture_rng_state",
    "restore_rng_state",
    "collect_environment",
    "code_version",
    "CODE_DIR",
    "BEHAVIOUR_ENV_PREFIXES",
    "optimizer_param_names",
    "write_run_json",
    "resolve_checkpoint",
    "load_checkpoint",
    "read_best_record",
    "read_latest",
    "read_run_record",
    "read_trainer_state",
    "target_weight_record",
    "check_target_weights",
]

#: Recorded in ``trainer_state.json``; a checkpoint of a newer format is refused.
CHECKPOINT_FORMAT_VERSION = 2
OPTIMIZER_FILE = "optimizer.safetensors"
RNG_FILE = "rng.safetensors"
#: Metadata key of ``optimizer.safetensors``: JSON list, the parameter name of each optimizer parameter index.
PARAM_NAMES_KEY = "dflash_param_names"
_CHECKPOINT_PREFIX = "step_"
_REQUIRED_FILES = ("model.safetensors", "drafter_config.json", "target.json", "trainer_state.json")


def _to_host(tree: Any, pinned: dict[str, torch.Tensor] | None = None, prefix: str = "") -> Any:
    """Deep copy of a nest of dicts/lists/tensors with every tensor copied to host memory.

    CPU tensors are cloned. CUDA tensors are copied into pinned buffers kept in ``pinned`` (keyed by their path
    in the tree) and reused across calls with the same shapes; the caller synchronizes once afterwards.
    """
    if isinstance(tree, torch.Tensor):
        tensor = tree.detach()
        if tensor.device.type == "cpu":
            return tensor.clone()
        if pinned is None:
            return tensor.to("cpu", copy=True)
        buffer = pinned.get(prefix)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            pinned[prefix] = buffer
        buffer.copy_(tensor, non_blocking=True)
        return buffer
    if isinstance(tree, dict):
        return {key: _to_host(value, pinned, f"{prefix}/{key}") for key, value in tree.items()}
    if isinstance(tree, list | tuple):
        copied = [_to_host(value, pinned, f"{prefix}/{index}") for index, value in enumerate(tree)]
        return type(tree)(copied) if isinstance(tree, tuple) else copied
    return tree


def capture_rng_state(**generators: torch.Generator) -> dict[str, Any]:
    """States of the global torch CPU/CUDA, numpy and python generators, plus any named ``generators``."""
    import numpy as np

    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
        "generators": {name: generator.get_state() for name, generator in generators.items()},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Mapping[str, Any], **generators: torch.Generator) -> None:
    """Inverse of :func:`capture_rng_state` (CUDA states only when CUDA is in use here too)."""
    import numpy as np

    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    for name, generator in generators.items():
        if name in state.get("generators", {}):
            generator.set_state(state["generators"][name])


#: The code whose version ``collect_environment`` records (this package's git checkout).
CODE_DIR = Path(__file__).resolve().parent
#: Prefixes of the environment variables that change what a run does or how fast (recorded in ``run.json``).
BEHAVIOUR_ENV_PREFIXES = ("DFLASH_", "OMP_", "MKL_", "CUDA_", "NCCL_", "TORCH_", "PYTORCH_")


#: Untracked files up to this size are hashed by content into ``git_diff_sha256``; larger ones by name and size.
_HASHED_UNTRACKED_BYTES = 1 << 20


def _run(command: list[str], cwd: Path | None = None) -> str | None:
    """Stdout of a short command, or None when it is missing, fails or hangs."""
    try:
        result = subprocess.run(command, cwd=cwd, capture_output=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.decode(errors="replace") if result.returncode == 0 else None


def code_version(code_dir: Path | None = None) -> dict[str, Any]:
    """Git state of the code: commit, whether the working tree differs from it, a hash of ``git diff HEAD`` and the
    untracked files (so two runs of the same commit with different edits are told apart). ``None`` values outside
    a git checkout."""
    top = (_run(["git", "rev-parse", "--show-toplevel"], code_dir or CODE_DIR) or "").strip()
    code_dir = Path(top) if top else (code_dir or CODE_DIR)  # the whole checkout, not only this package's folder
    commit = (_run(["git", "rev-parse", "HEAD"], code_dir) or "").strip() or None
    if commit is None:
        return {"git_commit": None, "git_dirty": None, "git_diff_sha256": None, "git_untracked": None}
    diff = _run(["git", "diff", "HEAD", "--binary"], code_dir) or ""
    untracked = sorted((_run(["git", "ls-files", "--others", "--exclude-standard"], code_dir) or "").split())
    digest = hashlib.sha256(diff.encode())
    for name in untracked:  # content of small files (new source files); name and size of big ones (data left lying)
        digest.update(name.encode())
        with contextlib.suppress(OSError):
            path = code_dir / name
            size = path.stat().st_size
            digest.update(path.read_bytes() if size <= _HASHED_UNTRACKED_BYTES else str(size).encode())
    dirty = bool(diff) or bool(untracked)
    return {"git_commit": commit, "git_dirty": dirty, "git_diff_sha256": digest.hexdigest() if dirty else None,
            "git_untracked": len(untracked)}


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _gpu_driver() -> str | None:
    if _shutil.which("nvidia-smi") is None:
        return None
    output = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return output.splitlines()[0].strip() if output and output.strip() else None


def collect_environment() -> dict[str, Any]:
    """What produced a run, all that can make two runs of one config differ in speed or result: host, CPU model
    and core/thread counts, Python, library versions (torch with its CUDA build, triton, flash-attn), GPUs and
    driver, the behaviour-changing environment variables (:data:`BEHAVIOUR_ENV_PREFIXES`), the code version
    (:func:`code_version`) and the command line."""
    versions = {}
    for package in ("torch", "triton", "flash-attn", "flash-attn-4", "transformers", "safetensors", "zarr",
                    "numcodecs", "numpy", "dflash-stages"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    devices = []
    if torch.cuda.is_available():
        devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "versions": versions,
        "cuda": torch.version.cuda,
        "cuda_devices": devices,
        "cuda_device_count": len(devices),
        "gpu_driver": _gpu_driver() if devices else None,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": affinity,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "env": {name: value for name, value in sorted(os.environ.items()) if name.startswith(BEHAVIOUR_ENV_PREFIXES)},
        **code_version(),
        "argv": list(sys.argv),
    }


def write_run_json(run_dir: str | Path, config: Mapping[str, Any], environment: Mapping[str, Any], **extra: Any) -> Path:
    """Write ``RUN/run.json`` (resolved config, environment and ``extra`` sections) atomically."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "run.json"
    payload = {"format_version": CHECKPOINT_FORMAT_VERSION, "config": dict(config), "environment": dict(environment)}
    payload.update(extra)
    atomic_write_text(path, json.dumps(payload, indent=2, default=str))
    return path


def optimizer_param_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name in ``model.named_parameters()`` of each parameter index of ``optimizer.state_dict()``.

    ``Optimizer.state_dict()`` numbers the parameters of its param groups consecutively, group after group, in the
    order each group lists them; this walks the same order and names each parameter by identity, so the map is
    exact whatever filtering built the optimizer's list (``dflash.training.optim.build_optimizer`` keeps the parameters
    that require grad, in ``parameters()`` order). A parameter the model does not own is named ``<unnamed N>``.
    """
    names = {id(param): name for name, param in model.named_parameters(remove_duplicate=False)}
    ordered = [param for group in optimizer.param_groups for param in group["params"]]
    return [names.get(id(param), f"<unnamed {index}>") for index, param in enumerate(ordered)]


@dataclass(kw_only=True)
class TrainingSnapshot:
    """Everything a checkpoint holds, as host-memory copies taken at one step.

    Attributes:
        step: optimizer steps completed.
        model_state: drafter parameters (serving names, no embedding / LM head), host tensors.
        optimizer_state: ``optimizer.state_dict()`` with host tensors.
        trainer_state: JSON-serializable: epoch, data cursor, scheduler state, counters, resolved config.
        rng_state: from :func:`capture_rng_state`.
        drafter_config: ``DFlashConfig.to_dict()``.
        target_info: target identity, ``target_spec`` and embedding/LM-head hashes.
        optimizer_param_names: the model's parameter name of each optimizer parameter index (the ``N`` of
            ``state.N.exp_avg``), in ``optimizer.state_dict()`` order; written into ``optimizer.safetensors``'s
            metadata (:data:`PARAM_NAMES_KEY`) so ``scan`` names optimizer state by parameter.
    """

    step: int
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any]
    trainer_state: dict[str, Any]
    rng_state: dict[str, Any]
    drafter_config: dict[str, Any]
    target_info: dict[str, Any]
    optimizer_param_names: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{_CHECKPOINT_PREFIX}{self.step:08d}"


class Checkpointer:
    """Takes consistent snapshots and writes them in the background into ``RUN/checkpoints``.

    Args:
        run_dir: the run folder.
        keep_last: how many most recent checkpoints to keep (the best by validation loss is kept in addition).
        enabled: ``False`` on non-zero data-parallel ranks: nothing is written, snapshots are not even taken.
    """

    def __init__(self, run_dir: str | Path, *, keep_last: int = 3, enabled: bool = True) -> None:
        if keep_last < 1:
            raise CheckpointError(f"keep_last must be >= 1, got {keep_last}")
        self.run_dir = Path(run_dir)
        self.checkpoint_dir = self.run_dir / "checkpoints"
        self.keep_last = keep_last
        self.enabled = enabled
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self._pending: Future[Path] | None = None
        self._pinned: dict[str, torch.Tensor] = {}
        self._best: dict[str, Any] | None = None
        #: Seconds the last completed background write took (None before the first).
        self.last_write_seconds: float | None = None
        best_json = self.run_dir / "best.json"
        if best_json.is_file():
            self._best = read_best_record(self.run_dir)
        if enabled:  # leftovers of a writer killed mid-write never count; the one writer of this run clears them
            for leftover in [*self.checkpoint_dir.glob(".tmp-*"), *self.checkpoint_dir.glob(".old-*")]:
                shutil.rmtree(leftover, ignore_errors=True)
            for leftover in self.run_dir.glob(".*.tmp-*"):
                leftover.unlink(missing_ok=True)

    @property
    def best(self) -> dict[str, Any] | None:
        """``{"checkpoint", "step", "val_loss"}`` of the best checkpoint so far (None without validation)."""
        return None if self._best is None else dict(self._best)

    # -- snapshot (synchronous, between steps) -------------------------------------------------------------
    def snapshot(
        self,
        *,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        trainer_state: Mapping[str, Any],
        rng_state: Mapping[str, Any],
        drafter_config: Mapping[str, Any],
        target_info: Mapping[str, Any],
    ) -> TrainingSnapshot:
        """Copy the training state to host memory now (waits for a previous write still using the buffers)."""
        self.wait()
        model_state = {name: param for name, param in model.state_dict().items()}
        on_cuda = any(t.is_cuda for t in model_state.values())
        pinned = self._pinned if on_cuda else None
        snapshot = TrainingSnapshot(
            step=int(step),
            model_state=_to_host(model_state, pinned, "model"),
            optimizer_state=_to_host(optimizer.state_dict(), pinned, "optimizer"),
            trainer_state=json.loads(json.dumps(trainer_state)),  # deep copy, and proof it is JSON-serializable
            rng_state=_to_host(dict(rng_state)),
            drafter_config=json.loads(json.dumps(drafter_config)),
            target_info=json.loads(json.dumps(target_info)),
            optimizer_param_names=optimizer_param_names(model, optimizer),
        )
        if on_cuda:
            torch.cuda.synchronize()
        return snapshot

    def save(self, snapshot: TrainingSnapshot) -> Future[Path] | None:
        """Write ``snapshot`` in the background; returns the future of its final folder (None when disabled)."""
        if not self.enabled:
            return None
        self.wait()
        self._pending = self._executor.submit(self._write, snapshot)
        return self._pending

    def report_validation(self, step: int, val_loss: float) -> None:
        """Record the validation loss of the checkpoint of ``step`` (after its write); updates ``best``."""
        if not self.enabled:
            return
        # Chained to the write before it, so that wait() still re-raises that write's error (a full disk at the
        # last checkpoint would otherwise pass unnoticed behind this update).
        self._pending = self._executor.submit(self._update_best, int(step), float(val_loss), self._pending)

    def wait(self) -> None:
        """Block until queued writes are done; re-raises a write's error."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def close(self) -> None:
        """Finish pending writes and stop the writer thread."""
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)

    # -- background side ------------------------------------------------------------------------------------
    def _write(self, snapshot: TrainingSnapshot) -> Path:
        started = time.perf_counter()
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        final = self.checkpoint_dir / snapshot.name
        staging = self.checkpoint_dir / f".tmp-{snapshot.name}-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        try:
            save_safetensors(
                {name: t.contiguous() for name, t in snapshot.model_state.items()},
                staging / "model.safetensors",
                metadata={"format": "pt", "step": str(snapshot.step)},
            )
            fault_point("checkpoint.write", staging / OPTIMIZER_FILE)
            save_state_tree(snapshot.optimizer_state, staging / OPTIMIZER_FILE, metadata={
                "step": str(snapshot.step), PARAM_NAMES_KEY: json.dumps(snapshot.optimizer_param_names)})
            save_state_tree(snapshot.rng_state, staging / RNG_FILE, metadata={"step": str(snapshot.step)})
            trainer_state = {"format_version": CHECKPOINT_FORMAT_VERSION, "step": snapshot.step, **snapshot.trainer_state}
            (staging / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2))
            (staging / "drafter_config.json").write_text(json.dumps(snapshot.drafter_config, indent=2))
            (staging / "target.json").write_text(json.dumps(snapshot.target_info, indent=2))
            for path in staging.iterdir():
                path.chmod(0o644)  # safetensors creates 0600 files; runs are read by other users and tools
                with open(path, "rb") as handle:
                    os.fsync(handle.fileno())
            if final.exists():  # the same step saved again (e.g. after a resume): replace it whole
                trash = self.checkpoint_dir / f".old-{snapshot.name}-{os.getpid()}"
                shutil.rmtree(trash, ignore_errors=True)
                final.rename(trash)
                shutil.rmtree(trash, ignore_errors=True)
            staging.rename(final)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        atomic_write_text(self.run_dir / "latest", snapshot.name + "\n")
        self._apply_retention()
        self.last_write_seconds = time.perf_counter() - started
        return final

    def _update_best(self, step: int, val_loss: float, previous: Future | None = None) -> None:
        if previous is not None:
            previous.result()  # done (one writer thread); re-raises its error
        name = f"{_CHECKPOINT_PREFIX}{step:08d}"
        if not (self.checkpoint_dir / name).is_dir():
            return  # validation at a step without checkpoint: logged by the caller, nothing to point at
        if self._best is not None and not val_loss < self._best["val_loss"]:
            return
        self._best = {"checkpoint": name, "step": step, "val_loss": val_loss}
        atomic_write_text(self.run_dir / "best.json", json.dumps(self._best, indent=2))
        atomic_write_text(self.run_dir / "best", name + "\n")
        self._apply_retention()

    def _apply_retention(self) -> None:
        checkpoints = sorted(p for p in self.checkpoint_dir.glob(f"{_CHECKPOINT_PREFIX}*") if p.is_dir())
        keep = {p.name for p in checkpoints[-self.keep_last :]}
        if self._best is not None:
            keep.add(self._best["checkpoint"])
        for path in checkpoints:
            if path.name not in keep:
                shutil.rmtree(path, ignore_errors=True)


# -- reading -------------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class LoadedCheckpoint:
    """A checkpoint read back from disk (see :class:`TrainingSnapshot` for the fields)."""

    path: Path
    step: int
    model_state: dict[str, torch.Tensor]
    trainer_state: dict[str, Any]
    drafter_config: dict[str, Any]
    target_info: dict[str, Any]
    optimizer_state: dict[str, Any] | None = None
    rng_state: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


#: The fix of a damaged JSON record of a checkpoint or run folder.
_DAMAGED = ("the file is damaged or was edited: restore it, resume from another checkpoint (write its folder name "
            "into RUN/latest), or start a new run")

#: Fields of ``trainer_state.json`` a resume reads, with their types (``step`` is required).
_TRAINER_STATE_TYPES: dict[str, type | tuple[type, ...]] = {
    "step": int, "format_version": int, "world_size": int, "epoch": (int, float), "config": dict, "scheduler": dict,
    "data": dict, "buckets": dict, "counters": dict,
}


def _checked_fields(path: Path, record: dict[str, Any], types: dict[str, type | tuple[type, ...]],
                    required: tuple[str, ...] = ()) -> dict[str, Any]:
    """``record`` after checking the type of each field of ``types`` it holds (integers >= 0, never a bool).

    Raises:
        CheckpointError: a required field missing or a field of the wrong type, naming the file and the key.
    """
    for key, kind in types.items():
        if key not in record:
            if key in required:
                raise CheckpointError(f"{path}: no '{key}' field; {_DAMAGED}")
            continue
        value = record[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if (not isinstance(value, kinds) or isinstance(value, bool)
                or (isinstance(value, int) and int in kinds and value < 0)):
            expected = " or ".join({"int": "an integer >= 0", "float": "a number", "dict": "an object",
                                    "str": "a string"}[k.__name__] for k in kinds)
            raise CheckpointError(f"{path}: '{key}' is {json.dumps(value)[:40]}, expected {expected}; {_DAMAGED}")
    return record


def read_trainer_state(folder: Path) -> dict[str, Any]:
    """A checkpoint's ``trainer_state.json`` (``dflash.io.files.load_json``), its resume fields type-checked.

    Raises:
        CheckpointError: unreadable, not JSON, not an object, or a field of the wrong type; naming the file and key.
        OSError: from the filesystem.
    """
    path = Path(folder) / "trainer_state.json"
    return _checked_fields(path, load_json(path, error=CheckpointError, fix=_DAMAGED), _TRAINER_STATE_TYPES,
                           required=("step",))


def read_run_record(run_dir: Path) -> dict[str, Any]:
    """A run folder's ``run.json`` (``dflash.io.files.load_json``); ``config`` and ``resolved`` checked to be objects.

    Raises:
        CheckpointError: unreadable, not JSON, not an object, or those fields not objects; naming the file.
        OSError: from the filesystem.
    """
    path = Path(run_dir) / "run.json"
    return _checked_fields(path, load_json(path, error=CheckpointError, fix=_DAMAGED),
                           {"config": dict, "resolved": dict})


def read_best_record(run_dir: Path) -> dict[str, Any]:
    """A run folder's ``best.json``: ``checkpoint`` (a name), ``step`` and ``val_loss`` checked.

    Raises:
        CheckpointError: unreadable or a field missing or of the wrong type; naming the file and key.
    """
    path = Path(run_dir) / "best.json"
    return _checked_fields(path, load_json(path, error=CheckpointError, fix=_DAMAGED),
                           {"checkpoint": str, "step": int, "val_loss": (int, float)},
                           required=("checkpoint", "step", "val_loss"))


def read_latest(run_dir: Path) -> str:
    """The checkpoint name in a run folder's ``latest`` file (``dflash.io.files.read_bounded``: a regular file of at
    most 4 KiB).

    Raises:
        CheckpointError: not a regular file, too large or not text; naming the file. OSError: from the filesystem.
    """
    path = Path(run_dir) / "latest"
    try:
        return read_bounded(path, limit=4096, error=CheckpointError, fix=_DAMAGED).decode().strip()
    except UnicodeDecodeError:
        raise CheckpointError(f"{path}: not text; {_DAMAGED}") from None



def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder from a run folder (follows ``latest``), a checkpoint folder, or ``RUN/best``-style names.

    Raises:
        CheckpointError: nothing complete at ``path``; names the missing file and the fix.
    """
    path = Path(path)
    if (path / "latest").is_file():
        name = read_latest(path)
        candidate = path / "checkpoints" / name
        if not candidate.is_dir():
            raise CheckpointError(
                f"{path / 'latest'} points at {name}, but {candidate} does not exist; the run folder was edited by "
                "hand or the checkpoint deleted: point at an existing checkpoint folder under checkpoints/"
            )
        path = candidate
    elif (path / "run.json").is_file() and not (path / "model.safetensors").is_file():
        raise CheckpointError(f"run folder {path} has no checkpoint yet (no 'latest' file); train it first")
    if not path.is_dir():
        error = CheckpointNotFoundError if not path.exists() else CheckpointError
        raise error(f"{path} is not a folder; pass a run folder, a checkpoint folder or an export folder")
    missing = [name for name in _REQUIRED_FILES if not (path / name).is_file()]
    if missing:
        raise CheckpointError(
            f"{path} is not a complete checkpoint: missing {', '.join(missing)}; pass a run folder (RUN), a "
            "checkpoint folder (RUN/checkpoints/step_XXXXXXXX) or an exported serving folder"
        )
    return path


def load_checkpoint(path: str | Path, *, with_training_state: bool = True) -> LoadedCheckpoint:
    """Read a checkpoint (a run folder resolves to its ``latest``); tensors on CPU.

    Args:
        with_training_state: also read the optimizer and RNG states (needed to resume, not to evaluate):
            ``optimizer.safetensors`` and ``rng.safetensors`` (:func:`dflash.training.state_files.load_state_tree`).

    Raises:
        CheckpointError: missing, truncated or unreadable files (named), a state file that would need code to load
            or that holds no optimizer / RNG state the run could restore, or a newer format version.
    """
    folder = resolve_checkpoint(path)
    try:
        trainer_state = read_trainer_state(folder)
        loaded = LoadedCheckpoint(
            path=folder,
            step=int(trainer_state["step"]),
            model_state=load_safetensors(folder / "model.safetensors"),
            trainer_state=trainer_state,
            drafter_config=load_json(folder / "drafter_config.json", error=CheckpointError, fix=_DAMAGED),
            target_info=load_json(folder / "target.json", error=CheckpointError, fix=_DAMAGED),
        )
        if with_training_state:
            loaded.optimizer_state = _load_training_state(folder, OPTIMIZER_FILE)
            _check_optimizer_state(loaded.optimizer_state, folder)
            loaded.rng_state = _load_training_state(folder, RNG_FILE)
            _check_rng_state(loaded.rng_state, folder)
    except CheckpointError:
        raise
    except (OSError, KeyError, json.JSONDecodeError, RuntimeError) as error:
        raise CheckpointError(f"cannot read checkpoint {folder}: {error}; the folder is damaged, use another") from error
    version = trainer_state.get("format_version", 0)
    if version > CHECKPOINT_FORMAT_VERSION:
        raise CheckpointError(
            f"{folder} has checkpoint format {version}, newer than this code's {CHECKPOINT_FORMAT_VERSION}; "
            "upgrade dflash-stages"
        )
    return loaded


def _load_training_state(folder: Path, name: str) -> Any:
    """The state file ``name`` of ``folder`` (:func:`dflash.training.state_files.load_state_tree`)."""
    if (folder / name).is_file():
        return load_state_tree(folder / name)
    raise CheckpointError(
        f"{folder} has no {name}: the checkpoint cannot be resumed; "
        "resume from another checkpoint, or evaluate/export it (they need only the weights)"
    )


def _check_optimizer_state(state: Any, folder: Path) -> None:
    """An optimizer state has the two parts ``Optimizer.load_state_dict`` reads.

    Raises:
        CheckpointError: naming the file.
    """
    if not (isinstance(state, dict) and isinstance(state.get("state"), dict)
            and isinstance(state.get("param_groups"), list)):
        raise CheckpointError(
            f"{folder / OPTIMIZER_FILE} is not an optimizer state (no 'state' "
            "and 'param_groups'); the file was not written by dflash-stages or was replaced: resume from another "
            "checkpoint"
        )


def _check_rng_state(state: Any, folder: Path) -> None:
    """An RNG state that :func:`restore_rng_state` can restore, tried on throwaway generators (the global ones are
    left alone).

    Raises:
        CheckpointError: naming the file and the part that does not restore.
    """
    import numpy as np

    part = "the whole file (not a mapping)"
    try:
        if not isinstance(state, dict):
            raise TypeError(type(state).__name__)
        part = "torch"
        torch.Generator().set_state(state["torch"])
        part = "numpy"
        np.random.RandomState().set_state(state["numpy"])
        part = "python"
        random.Random().setstate(state["python"])
        part = "generators"
        for name, generator_state in dict(state.get("generators", {})).items():
            part = f"generators.{name}"
            torch.Generator().set_state(generator_state)
        part = "cuda"
        if not all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8 for t in state.get("cuda", [])):
            raise TypeError("not a list of uint8 tensors")
    except Exception as error:  # noqa: BLE001 - each generator rejects a bad state with its own exception type
        raise CheckpointError(
            f"{folder / RNG_FILE}: its '{part}' entry is not a random generator state "
            f"({type(error).__name__}: {str(error).splitlines()[0][:120] if str(error) else '-'}); the file was not "
            "written by dflash-stages or was replaced: resume from another checkpoint"
        ) from None




def target_weight_record(
    embed_weight: torch.Tensor, lm_head_weight: torch.Tensor | None, *, kinds: tuple[str, ...] = ("as_is", "bf16")
) -> dict[str, Any]:
    """What a checkpoint records about the target's shared tensors, to recognise them later.

    ``weight_hashes`` hash the tensors as attached (their dtype); ``weight_hashes_bf16`` hash them rounded to
    bfloat16, so a target loaded in another dtype (fp32 on CPU, bf16 on GPU) is still recognised. A tied LM head
    (``None`` or the embedding itself) is hashed once.
    """
    tied = lm_head_weight is None or lm_head_weight is embed_weight
    record: dict[str, Any] = {"weight_dtype": str(embed_weight.dtype).removeprefix("torch.")}
    for kind in kinds:
        convert = (lambda t: t) if kind == "as_is" else (lambda t: t.to(torch.bfloat16))
        embed_hash = tensor_hash(convert(embed_weight))
        head_hash = embed_hash if tied else tensor_hash(convert(lm_head_weight))
        key = "weight_hashes" if kind == "as_is" else "weight_hashes_bf16"
        record[key] = {"embed_tokens": embed_hash, "lm_head": head_hash}
    return record


def check_target_weights(
    target_info: Mapping[str, Any], embed_weight: torch.Tensor, lm_head_weight: torch.Tensor | None, *, where: str
) -> None:
    """Compare a target's embedding / LM head with those recorded at training time.

    Raises:
        MismatchError: naming ``embed_tokens`` or ``lm_head`` and the target spec to load instead.
    """
    same_dtype = str(embed_weight.dtype).removeprefix("torch.") == target_info.get("weight_dtype")
    key = "weight_hashes" if same_dtype or "weight_hashes_bf16" not in target_info else "weight_hashes_bf16"
    actual = target_weight_record(embed_weight, lm_head_weight, kinds=("as_is" if key == "weight_hashes" else "bf16",))
    for name, value in (target_info.get(key) or {}).items():
        if actual[key].get(name) != value:
            raise MismatchError(
                f"target {name}: the drafter at {where} was trained with {value}, the given target has "
                f"{actual[key].get(name)}; load the target recorded in its target.json "
                f"(target_spec={target_info.get('target_spec')!r})"
            )
