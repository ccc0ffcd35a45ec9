"""Raw key access to the Zarr store under a cache root (commit records, chunks, listing, deletes, sizes).

Zarr's own API covers arrays and groups; commit records are plain JSON objects written next to them and whole
chunks are stored by :mod:`dflash.cache.chunks`, both through this module's synchronous key I/O
(:func:`key_io`), so a reader sees either no object or the whole object:

* a local folder (zarr's ``LocalStore``): zarr's public synchronous store protocol
  (``zarr.abc.store.SupportsSyncStore``: ``get_sync``/``set_sync``/``delete_sync``, zarr >= 3.1.6; ``set_sync``
  writes a temporary and renames it) plus plain file calls for listing, sizes and exclusive creation (a hard
  link, which fails if the key exists);
* any other store (fsspec URLs: object stores, ``memory://``): fsspec's synchronous filesystem API for the same
  URL (``fsspec.core.url_to_fs``); a PUT is atomic on object stores.

No event loop is driven from here (zarr's private ``zarr.core.sync`` is not used). :func:`open_cache_store` and
:func:`read_cache_metadata` open a cache root and read its metadata, for the reader and the writer alike.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import uuid
from typing import Any

import zarr
from zarr.abc.store import SupportsSyncStore
from zarr.buffer import default_buffer_prototype
from zarr.storage import LocalStore

from dflash.cache.format import METADATA_ATTRIBUTE, CacheMetadata
from dflash.errors import CacheCorruptError, CacheError, CacheNotFoundError
from dflash.io.files import MAX_RECORD_BYTES, parse_json

#: The fix of an unreadable JSON record in the cache.
_REDO = "if it is a commit record, delete it so the shard is redone by the next extract run"

__all__ = ["CacheStore", "KeyIO", "key_io", "open_cache_store", "partial_files", "read_cache_metadata",
           "remove_partial_files"]


class KeyIO:
    """Synchronous bytes-by-key access to one zarr store; keys are the store's own (``shards/000001/hidden/c/0/0``).
    Made by :func:`key_io`; thread-safe (every call is independent)."""

    def get(self, key: str, suffix: int | None = None) -> bytes | None:  # pragma: no cover - interface
        """The object's bytes (only the last ``suffix`` bytes when given), ``None`` if it is missing."""
        raise NotImplementedError

    def get_many(self, keys: list[str], suffix: int | None = None) -> list[bytes | None]:
        """:meth:`get` of each key, in order (stores with a batched read override it)."""
        return [self.get(key, suffix) for key in keys]

    def set(self, key: str, data: bytes) -> None:  # pragma: no cover - interface
        """Write the whole object atomically (replacing it)."""
        raise NotImplementedError

    def set_if_absent(self, key: str, data: bytes) -> bool:  # pragma: no cover - interface
        """Write the object unless it exists; whether it was written."""
        raise NotImplementedError

    def exists(self, key: str) -> bool:  # pragma: no cover - interface
        """Whether the object exists (a folder-like prefix is not an object)."""
        raise NotImplementedError

    def list_prefix(self, prefix: str) -> list[str]:  # pragma: no cover - interface
        """Keys (objects, not folders) under ``prefix`` (which ends with ``/``)."""
        raise NotImplementedError

    def delete(self, key: str) -> None:  # pragma: no cover - interface
        """Delete the object; a missing one is not an error."""
        raise NotImplementedError

    def delete_dir(self, prefix: str) -> None:  # pragma: no cover - interface
        """Delete every object under ``prefix``; nothing there is not an error."""
        raise NotImplementedError

    def size_prefix(self, prefix: str) -> int:  # pragma: no cover - interface
        """Bytes of the objects under ``prefix`` (``""``: the whole store)."""
        raise NotImplementedError


