"""Shared helper of the CLI tests: the real entry point run in the test's own process."""

from __future__ import annotations

import signal
import sys


def main_in_process(monkeypatch, capsys, *args: str) -> tuple[int, str]:
    """Run ``stages.cli.main`` with ``args`` in this process; returns (exit status, stderr). Signal handlers the
    entry point installs are restored afterwards."""
    code, _, err = main_in_process_out(monkeypatch, capsys, *args)
    return code, err


def main_in_process_out(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """:func:`main_in_process`, returning (exit status, stdout, stderr)."""
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
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# A process that has imported torch and transformers (most of an interpreter's start-up here) and forks a child per
# command: the child takes the command's working folder, environment and argv, points its stdout/stderr at files
# and runs ``stages.cli.main`` as ``python -c "from stages.cli import main; main()" ARGS`` would (this project's
# modules are imported in the child, under the command's environment); the exit status is the child's own.
_FORK_SERVER = r"""
import json, os, sys
import torch, transformers
for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        sys.argv = ["-c", *request["args"]]
        break
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status), flush=True)
else:
    sys.exit(0)
from stages.cli import main
main()
"""


class ForkedCli:
    """``run(*args, cwd=, env=)``: the console script as a separate process (see ``_FORK_SERVER``), a
    ``subprocess.CompletedProcess`` back; about a second per command instead of an interpreter start-up."""

    def __init__(self) -> None:
        import os
        import subprocess
        import tempfile

        self._folder = tempfile.TemporaryDirectory(prefix="forked-cli-")
        self._count = 0
        self._server = subprocess.Popen([sys.executable, "-c", _FORK_SERVER], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, env=dict(os.environ))

    def run(self, *args: str, cwd, env: dict[str, str] | None = None, timeout: float = 120):
        import json
        import os
        import select
        import subprocess
        from pathlib import Path

        self._count += 1
        out, err = (Path(self._folder.name) / f"{self._count}.{name}" for name in ("out", "err"))
        request = {"args": list(args), "cwd": str(cwd), "env": dict(os.environ if env is None else env),
                   "stdout": str(out), "stderr": str(err)}
        self._server.stdin.write(json.dumps(request) + "\n")
        self._server.stdin.flush()
        ready, _, _ = select.select([self._server.stdout], [], [], timeout)
        if not ready:
            raise subprocess.TimeoutExpired(["dflash-stages", *args], timeout)
        line = self._server.stdout.readline()
        assert line, "the fork server ended"
        return subprocess.CompletedProcess(["dflash-stages", *args], int(line), out.read_text(), err.read_text())

    def close(self) -> None:
        self._server.stdin.close()
        self._server.wait(timeout=60)
        self._server.stdout.close()
        self._folder.cleanup()


_SHARED: list[ForkedCli] = []


def forked_cli(*args: str, cwd, env: dict[str, str] | None = None, timeout: float = 120):
    """``ForkedCli.run`` on the session's one fork server (started at the first call; conftest closes it)."""
    if not _SHARED:
        _SHARED.append(ForkedCli())
    return _SHARED[0].run(*args, cwd=cwd, env=env, timeout=timeout)


def close_forked_cli() -> None:
    while _SHARED:
        _SHARED.pop().close()
