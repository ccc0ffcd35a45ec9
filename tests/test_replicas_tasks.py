"""``stages.replicas.tasks``: which errors of a Dask task come back as its value, and how the client raises them.

The end-to-end behaviour (one ``error:`` line, no worker traceback) is tested on the real commands: ``extract`` in
``test_faults.py``, ``generate`` in ``test_generate.py``, ``online`` in ``test_online.py``.
"""

from __future__ import annotations

import errno
import pickle
from concurrent.futures import Future

import pytest

from dflash.errors import CorpusError, CorpusNotFoundError
from stages.replicas.tasks import UserError, returns_user_errors, task_result, user_error_of


def _finished(value) -> Future:
    future = Future()
    future.set_result(value)
    return future


@returns_user_errors
def _task(error: BaseException | None) -> dict:
    if error is not None:
        raise error
    return {"rows": 3}


@pytest.mark.parametrize("error", [
    CorpusError("corpus row 4: bad"),
    CorpusNotFoundError("no corpus at /data/corpus"),  # a DFlashError that is also an OSError (FileNotFoundError)
    OSError(errno.ENOSPC, "No space left on device", "/data/cache/shards/000001"),
    OSError(errno.EACCES, "Permission denied", "/data/corpus"),
], ids=["dflash", "dflash-oserror", "enospc", "eacces"])  # fmt: skip
def test_a_users_error_is_the_tasks_value_and_the_client_raises_it_as_it_was(error):
    from tblib import pickling_support

    value = _task(error)
    assert user_error_of(value) is error
    # It crosses from the worker to the client pickled, with the reducers dask.distributed registers for exception
    # classes (tblib's, for every class defined before distributed was imported and every error it sends): type,
    # message, errno and path kept.
    pickling_support.install(error)
    sent = pickle.loads(pickle.dumps(value))
    with pytest.raises(type(error)) as raised:
        task_result(_finished(sent))
    assert str(raised.value) == str(error)
    assert getattr(raised.value, "errno", None) == getattr(error, "errno", None)


@pytest.mark.parametrize("error", [
    OSError(errno.EBADF, "Bad file descriptor"),  # not an errno of USER_ERRNOS: a bug
    RuntimeError("worker has no target loaded"),
    KeyError("rows"),
], ids=["ebadf", "runtime", "key"])  # fmt: skip
def test_any_other_error_still_fails_the_task(error):
    with pytest.raises(type(error)):
        _task(error)


def test_a_result_passes_through():
    assert user_error_of({"rows": 3}) is None
    assert task_result(_finished(_task(None))) == {"rows": 3}
    assert not isinstance(_task(None), UserError)
