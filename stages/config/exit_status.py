"""The exit status of every ``dflash-stages`` command and the one ``error:`` line of status 2.

Exit status, the same for every command (:class:`ExitCode`; :data:`EXIT_STATUS_HELP` prints it at the end of
``dflash-stages --help``):

* 0 -- success.
* 1 -- the thing a command checks is bad: ``cache verify`` found corrupt or uncommitted shards, ``inspect`` found a
  failed check, ``diff`` a config or environment difference, ``scan`` NaN/Inf/extreme values,
  ``evaluate``'s lossless check failed, a ``sweep`` run failed.
* 2 -- bad input, usage or configuration the user must fix (an ``error:`` line names it; no traceback); also what
  the machine refuses (a full disk or quota, permission denied, a read-only filesystem, an I/O error, interrupted
  I/O: :func:`os_error_message` names the path and the fix) and truncated or foreign files.
* 3 -- an unexpected error, i.e. a bug (the traceback is printed).
* 130 -- interrupted by Ctrl-C or SIGTERM, after cleanup (``train`` saves a checkpoint first; ``--resume`` continues).

Kept apart from ``stages.cli`` (which wires the commands) so that a stage reports its status without importing
the whole command line, and so the scheme is declared once: ``stages.cli.main`` maps exceptions onto it, each
command raises ``typer.Exit(ExitCode.X)`` for its own verdicts.
"""

from __future__ import annotations

import enum
import errno
import os

from dflash.errors import DFlashError

__all__ = ["ExitCode", "EXIT_STATUS_HELP", "USER_ERRNOS", "is_user_error", "os_error_message", "print_error",
           "user_error_message"]


class ExitCode(enum.IntEnum):
    """Exit status of every ``dflash-stages`` command (module docstring)."""

    OK = 0
    CHECK_FAILED = 1
    USAGE = 2
    INTERNAL = 3
    INTERRUPTED = 130


def print_error(error: BaseException | str, console: object = None) -> None:
    """The one ``error:`` line of exit status 2: the message as plain text (no markup parsing), on one line where it
    fits (soft wrap keeps paths copy-pasteable); to stderr unless a rich ``console`` is given."""
    from rich.console import Console
    from rich.text import Text

    (console or Console(stderr=True)).print(Text("error: ", style="bold red") + Text(str(error)), soft_wrap=True)


#: errno values of an ``OSError`` that are the machine's answer to what the user asked (exit 2, one line), with the
#: fix; any other ``OSError`` is treated as a bug (exit 3).
USER_ERRNOS: dict[int, str] = {
    errno.ENOSPC: "free space there (or write elsewhere) and rerun the same command; committed work is kept",
    errno.EDQUOT: "raise the quota or free space there and rerun the same command; committed work is kept",
    errno.EACCES: "give this user access to it, or choose another path",
    errno.EPERM: "give this user access to it, or choose another path",
    errno.EROFS: "the filesystem is mounted read-only: choose a writable path",
    errno.EIO: "the storage reported an I/O error: check the device or mount, then rerun the same command",
    errno.EINTR: "the I/O was interrupted: rerun the same command",
    errno.ENOTDIR: "a folder was expected there but a file is in the way: move it or choose another path",
    errno.EISDIR: "a file was expected there but it is a folder: choose another path",
    errno.EEXIST: "something is already there: move it or choose another path",
    errno.ENOENT: "check the path",
}


def is_user_error(error: BaseException) -> bool:
    """Whether ``error`` is the user's to fix (exit status 2, one ``error:`` line): a ``DFlashError``, or an
    ``OSError`` whose errno is in :data:`USER_ERRNOS`. Anything else is a bug (exit 3, traceback)."""
    return isinstance(error, DFlashError) or (isinstance(error, OSError) and error.errno in USER_ERRNOS)


def user_error_message(error: BaseException) -> str:
    """The ``error:`` line's text for a user's error (:func:`is_user_error`): a ``DFlashError``'s own message, an
    ``OSError``'s :func:`os_error_message`."""
    if isinstance(error, OSError) and not isinstance(error, DFlashError):
        return os_error_message(error)
    return str(error)


def os_error_message(error: OSError) -> str:
    """One line for an ``OSError`` of :data:`USER_ERRNOS`: what the OS said, the path(s) and the fix."""
    paths = [os.fspath(p) for p in (error.filename, error.filename2) if p is not None]
    where = " -> ".join(paths) if paths else "a path the OS did not name (see the command's output for the folder)"
    name = errno.errorcode.get(error.errno or 0, str(error.errno))
    return f"{error.strerror or error} ({name}) at {where}; {USER_ERRNOS.get(error.errno or 0, 'check the path')}"


#: Help epilog (rich markup, one line per code); README.md "Exit status" says the same.
EXIT_STATUS_HELP = "\n".join([
    "[bold]Exit status[/] (every command):",
    "  [bold]0[/]    success",
    "  [bold]1[/]    the checked thing is bad: cache verify found corrupt or uncommitted shards; inspect a failed check;",
    "       diff a difference; scan NaN/Inf/extremes; evaluate's lossless check failed; a sweep run failed",
    "  [bold]2[/]    bad input, usage or configuration to fix, a full disk, permission denied, a truncated file",
    "       (one error: line names the path and the fix)",
    "  [bold]3[/]    unexpected error, i.e. a bug (traceback printed)",
    "  [bold]130[/]  interrupted by Ctrl-C or SIGTERM, after cleanup (train saves a checkpoint first; --resume continues)",
])
