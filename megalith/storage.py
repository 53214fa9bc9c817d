"""Small fsspec helpers shared by the stages: URLs, hashing and atomic writes."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import fsspec
from fsspec.core import url_to_fs

from megalith import safe_read
from megalith.errors import naming_path

HASH_CHUNK = 8 << 20


def filesystem(url: str, storage_options: dict[str, Any] | None = None):
    """Return ``(fs, path)`` for a local path or any fsspec URL."""
    return url_to_fs(url, **(storage_options or {}))


def cache_root() -> Path:
    """Where downloaded shards and built indices are kept unless ``data.cache_dir`` says."""
    return Path.home() / ".cache" / "megalith"


def is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def join(base: str, *names: str) -> str:
    return "/".join([base.rstrip("/"), *names])


def sha256_of_file(url: str, storage_options: dict[str, Any] | None = None) -> str:
    digest = hashlib.sha256()
    with fsspec.open(url, "rb", **(storage_options or {})) as handle:
        while chunk := handle.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_of_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def atomic_write_bytes(
    url: str, data: bytes, storage_options: dict[str, Any] | None = None
) -> None:
    """Write ``data`` so that readers see the old file or the whole new one, never a part.

    Local files go through a temporary name in the same directory and ``os.replace``;
    object stores publish an object only when its upload completes, so a plain put is atomic.
    """
    if is_local(url):
        path = Path(url.removeprefix("file://"))
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with naming_path(path), os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.chmod(tmp, default_file_mode())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return
    fs, path = filesystem(url, storage_options)
    fs.pipe_file(path, data)


def default_file_mode() -> int:
    """The mode ``open`` gives a new file under this process's umask (mkstemp gives 0600)."""
    return 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_json(url: str, obj: Any, storage_options: dict[str, Any] | None = None) -> None:
    text = json.dumps(obj, indent=2, sort_keys=False) + "\n"
    atomic_write_bytes(url, text.encode("utf-8"), storage_options)


def read_json(url: str, storage_options: dict[str, Any] | None = None) -> Any:
    """A JSON file within the shared limits (:mod:`megalith.safe_read`)."""
    return safe_read.read_json(url, storage_options=storage_options)
