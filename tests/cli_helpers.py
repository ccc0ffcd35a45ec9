"""Shared helper of the CLI tests: the real entry point run in the test's own process."""

from __future__ import annotations

import signal
import sys


def main_in_process(monkeypatch, capsys, *args: str) -> tuple[int, str]:
    """Run ``stages.cli.main`` with ``args`` in this process; returns (exit status, stderr). Signal handlers the
    entry point installs are restored afterwards."""
    from stages.cli import main

    monkeypatch.setattr(sys, "argv", ["dflash-stages", *args])
    monkeypatch.setenv("COLUMNS", "400")
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    code = 0
    try:
        main()
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    return code, capsys.readouterr().err
