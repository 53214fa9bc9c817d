"""Index arrays cached as ``.npy`` files, keyed by a hash of everything that determines them.

Each entry is ``KEY-NAME.npy`` per array plus ``KEY-description.json``, written last:
its presence means the entry is complete. Every file goes through a temporary name
and a rename, so processes that build the same entry at once cannot corrupt it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from megalith import safe_read
from megalith.errors import MegalithError
from megalith.storage import atomic_write_json

logger = logging.getLogger(__name__)

DESCRIPTION_MAX_BYTES = 64 << 10  # a description is a few hundred bytes


def cache_key(description: dict[str, Any]) -> str:
    text = json.dumps(description, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def load_or_build(
    cache_dir: str | Path,
    description: dict[str, Any],
    names: tuple[str, ...],
    build: Callable[[], dict[str, np.ndarray]],
    check: Callable[[dict[str, np.ndarray]], None] | None = None,
) -> dict[str, np.ndarray]:
    """Memory-map the cached arrays for ``description``, building and saving them on a miss.

    ``check`` raises ``ValueError`` for cached arrays the dataset cannot index safely (the
    cache may sit on shared storage: an index past the documents, or a sample spanning
    10^12 positions, would crash or hang training); such an entry is rebuilt."""
    cache_dir = Path(cache_dir)
    key = cache_key(description)
    paths = {name: cache_dir / f"{key}-{name}.npy" for name in names}
    described = cache_dir / f"{key}-description.json"
    cached = _load(described, description, paths)
    if cached is not None and check is not None:
        try:
            check(cached)
        except ValueError as exc:
            logger.warning("rebuilding the index cache entry %s: %s", described, exc)
            cached = None
    if cached is not None:
        return cached
    start = time.perf_counter()
    arrays = build()
    logger.info("built %s indices in %.2fs", description.get("kind"), time.perf_counter() - start)
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        for name, path in paths.items():
            _save_npy(path, arrays[name])
        atomic_write_json(str(described), description)
    except OSError as exc:
        raise MegalithError(
            f"cannot write the dataset index cache in {cache_dir}: {exc.strerror or exc} "
            "(set data.cache_dir to a writable directory)"
        ) from None
    return arrays


def cache_files(cache_dir: str | Path, description: dict[str, Any]) -> list[Path]:
    """The files of one cache entry (for tests and clean-up)."""
    return sorted(Path(cache_dir).glob(f"{cache_key(description)}-*"))


def _load(
    described: Path, description: dict[str, Any], paths: dict[str, Path]
) -> dict[str, np.ndarray] | None:
    try:
        found = safe_read.read_json(described, DESCRIPTION_MAX_BYTES, allow_symlink=False)
        if found != json.loads(json.dumps(description)):
            return None
        return {
            name: np.load(path, mmap_mode="r", allow_pickle=False) for name, path in paths.items()
        }
    except Exception:  # noqa: BLE001
        # Missing, cut, foreign or oversized files: rebuild. np.load parses a .npy header
        # with ast.literal_eval, whose errors on a damaged header range from SyntaxError to
        # tokenize.TokenError; the entry is disposable, so any error means "build it again".
        return None


def check_ids(array: np.ndarray, name: str, low: int, high: int, ndim: int = 1) -> None:
    """``array`` has ``ndim`` dimensions of integers, each in ``[low, high)``."""
    if array.ndim != ndim or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{name} is a {array.ndim}-d {array.dtype} array")
    if array.size and (int(array.min()) < low or int(array.max()) >= high):
        raise ValueError(f"{name} holds values outside [{low}, {high})")


def _save_npy(path: Path, array: np.ndarray) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            np.save(handle, array, allow_pickle=False)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