class _LocalKeys(KeyIO):
    def __init__(self, store: Any) -> None:
        self.store = store
        self.root = str(store.root)

    def path(self, key: str) -> str:
        return os.path.join(self.root, *key.strip("/").split("/")) if key.strip("/") else self.root

    def get(self, key: str, suffix: int | None = None) -> bytes | None:
        return _read_file(self.path(key), suffix)

    def set(self, key: str, data: bytes) -> None:
        self.store.set_sync(key, default_buffer_prototype().buffer.from_bytes(data))

    def set_if_absent(self, key: str, data: bytes) -> bool:
        final = self.path(key)
        os.makedirs(os.path.dirname(final), exist_ok=True)
        temporary = f"{final}.{uuid.uuid4().hex}.partial"  # the name zarr's own temporaries have (partial_files)
        try:
            with open(temporary, "xb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            try:
                os.link(temporary, final)  # atomic, and refuses an existing key: two racing writers, one wins
            except FileExistsError:
                return False
            return True
        finally:
            try:
                os.unlink(temporary)
            except FileNotFoundError:
                pass

    def exists(self, key: str) -> bool:
        return os.path.isfile(self.path(key))

    def list_prefix(self, prefix: str) -> list[str]:
        folder = self.path(prefix)
        keys = []
        for directory, _, names in os.walk(folder):
            relative = os.path.relpath(directory, self.root)
            base = "" if relative == "." else relative.replace(os.sep, "/") + "/"
            keys += [base + name for name in names]
        return keys

    def delete(self, key: str) -> None:
        self.store.delete_sync(key)

    def delete_dir(self, prefix: str) -> None:
        folder = self.path(prefix)
        if os.path.isdir(folder):
            shutil.rmtree(folder)

    def size_prefix(self, prefix: str) -> int:
        total = 0
        for directory, _, names in os.walk(self.path(prefix)):
            for name in names:
                try:
                    total += os.path.getsize(os.path.join(directory, name))
                except FileNotFoundError:  # removed meanwhile (a temporary renamed into place)
                    pass
        return total


class _FsspecKeys(KeyIO):
    def __init__(self, store: Any) -> None:
        import fsspec

        fs = store.fs
        sync_fs = getattr(fs, "sync_fs", None)  # fsspec's AsyncFileSystemWrapper around a synchronous filesystem
        if sync_fs is None:  # an asynchronous filesystem (s3fs, gcsfs...): the same one, in synchronous mode
            sync_fs = fsspec.filesystem(fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0],
                                        **{**getattr(fs, "storage_options", {}), "asynchronous": False})
        self.fs = sync_fs
        self.root = str(store.path).rstrip("/")

    def path(self, key: str) -> str:
        return f"{self.root}/{key.strip('/')}" if key.strip("/") else self.root

    def get(self, key: str, suffix: int | None = None) -> bytes | None:
        path = self.path(key)
        try:
            if suffix is None:
                return self.fs.cat_file(path)
            size = self.fs.size(path)
            return self.fs.cat_file(path, start=max(0, size - suffix), end=size)
        except FileNotFoundError:
            return None

    def get_many(self, keys: list[str], suffix: int | None = None) -> list[bytes | None]:
        """One batched call (fsspec runs an async filesystem's GETs concurrently): ``cat`` for whole objects,
        ``cat_ranges`` with a negative start for suffixes; a missing object is ``None``."""
        paths = [self.path(key) for key in keys]
        if suffix is None:
            found = self.fs.cat(paths, on_error="omit") if paths else {}
            return [found.get(path, found.get(path.lstrip("/"))) for path in paths]
        parts = self.fs.cat_ranges(paths, [-suffix] * len(paths), [None] * len(paths), on_error="return")
        return [part if isinstance(part, bytes) else self.get(key, suffix) for key, part in zip(keys, parts,
                                                                                                 strict=True)]

    def set(self, key: str, data: bytes) -> None:
        self.fs.pipe_file(self.path(key), data)

    def set_if_absent(self, key: str, data: bytes) -> bool:
        if self.fs.exists(self.path(key)):
            return False
        self.fs.pipe_file(self.path(key), data)
        return True

    def exists(self, key: str) -> bool:
        return bool(self.fs.isfile(self.path(key)))

    def list_prefix(self, prefix: str) -> list[str]:
        root = self.root.strip("/")
        skip = len(root) + 1 if root else 0  # find() returns whole paths (with or without a leading "/")
        found = self.fs.find(self.path(prefix)) if self.fs.exists(self.path(prefix)) else []
        return [path.strip("/")[skip:] for path in found]

    def delete(self, key: str) -> None:
        try:
            self.fs.rm_file(self.path(key))
        except FileNotFoundError:
            pass

    def delete_dir(self, prefix: str) -> None:
        if self.fs.exists(self.path(prefix)):
            self.fs.rm(self.path(prefix), recursive=True)

    def size_prefix(self, prefix: str) -> int:
        path = self.path(prefix)
        return int(self.fs.du(path)) if self.fs.exists(path) else 0


