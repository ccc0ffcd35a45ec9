"""Shared helper of the CLI tests: the real entry point run in the test's own process."""

from __future__ import annotations

import signal
import sys

#: A duration as progress lines print it (``dflash.progress.short_duration``: ``42s``, ``3m10s``, ``1h06m``), for
#: tests that match those lines whatever time the run took.
DURATION = r"(?:\d+s|\d+m\d\ds|\d+h\d\dm)"
#: A count or rate as progress lines print it (``dflash.progress.short_count``: ``16``, ``0.57``, ``1,098``, ``52K``,
#: ``1.2M``), whatever the machine's speed.
COUNT = r"(?:\d[\d,]*(?:\.\d+)?[KMG]?)"


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


# A process that has imported torch and transformers (most of an interpreter's start-up here: the lazily imported
# transformers.modeling_utils and the tokenizer classes too, as stages.replicas.cluster.FORKSERVER_PRELOAD does for Dask
# workers), moves those objects out of the collector's reach (gc.freeze: a child's exit takes ~0.5 s instead of
# ~2.5 s of collecting and copying them) and forks a child per command. The child takes the command's working folder, environment (its PYTHONPATH
# entries put on sys.path, as an interpreter start would), its own session if asked, and argv, points its
# stdout/stderr at files and runs ``stages.cli.main`` as ``python -c "from stages.cli import main; main()" ARGS``
# would, or the request's ``code`` as ``python -c CODE ARGS`` would (this project's modules are imported in the
# child, under the command's environment). The server answers each request with the child's pid, then its exit
# status (negative: the signal that ended it).
_FORK_SERVER = r"""
import json, os, sys
import torch, transformers, transformers.modeling_utils
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
import gc
gc.freeze()  # a child's collections and exit then skip (and do not copy on write) everything imported here
for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        if request["new_session"]:
            os.setsid()
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.path[1:1] = [entry for entry in request["env"].get("PYTHONPATH", "").split(os.pathsep)
                         if entry and entry not in sys.path]
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        sys.argv = ["-c", *request["args"]]
        break
    print(pid, flush=True)
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status), flush=True)
else:
    sys.exit(0)
del line, pid
if request["code"] is None:
    from stages.cli import main
    main()
else:
    exec(compile(request["code"], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""


class ForkedProcess:
    """A command started by :meth:`ForkedCli.start`, read like a ``subprocess.Popen``: ``pid``, ``poll()``,
    ``wait(timeout)``, ``send_signal``/``kill``, ``returncode``; ``stdout``/``stderr`` (text) once it ended."""

    def __init__(self, server: ForkedCli, pid: int, args: list[str], out, err) -> None:
        self._server, self.pid, self.args, self._out, self._err = server, pid, args, out, err
        self.returncode: int | None = None
        self.stdout = self.stderr = ""

    def poll(self) -> int | None:
        if self.returncode is None:
            self._finish(self._server._read_line(0))
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        import subprocess

        if self.returncode is None:
            line = self._server._read_line(timeout)
            if line is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._finish(line)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        import os

        if self.returncode is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        import signal

        self.send_signal(signal.SIGKILL)

    def _finish(self, line: str | None) -> None:
        if line is None:
            return
        self.returncode = int(line)
        self.stdout, self.stderr = self._out.read_text(), self._err.read_text()
        self._server._running = None


class ForkedCli:
    """``run(*args, cwd=, env=)``: the console script as a separate process (see ``_FORK_SERVER``), a
    ``subprocess.CompletedProcess`` back; about a second per command instead of an interpreter start-up.
    ``start(...)``: the same without waiting, a :class:`ForkedProcess` back. ``code=`` runs ``python -c CODE`` instead.
    One command at a time: a new one first kills (SIGKILL, its whole session if it has one) a started one still
    running, as a test that failed before ending it would leave it."""

    def __init__(self) -> None:
        import os
        import subprocess
        import tempfile

        self._folder = tempfile.TemporaryDirectory(prefix="forked-cli-")
        self._count = 0
        self._pending = b""
        self._running: ForkedProcess | None = None
        self._new_session = False
        self._server = subprocess.Popen([sys.executable, "-c", _FORK_SERVER], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, env=dict(os.environ))

    def start(self, *args: str, cwd, env: dict[str, str] | None = None, code: str | None = None,
              new_session: bool = False) -> ForkedProcess:
        import json
        import os
        from pathlib import Path

        self._end_running()
        self._count += 1
        out, err = (Path(self._folder.name) / f"{self._count}.{name}" for name in ("out", "err"))
        request = {"args": list(args), "cwd": str(cwd), "env": dict(os.environ if env is None else env),
                   "stdout": str(out), "stderr": str(err), "code": code, "new_session": new_session}
        self._server.stdin.write((json.dumps(request) + "\n").encode())
        self._server.stdin.flush()
        pid = self._read_line(60)
        assert pid is not None, "the fork server did not answer"
        shown = ["python", "-c", code, *args] if code is not None else ["dflash-stages", *args]
        self._running = ForkedProcess(self, int(pid), shown, out, err)
        self._new_session = new_session
        return self._running

    def run(self, *args: str, cwd, env: dict[str, str] | None = None, timeout: float = 120, code: str | None = None):
        import subprocess

        process = self.start(*args, cwd=cwd, env=env, code=code)
        try:
            process.wait(timeout)
        finally:
            self._end_running()
        return subprocess.CompletedProcess(process.args, process.returncode, process.stdout, process.stderr)

    def _end_running(self) -> None:
        import os
        import signal

        process = self._running
        if process is None or process.poll() is not None:
            return
        try:
            os.killpg(process.pid, signal.SIGKILL) if self._new_session else process.kill()
        except ProcessLookupError:
            pass
        process.wait(60)

    def _read_line(self, timeout: float | None) -> str | None:
        """The server's next answer line, or None if none came within ``timeout`` seconds (None: wait)."""
        import os
        import select
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self._server.stdout], [], [], left)
            if not ready:
                return None
            chunk = os.read(self._server.stdout.fileno(), 4096)
            assert chunk, "the fork server ended"
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return line.decode()

    def close(self) -> None:
        self._end_running()
        self._server.stdin.close()
        self._server.wait(timeout=60)
        self._server.stdout.close()
        self._folder.cleanup()


