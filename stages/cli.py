"""The ``dflash-stages`` command line (typer + rich).

Each stage module exposes ``register(app: typer.Typer)``, which adds its command(s). This file only wires them;
run ``dflash-stages --help`` for the list.

Exit status: one scheme for every command, declared in :mod:`stages.config.exit_status` (``ExitCode``, printed at the
end of ``dflash-stages --help``); :func:`main` maps exceptions onto it.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import signal
import sys
from typing import Any

import typer
from typer import core

from dflash.errors import ConfigError
from stages.config.exit_status import (
    EXIT_STATUS_HELP,
    USER_ERRNOS,
    ExitCode,
    is_user_error,
    os_error_message,
    print_error,
    user_error_message,
)

__all__ = ["app", "main", "ExitCode", "EXIT_STATUS_HELP", "GLOBAL_FLAGS", "NON_TTY_COLUMNS",
           "PATH_OPTIONS", "USER_ERRNOS", "refuse_empty_paths", "dask_setup", "hoist_global_flags", "print_error", "os_error_message",
           "usage_error_message"]


#: Columns rich lays output out for when stdout is not a terminal and ``$COLUMNS`` is unset (rich's default is 80,
#: which wraps every option description of ``--help | less`` into a narrow column).
NON_TTY_COLUMNS = 120

def _flags_without_type_placeholder() -> None:
    """Render flags as flags in ``--help``: ``--verbose -v  Log debug messages.``, not ``--verbose -v <bool> ...``.

    Newer typer releases (seen with 0.29) print the option's type in the rich help panel for every option,
    flags included (``<bool>`` for ``--help`` and every boolean flag), though a flag takes no value; typer's own
    plain help record already leaves it out for flags. This wraps ``TyperOption.display_type_rich`` to do the
    same in the rich panel: no type for a flag or a count option without an explicit metavar. Typer releases
    without that method (older ones derive the column from click's metavar, which skips flags) are left as is.
    """
    option = getattr(core, "TyperOption", None)
    original = getattr(option, "display_type_rich", None)
    if original is None or getattr(original, "_dflash_flags_plain", False):
        return

    def display_type_rich(self, ctx):
        if self.metavar is None and (getattr(self, "is_flag", False) or getattr(self, "count", False)):
            return None
        return original(self, ctx)

    display_type_rich._dflash_flags_plain = True
    option.display_type_rich = display_type_rich


_flags_without_type_placeholder()

app = typer.Typer(
    name="dflash-stages",
    help="Train DFlash speculative-decoding drafters: prepare -> extract -> train -> evaluate -> export.",
    epilog=EXIT_STATUS_HELP,
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    add_completion=True,  # --install-completion / --show-completion (bash, zsh, fish, PowerShell)
    context_settings={"help_option_names": ["-h", "--help"]},  # inherited by every command and group
)

# Modules whose ``register(app)`` adds commands, in the order ``--help`` lists them.
_COMMAND_MODULES = [
    "pipelines.offline",  # run: the whole offline pipeline on a preset
    "stages.prepare",
    "stages.generate",
    "stages.extract.command",
    "stages.cache_cmd",
    "stages.train.command",
    "pipelines.online",  # online: target replicas feed training through shared memory
    "stages.sweep",
    "stages.evaluate",
    "stages.export",
    "stages.forensics.inspect",
    "stages.forensics.scan",
    "stages.forensics.diff",
    "stages.forensics.report",
]


def _register_all() -> None:
    """Add every stage's commands to :data:`app`, once per process (a second :func:`main` in the same process, as
    the tests run it, would otherwise register each command again: typer keeps them all, and builds them all)."""
    if app.registered_commands:
        return
    for module_name in _COMMAND_MODULES:
        if importlib.util.find_spec(module_name) is None:  # stage not written yet
            continue
        importlib.import_module(module_name).register(app)


def _print_version(value: bool) -> None:
    if value:
        import importlib.metadata

        import torch
        import transformers

        try:
            version = importlib.metadata.version("dflash-stages")
        except importlib.metadata.PackageNotFoundError:  # run from a source tree without an install
            version = "not installed"
        print(f"dflash-stages {version} (torch {torch.__version__}, transformers {transformers.__version__})")
        raise typer.Exit()


#: Options of the whole program that may also be given after the subcommand (``dflash-stages train ... -v``):
#: :func:`main` moves them in front of it, where the root callback reads them.
GLOBAL_FLAGS = ("-v", "--verbose", "-q", "--quiet")


def hoist_global_flags(args: list[str]) -> list[str]:
    """``args`` (``sys.argv[1:]``) with every :data:`GLOBAL_FLAGS` item before a ``--`` moved to the front, so that
    ``-v``/``-q`` work anywhere on the command line, as the same flags of every command."""
    stop = args.index("--") if "--" in args else len(args)
    # Combined short flags (-vv, -vq) are the flags one by one: -vv is -v (debug is the most verbose level), -vq is
    # refused as -v -q is.
    head: list[str] = []
    for arg in args[:stop]:
        if len(arg) > 2 and arg[0] == "-" and arg[1] != "-" and set(arg[1:]) <= {"v", "q"}:
            head.extend(f"-{letter}" for letter in arg[1:])
        else:
            head.append(arg)
    flags = [a for a in head if a in GLOBAL_FLAGS]
    return [*flags, *[a for a in head if a not in GLOBAL_FLAGS], *args[stop:]]


#: Options whose value is a path (or URL, or target spec) in some command: an empty value (``-o ''``) is refused
#: before typer turns it into ``Path('.')``, the current folder (config keys: ``stages.config.check.PATH_FIELDS``).
PATH_OPTIONS = frozenset({"-o", "--output", "--corpus", "--cache", "--cache-to", "--drafter", "--json-file",
                          "--workdir", "--config", "--preset", "--target", "--diff", "--resume-from"})


def refuse_empty_paths(args: list[str]) -> None:
    """Raise ``ConfigError`` for a :data:`PATH_OPTIONS` option given an empty value (``-o ''``, ``--output=``) and
    for an empty positional argument (``export RUN ''``: typer would read it as the current folder)."""
    stop = args.index("--") if "--" in args else len(args)
    flags = _flag_names(args[:stop])
    for index, arg in enumerate(args[:stop]):
        name, eq, value = arg.partition("=")
        empty = (eq and name in PATH_OPTIONS and not value.strip()) or (
            arg in PATH_OPTIONS and index + 1 < stop and not args[index + 1].strip())
        if empty:
            raise ConfigError(f"{name}: empty path; give a path (an empty one would mean the current folder)")
        previous = args[index - 1] if index else ""
        takes_value = previous.startswith("-") and "=" not in previous and previous not in flags
        if not arg.strip() and not takes_value:
            raise ConfigError(f"argument {index + 1} is empty; give a path or value (an empty path would mean the "
                              "current folder)")


@app.callback()
def _root(verbose: bool = typer.Option(False, "--verbose", "-v", help="Log debug messages (anywhere on the line)."),
          quiet: bool = typer.Option(False, "--quiet", "-q", help="Log warnings and errors only (anywhere on the line)."),
          version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                       help="Print the version (and torch's, transformers') and exit.")) -> None:
    from rich.console import Console
    from rich.logging import RichHandler

    if verbose and quiet:
        raise ConfigError("-v/--verbose and -q/--quiet contradict each other; give one")
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO,
        format="%(message)s",
        # stderr: standard output is for results (--print-config, --json, tables), which must stay parseable.
        handlers=[RichHandler(console=Console(stderr=True), show_path=False, rich_tracebacks=True)],
    )
    if not verbose:
        # matplotlib, when a dependency imports it, logs routine housekeeping such as "generated new
        # fontManager" at INFO; only its warnings belong in a run's log.
        logging.getLogger("matplotlib").setLevel(logging.WARNING)


def _set_output_width() -> None:
    """Lay rich output (``--help``, tables) out for ``NON_TTY_COLUMNS`` when stdout is piped and ``$COLUMNS`` is
    unset. A terminal keeps its own width; ``COLUMNS=N`` (or typer's ``TERMINAL_WIDTH``) always wins."""
    if "COLUMNS" not in os.environ and not os.environ.get("TERMINAL_WIDTH") and not sys.stdout.isatty():
        os.environ["COLUMNS"] = str(NON_TTY_COLUMNS)


def _quiet_dask_shutdown() -> None:
    """After an interrupt, this process's Dask scheduler, nannies and comms (``extract``'s local cluster) may log
    expected errors while they are torn down (closed comms, workers killed); they are not the user's problem."""
    for name in ("distributed", "tornado", "asyncio"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


class _DropCancelledTasks(logging.Filter):
    """Drops the worker's "Async instruction ... ended with CancelledError" warning: the task was cancelled on
    purpose (the client shut the cluster down after Ctrl-C or SIGTERM)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "ended with CancelledError" not in record.getMessage()


def dask_setup(worker) -> None:
    """Dask worker preload (``distributed.worker.preload`` names this module; :func:`main` adds it, so it applies to
    the local cluster ``extract`` starts in this process, not to workers of an external scheduler).

    A worker process ignores Ctrl-C: the terminal sends SIGINT to the whole process group, and the main process
    already handles it (cancels the tasks, closes the cluster, exits 130); left alone, each worker would print a
    ``KeyboardInterrupt`` traceback from its event loop and a warning for every cancelled task.
    """
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the process's main thread (an in-process worker): nothing to quiet
        return
    logging.getLogger("distributed.worker.state_machine").addFilter(_DropCancelledTasks())


def _preload_quiet_dask_workers() -> None:
    """Add this module to ``distributed.worker.preload`` (keeping the user's preloads) for :func:`dask_setup`."""
    if importlib.util.find_spec("dask") is None:
        return
    import dask.config

    preload = list(dask.config.get("distributed.worker.preload", default=None) or [])
    if __name__ not in preload and __name__ != "__main__":
        dask.config.set({"distributed.worker.preload": [*preload, __name__]})


def main() -> None:
    """Console-script entry point.

    Errors raised for a user's input (``dflash.errors.DFlashError``: bad path, field, row...) and ``OSError``s of
    :data:`USER_ERRNOS` (full disk, permission denied...) print one ``error:`` line naming what to fix and exit with
    status 2, whichever command raised them; any other exception is a bug: its traceback is printed and the status
    is 3. Click's own usage errors (unknown option or command, missing argument, bad value) are one ``error:``
    line too (:func:`usage_error_message`), exit 2. Ctrl-C and SIGTERM unwind (``finally`` blocks clean up)
    and exit 130. See :class:`ExitCode`.
    """
    interrupted_by: list[str] = []

    def _interrupt(signum, frame):
        # SIGTERM unwinds like Ctrl-C does, so `finally` blocks remove temporary folders (the default SIGTERM action
        # kills the process without running them); typer turns the KeyboardInterrupt into exit status 130.
        # Training installs its own handlers for a clean, checkpointed stop (and then exits 130 itself).
        _quiet_dask_shutdown()
        interrupted_by.append(signal.Signals(signum).name)
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    def _say_interrupted() -> None:  # one line, as train's own stop says what it kept
        if interrupted_by:
            print(f"interrupted by {interrupted_by[0]}; what was committed before it (generated parts, cache shards, "
                  "checkpoints, finished stages) is kept: rerun the same command to go on", file=sys.stderr)

    # Keep a signal ignored if it was on entry (e.g. a job started in the background with SIGINT ignored).
    if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _interrupt)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupt)
    _set_output_width()
    _preload_quiet_dask_workers()
    _register_all()
    sys.argv[1:] = hoist_global_flags(sys.argv[1:])
    try:
        refuse_empty_paths(sys.argv[1:])
        # standalone_mode=False: click's own usage errors (unknown option, missing or bad value, no such command)
        # come here as exceptions instead of typer's boxed panel, and print as one error: line.
        returned = app(standalone_mode=False, prog_name="dflash-stages")
    except typer.TyperException as error:  # click's exceptions derive from it (typer bundles its own click)
        if type(error).__name__ == "NoArgsIsHelpError":  # the help is already printed (no_args_is_help)
            raise SystemExit(ExitCode.USAGE) from None
        print_error(usage_error_message(error))
        raise SystemExit(ExitCode.USAGE) from None
    except typer.Abort:  # end of input at a prompt
        _say_interrupted()
        raise SystemExit(ExitCode.INTERRUPTED) from None
    except KeyboardInterrupt:  # raised outside typer's own handling (e.g. while it finished up)
        _say_interrupted()
        raise SystemExit(ExitCode.INTERRUPTED) from None
    except Exception as error:
        if not is_user_error(error):  # a bug: keep the (pretty) traceback, but never mistake it for a check's verdict
            sys.excepthook(type(error), error, error.__traceback__)
            raise SystemExit(ExitCode.INTERNAL) from None
        print_error(user_error_message(error))
        raise SystemExit(ExitCode.USAGE) from None
    if returned == ExitCode.INTERRUPTED:  # typer's form of a KeyboardInterrupt inside the command: Exit(130)
        _say_interrupted()
    # As typer's standalone mode ends: always SystemExit; the code of typer.Exit(code) / ctx.exit(code), else 0.
    raise SystemExit(returned if isinstance(returned, int) and not isinstance(returned, bool) else ExitCode.OK)


def usage_error_message(error: Exception) -> str:
    """The one line of a click usage error (``typer.TyperException``): the command, click's message and where the
    usage is explained, e.g. ``dflash-stages train: No such option: --lrr Did you mean --lr? (see 'dflash-stages
    train --help')``."""
    format_message = getattr(error, "format_message", None)
    message = " ".join(str(format_message() if callable(format_message) else error).split())
    ctx = getattr(error, "ctx", None)
    command = getattr(ctx, "command_path", None) or _command_path(sys.argv[1:])
    return f"{command}: {message} (see '{command} --help')"


def _commands_of(args: list[str]) -> list[Any]:
    """The click commands ``args`` lead through: the root group, then each (sub)command named in order."""
    node = typer.main.get_command(app)
    nodes = [node]
    for arg in args:
        if arg.startswith("-"):
            continue
        commands = getattr(node, "commands", None)
        if not commands or arg not in commands:
            break
        node = commands[arg]
        nodes.append(node)
    return nodes


def _flag_names(args: list[str]) -> set[str]:
    """Spellings of the options that take no value (flags, counts, ``--help``) of the commands ``args`` name."""
    names: set[str] = set()
    context = None
    for command in _commands_of(args):
        context = typer.Context(command, parent=context, **command.context_settings)  # help names: inherited
        for param in command.params:
            if getattr(param, "is_flag", False) or getattr(param, "count", False):
                names.update(param.opts, param.secondary_opts)
        names.update(command.get_help_option_names(context))
    return names


def _command_path(args: list[str]) -> str:
    """``dflash-stages`` and the (sub)command names that lead ``args`` (for an error click raised without a
    context, e.g. an option missing its value at the end of the line)."""
    return " ".join(["dflash-stages", *(command.name for command in _commands_of(args)[1:])])


if __name__ == "__main__":
    main()