def key_io(store: Any) -> KeyIO:
    """Synchronous key I/O for a zarr store (module docstring): a ``LocalStore`` (zarr's sync protocol and file
    calls) or an ``FsspecStore`` (fsspec's synchronous API).

    Raises:
        TypeError: another kind of store (none is used for caches).
    """
    if isinstance(store, LocalStore) and isinstance(store, SupportsSyncStore):
        return _LocalKeys(store)
    if hasattr(store, "fs") and hasattr(store, "path"):
        return _FsspecKeys(store)
    raise TypeError(f"no synchronous key access for a {type(store).__name__}; caches live in local folders or fsspec URLs")


class CacheStore:
    """Thin synchronous wrapper over the zarr store of one cache root.

    Args:
        path_or_url: local folder or fsspec URL of the cache root.
        mode: zarr open mode (``"r"``, ``"r+"``, ``"w"``, ``"w-"``, ``"a"``).
    """

    def __init__(self, path_or_url: str | os.PathLike[str], mode: str, *, attributes: dict[str, Any] | None = None) -> None:
        self.url = os.fspath(path_or_url)
        # file:// URLs go through zarr's LocalStore (atomic writes, folders created on demand).
        location = self.url[len("file://"):] if self.url.startswith("file://") else self.url
        if mode in ("w", "w-"):
            self.group = zarr.create_group(store=location, overwrite=mode == "w", attributes=attributes or {}, zarr_format=3)
        else:
            self.group = zarr.open_group(store=location, mode=mode, zarr_format=3)
        self.store = self.group.store
        self.prefix = self.group.store_path.path
        self.keys = key_io(self.store)

    def key(self, relative: str) -> str:
        return f"{self.prefix}/{relative}" if self.prefix else relative

    def get_bytes(self, relative: str) -> bytes | None:
        return self.keys.get(self.key(relative))

    def get_many(self, relatives: list[str], *, suffix: int | None = None) -> list[bytes | None]:
        """The bytes of many keys (only their last ``suffix`` bytes when given; fewer if the object is shorter),
        ``None`` for a missing key. A local folder is read with plain file calls (one ``pread`` each), other stores
        with one batched fsspec call (concurrent GETs on object stores)."""
        return self.keys.get_many([self.key(relative) for relative in relatives], suffix)

    def get_json(self, relative: str) -> Any | None:
        """The JSON object at ``relative`` or ``None``; raises :class:`CacheCorruptError` naming the key if unparsable."""
        raw = self.get_bytes(relative)
        if raw is None:
            return None
        if len(raw) > MAX_RECORD_BYTES:
            raise CacheCorruptError(f"{self.url}: {relative} is {len(raw):,} bytes, over the {MAX_RECORD_BYTES:,}-byte "
                                    f"limit of a record; {_REDO}")
        return parse_json(raw, where=f"{self.url}: {relative}", error=CacheCorruptError, fix=_REDO)

    def put_json(self, relative: str, value: Any, *, exclusive: bool = False) -> None:
        """Write JSON atomically; with ``exclusive`` an existing object is left untouched."""
        data = json.dumps(value, indent=1, sort_keys=True).encode()
        if exclusive:
            self.keys.set_if_absent(self.key(relative), data)
        else:
            self.keys.set(self.key(relative), data)

    def exists(self, relative: str) -> bool:
        return self.keys.exists(self.key(relative))

    def list_prefix(self, relative: str) -> list[str]:
        """Keys under ``relative`` (a folder-like prefix), relative to ``relative``."""
        full = self.key(relative).rstrip("/") + "/"
        return [key[len(full):] if key.startswith(full) else key for key in self.keys.list_prefix(full)]

    def delete(self, relative: str) -> None:
        self.keys.delete(self.key(relative))

    def delete_dir(self, relative: str) -> None:
        self.keys.delete_dir(self.key(relative).rstrip("/"))

    def size_prefix(self, relative: str = "") -> int:
        """Bytes stored under ``relative`` (the whole cache for ``""``)."""
        return self.keys.size_prefix(self.key(relative).rstrip("/"))