# The session's one fork server, whichever name a test imported this module by (``cli_helpers``, ``tests.cli_helpers``):
# the second module object takes the first one's list instead of starting a server of its own.
_OTHER_NAME = "tests.cli_helpers" if __name__ == "cli_helpers" else "cli_helpers"
_SHARED: list[ForkedCli] = getattr(sys.modules.get(_OTHER_NAME), "_SHARED", [])


def _shared() -> ForkedCli:
    if not _SHARED:
        _SHARED.append(ForkedCli())
    return _SHARED[0]


def forked_cli(*args: str, cwd, env: dict[str, str] | None = None, timeout: float = 120):
    """``ForkedCli.run`` on the session's one fork server (started at the first call; conftest closes it)."""
    return _shared().run(*args, cwd=cwd, env=env, timeout=timeout)


def forked_cli_start(*args: str, cwd, env: dict[str, str] | None = None, new_session: bool = False) -> ForkedProcess:
    """``ForkedCli.start`` of the console script on the session's fork server: ``dflash-stages ARGS`` running."""
    return _shared().start(*args, cwd=cwd, env=env, new_session=new_session)


def forked_python(code: str, *args: str, cwd=None, env: dict[str, str] | None = None, timeout: float = 120):
    """``python -c CODE ARGS`` as a process of the session's fork server (``cwd``: this one's by default); a
    ``subprocess.CompletedProcess`` back."""
    import os

    return _shared().run(*args, cwd=os.getcwd() if cwd is None else cwd, env=env, timeout=timeout, code=code)


def forked_python_start(code: str, *args: str, cwd=None, env: dict[str, str] | None = None,
                        new_session: bool = False) -> ForkedProcess:
    """``python -c CODE ARGS`` started on the session's fork server; a :class:`ForkedProcess` back."""
    import os

    return _shared().start(*args, cwd=os.getcwd() if cwd is None else cwd, env=env, code=code,
                           new_session=new_session)


def close_forked_cli() -> None:
    while _SHARED:
        _SHARED.pop().close()


def unloadable_target(folder, source):
    """A target folder that is found and whose config, identity and tokenizer read (copied from the real target
    folder ``source``), but whose weights cannot load (``model.safetensors`` is not a safetensors file): a command
    refusing its input with this target refused it before any model load, whatever the time it took."""
    import shutil
    from pathlib import Path

    folder = Path(folder)
    folder.mkdir(parents=True)
    for path in Path(source).iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name != "dflash_target_identity.json":
            shutil.copy(path, folder / path.name)
    (folder / "model.safetensors").write_bytes(b"not a safetensors file: loading these weights fails" * 4)
    return folder
