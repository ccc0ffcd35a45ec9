"""The one error hierarchy of dflash-stages.

Every error raised for a user's input derives from :class:`DFlashError` and also from the matching builtin
(``ValueError``, ``FileNotFoundError``...), so callers can catch either. Messages name the value, the path (file,
row, sample, shard), what was expected against what was found, and the fix. Internal invariants use ``assert``.
Follows the layout of zarr-python's ``errors.py``.
"""

from __future__ import annotations

__all__ = [
    "DFlashError",
    "ConfigError",
    "CorpusError",
    "CacheError",
    "CacheCorruptError",
    "CheckpointError",
    "TargetError",
    "MismatchError",
    "ExportError",
    "GenerationError",
    "LockError",
    "ProducerError",
    "ConfigPathNotFoundError",
    "CorpusNotFoundError",
    "CacheNotFoundError",
    "CheckpointNotFoundError",
    "TargetNotFoundError",
]


class DFlashError(Exception):
    """Root of every error raised by dflash-stages."""

    def __reduce__(self) -> tuple:
        # Pickled as its class, arguments and attributes, so that it crosses processes (a Dask task's value or
        # error) whatever reducer a library registered for exception classes: tblib's, which dask.distributed
        # installs, rebuilds an error through its builtin base's __new__, and that refuses a class that is also
        # an OSError (the *NotFoundError family below).
        return type(self), self.args, self.__dict__ or None


class ConfigError(DFlashError, ValueError):
    """A configuration field has an invalid value. The message names the field."""


class CorpusError(DFlashError, ValueError):
    """The corpus (contract 1) is malformed. The message names the file and row."""


class TargetError(DFlashError, ValueError):
    """The target model or tokenizer cannot be located or loaded."""


class CacheError(DFlashError, ValueError):
    """The hidden-state cache (contract 2) is missing, incomplete or inconsistent."""


class CacheCorruptError(CacheError):
    """A committed shard of the cache fails its checksum or completeness check. The message names the shard."""


class CheckpointError(DFlashError, ValueError):
    """A run folder or checkpoint is missing, partial or does not match the config."""


class MismatchError(DFlashError, ValueError):
    """Two artefacts that must agree (cache vs drafter config, checkpoint vs target...) differ.

    The message names the field, both values and the fix.
    """


class ExportError(DFlashError, ValueError):
    """An export in the serving format cannot be written or fails to load back."""


class GenerationError(DFlashError, RuntimeError):
    """Generating responses failed for a reason the user must fix (an endpoint down, a model that is not the
    target). The message names the endpoint or model and the fix."""


class LockError(DFlashError, RuntimeError):
    """An output (cache, run folder, corpus, export, sweep) is being written by another process.

    The message names the output, the holder (pid, host, since when, command), the lock file and the fix
    (``dflash.io.locks``). A ``RuntimeError``, not an ``OSError``: the stages' ``except OSError`` handlers for I/O
    failures must not swallow it.
    """


class ProducerError(DFlashError, RuntimeError):
    """An online run lost a producer (a target replica's process died) and stopped, by its policy
    (``on_producer_death``). The message names the batch and says how to continue (``--resume``)."""


# "Does not exist" errors: each is its family's error AND a ``FileNotFoundError`` (an ``OSError``), so a caller can
# catch either. The CLI maps every DFlashError to exit 2 before it looks at OSErrors.


class ConfigPathNotFoundError(ConfigError, FileNotFoundError):
    """A file or folder a setting names does not exist (``--config`` file, preset file, prompts file, TLS file,
    the run folder of ``--resume``). The message names the setting and the path."""


class CorpusNotFoundError(CorpusError, FileNotFoundError):
    """The corpus (or a data file it lists, or a ``prepare`` input) does not exist. The message names the path."""


class CacheNotFoundError(CacheError, FileNotFoundError):
    """No hidden-state cache at the given path. The message says what is there instead."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The run, checkpoint or export folder does not exist. The message names the path."""


class TargetNotFoundError(TargetError, FileNotFoundError):
    """The target path does not exist (model hubs are never contacted). The message names the spec."""