def _local_root(url: str) -> str | None:
    if "://" in url and not url.startswith("file://"):
        return None
    return url[len("file://"):] if url.startswith("file://") else url


def partial_files(url: str | os.PathLike[str]) -> list[str]:
    """Temporary files zarr's LocalStore left in a cache (``zarr.<hex>.partial``, ``c/0/0.<hex>.partial``...): a
    write killed between its temporary file and the rename (e.g. during ``finalize``). Paths relative to the cache
    root, sorted; always empty for object stores (a PUT leaves no temporary)."""
    root = _local_root(os.fspath(url))
    if root is None:
        return []
    return sorted(
        os.path.relpath(os.path.join(folder, name), root)
        for folder, _, names in os.walk(root)
        for name in names
        if name.endswith(".partial")
    )


def remove_partial_files(url: str | os.PathLike[str]) -> list[str]:
    """Delete :func:`partial_files`; returns what was removed. Only the cache's one writer may do this (extract,
    under its output lock: a live writer's temporary would otherwise vanish before its rename)."""
    root = _local_root(os.fspath(url))
    removed = partial_files(url)
    for relative in removed:
        try:
            os.unlink(os.path.join(root, relative))  # type: ignore[arg-type]
        except FileNotFoundError:
            pass
    return removed


def _read_file(path: str, suffix: int | None) -> bytes | None:
    """The bytes of a regular file (its last ``suffix`` bytes), None when absent; never more than its size.

    Raises:
        CacheCorruptError: a device, FIFO, socket or folder where a key's file belongs (opened without blocking:
            a FIFO would block the open, a device never end).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CacheCorruptError(f"{path} is not a regular file (a device, FIFO or folder in its place): the cache "
                                    "was tampered with; re-extract it")
        size = info.st_size
        if suffix is None:
            return os.pread(fd, size, 0)
        return os.pread(fd, min(suffix, size), max(0, size - suffix))
    finally:
        os.close(fd)


def _what_is_there(path: str) -> str:
    """A hint naming what a local ``path`` holds instead of a cache (a corpus, a run, nothing)."""
    local = path[len("file://"):] if path.startswith("file://") else path
    if "://" in local or not os.path.exists(local):
        return "nothing is there"
    if not os.path.isdir(local):
        return "it is a file, not a cache folder"
    names = set(os.listdir(local))
    if "corpus.json" in names or any(name.endswith(".arrow") for name in names):
        return "it looks like a tokenized corpus (prepare's output); pass it to `extract --corpus` and give train the cache extract writes"
    if "checkpoints" in names or "run.json" in names:
        return "it looks like a training run, not a cache"
    return "the folder holds no cache (no Zarr group with dflash metadata)"


def open_cache_store(path: str | os.PathLike[str], mode: str) -> CacheStore:
    """The cache root at ``path`` opened in zarr ``mode``.

    Raises:
        CacheNotFoundError: nothing is at ``path`` (the message says what is there instead).
        CacheError: ``path`` is not a Zarr v3 group.
    """
    try:
        return CacheStore(path, mode)
    except FileNotFoundError as error:
        raise CacheNotFoundError(
            f"no cache at {os.fspath(path)}: {_what_is_there(os.fspath(path))}; run `dflash-stages extract` first"
        ) from error
    except Exception as error:  # zarr raises several types for "not a group"
        raise CacheError(f"cannot open the cache at {os.fspath(path)} as a Zarr v3 group: {error}") from error


def read_cache_metadata(store: CacheStore) -> CacheMetadata:
    """The cache's root metadata (:data:`dflash.cache.format.METADATA_ATTRIBUTE`).

    Raises:
        CacheError: the group has no such attribute, or it does not parse.
    """
    attributes = dict(store.group.attrs)
    if METADATA_ATTRIBUTE not in attributes:
        raise CacheError(f"{store.url} is a Zarr group without the root attribute {METADATA_ATTRIBUTE!r}; it is not a dflash cache")
    return CacheMetadata.from_dict(attributes[METADATA_ATTRIBUTE])
