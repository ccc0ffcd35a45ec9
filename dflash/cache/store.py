"""Raw key access to the Zarr store under a cache root (commit records, listing, deletes, sizes).

Zarr's own API covers arrays and groups; commit records are plain JSON objects written next to them with the
store's atomic put (LocalStore: temp file then rename; object stores: a single PUT), so a reader sees either
no record or the whole record. Works for local paths and fsspec URLs alike.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import zarr
from zarr.buffer import default_buffer_prototype
from zarr.core.sync import sync

from dflash.errors import CacheCorruptError

__all__ = ["CacheStore", "partial_files", "remove_partial_files"]


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

    def key(self, relative: str) -> str:
        return f"{self.prefix}/{relative}" if self.prefix else relative

    def get_bytes(self, relative: str) -> bytes | None:
        buffer = sync(self.store.get(self.key(relative), prototype=default_buffer_prototype()))
        return None if buffer is None else buffer.to_bytes()

    def get_many(self, relatives: list[str], *, suffix: int | None = None) -> list[bytes | None]:
        """The bytes of many keys (only their last ``suffix`` bytes when given; fewer if the object is shorter),
        ``None`` for a missing key. A local folder is read with plain file calls, without an event-loop round trip
        per key (the cost that dominates reading thousands of small chunks through zarr); other stores with
        concurrent (ranged) GETs in one round trip."""
        from zarr.storage import LocalStore

        if isinstance(self.store, LocalStore):
            folder = os.path.join(str(self.store.root), self.prefix) if self.prefix else str(self.store.root)
            return [_read_file(os.path.join(folder, relative), suffix) for relative in relatives]
        from zarr.abc.store import SuffixByteRequest

        prototype = default_buffer_prototype()
        byte_range = SuffixByteRequest(suffix) if suffix is not None else None

        async def fetch() -> list[Any]:
            return await asyncio.gather(*(self.store.get(self.key(relative), prototype=prototype, byte_range=byte_range)
                                          for relative in relatives))  # fmt: skip

        return [None if buffer is None else buffer.to_bytes() for buffer in sync(fetch())]

    def get_json(self, relative: str) -> Any | None:
        """The JSON object at ``relative`` or ``None``; raises :class:`CacheCorruptError` naming the key if unparsable."""
        raw = self.get_bytes(relative)
        if raw is None:
            return None
        try:
            return json.loads(raw)
        except ValueError as error:
            raise CacheCorruptError(
                f"{self.url}: {relative} is not valid JSON ({error}); if it is a commit record, delete it so the "
                "shard is redone by the next extract run"
            ) from error

    def put_json(self, relative: str, value: Any, *, exclusive: bool = False) -> None:
        """Write JSON atomically; with ``exclusive`` an existing object is left untouched."""
        buffer = default_buffer_prototype().buffer.from_bytes(json.dumps(value, indent=1, sort_keys=True).encode())
        if exclusive:
            sync(self.store.set_if_not_exists(self.key(relative), buffer))
        else:
            sync(self.store.set(self.key(relative), buffer))

    def exists(self, relative: str) -> bool:
        return bool(sync(self.store.exists(self.key(relative))))

    def list_prefix(self, relative: str) -> list[str]:
        """Keys under ``relative`` (a folder-like prefix), relative to ``relative``."""
        full = self.key(relative).rstrip("/") + "/"

        async def collect() -> list[str]:
            return [key async for key in self.store.list_prefix(full)]

        return [key[len(full):] if key.startswith(full) else key for key in sync(collect())]

    def delete(self, relative: str) -> None:
        sync(self.store.delete(self.key(relative)))

    def delete_dir(self, relative: str) -> None:
        sync(self.store.delete_dir(self.key(relative).rstrip("/")))

    def size_prefix(self, relative: str = "") -> int:
        """Bytes stored under ``relative`` (the whole cache for ``""``)."""
        full = self.key(relative).rstrip("/")
        return int(sync(self.store.getsize_prefix(full + "/" if full else "")))


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
    try:
        fd = os.open(path, os.O_RDONLY)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        size = os.fstat(fd).st_size
        if suffix is None:
            return os.pread(fd, size, 0)
        return os.pread(fd, min(suffix, size), max(0, size - suffix))
    finally:
        os.close(fd)
