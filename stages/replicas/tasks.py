"""The user's errors of a Dask task travel back as its value, not as a failed task.

A task that raises makes its Dask worker log "Compute Failed" with the task's traceback before the client sees the
error, and the worker of a local cluster writes to the command's own stderr: a full disk or a bad corpus row would
reach the user as a worker traceback followed by the ``error:`` line. So a task of the target replicas (``extract``,
``generate``, ``online``'s producers) is wrapped by :func:`returns_user_errors`: an error the user must fix
(:func:`stages.config.exit_status.is_user_error`: a ``DFlashError``, or an ``OSError`` the machine gave such as a full
disk or permission denied) is returned as a :class:`UserError`, and the client raises it with :func:`task_result`
(or looks at it with :func:`user_error_of`, as ``extract`` does to stop its shards and keep the committed ones). Any
other exception (a bug, an ``OSError`` of another errno, a worker that dies) still fails the task, so Dask's own
handling of it is unchanged: retries, ``KilledWorker``, the logged traceback.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from stages.config.exit_status import is_user_error

__all__ = ["UserError", "returns_user_errors", "user_error_of", "task_result"]

Result = TypeVar("Result")


@dataclass(frozen=True, slots=True)
class UserError:
    """What a task wrapped by :func:`returns_user_errors` returns instead of raising ``error``."""

    error: BaseException


def returns_user_errors(task: Callable[..., Result]) -> Callable[..., Result | UserError]:
    """Decorator of a Dask task function: a user's error it raises is returned as a :class:`UserError`; any other
    exception propagates."""

    @functools.wraps(task)
    def run(*args: Any, **kwargs: Any) -> Result | UserError:
        try:
            return task(*args, **kwargs)
        except Exception as error:
            if not is_user_error(error):
                raise
            return UserError(error)

    return run


def user_error_of(value: Any) -> BaseException | None:
    """The user's error a task returned (:func:`returns_user_errors`), else ``None``."""
    return value.error if isinstance(value, UserError) else None


def task_result(future: Any, timeout: float | None = None) -> Any:
    """``future.result(timeout)``, raising the user's error the task returned instead of a result."""
    value = future.result(timeout=timeout)
    error = user_error_of(value)
    if error is not None:
        raise error
    return value
