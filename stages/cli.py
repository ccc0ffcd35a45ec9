"""The ``dflash-stages`` command line (typer + rich).

Each stage module exposes ``register(app: typer.Typer)``, which adds its command(s). This file only wires them;
run ``dflash-stages --help`` for the list.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging

import typer

__all__ = ["app", "main"]

app = typer.Typer(
    name="dflash-stages",
    help="Train DFlash speculative-decoding drafters: prepare -> extract -> train -> evaluate -> export.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    add_completion=False,
)

# Modules whose ``register(app)`` adds commands, in the order ``--help`` lists them.
_COMMAND_MODULES = [
    "pipelines.offline",  # run: the whole offline pipeline on a preset
    "stages.prepare",
    "stages.extract",
    "stages.cache_cmd",
    "stages.train",
    "stages.sweep",
    "stages.evaluate",
    "stages.export",
    "stages.inspect",
]


def _register_all() -> None:
    for module_name in _COMMAND_MODULES:
        if importlib.util.find_spec(module_name) is None:  # stage not written yet
            continue
        importlib.import_module(module_name).register(app)


@app.callback()
def _root(verbose: bool = typer.Option(False, "--verbose", "-v", help="Log debug messages.")) -> None:
    from rich.logging import RichHandler

    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(message)s",
        handlers=[RichHandler(show_path=False, rich_tracebacks=True)],
    )


def main() -> None:
    """Console-script entry point.

    Errors raised for a user's input (``dflash.errors.DFlashError``: bad path, field, row...) print one
    ``error:`` line naming what to fix and exit with status 2, whichever command raised them; anything else is a
    bug and keeps its traceback.
    """
    import signal

    from dflash.errors import DFlashError

    def _exit_on_sigterm(signum, frame):
        # Unwind like Ctrl-C does, so `finally` blocks remove temporary folders (the default SIGTERM action kills
        # the process without running them). Training installs its own handler for a clean, checkpointed stop.
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    _register_all()
    try:
        app()
    except DFlashError as error:
        from rich.console import Console
        from rich.text import Text

        Console(stderr=True).print(Text("error: ", style="bold red") + Text(str(error)), soft_wrap=True)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
