"""The base class for errors a user can act on, and the storage faults they can act on.

The command line prints these as one clear message instead of a traceback; every
message names the file, line or key at fault and what was expected.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class MegalithError(Exception):
    """A problem with the user's input, config or data, not a bug."""


# A full disk, a quota, a file-size limit, a read-only or forbidden place, a path through
# a file, a symlink loop or a name too long: the user can act on these (free space, another
# --output, a fixed link), so they get one line,
# not a traceback.
STORAGE_ERRNOS = frozenset(
    {
        errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM,
        errno.ENOTDIR, errno.EISDIR, errno.ELOOP, errno.ENAMETOOLONG,
    }
)  # fmt: skip


def storage_error_message(exc: OSError) -> str | None:
    """``PATH: cause (ENOSPC)`` for a storage fault the user can act on; None otherwise."""
    if exc.errno not in STORAGE_ERRNOS:
        return None
    cause = f"{exc.strerror or os.strerror(exc.errno)} ({errno.errorcode[exc.errno]})"
    where = exc.filename if exc.filename is not None else "a file being written (name unknown)"
    return f"{where}: {cause}"


# How Rust's std::io::Error ends its message; safetensors raises its own error type.
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")


@contextmanager
def naming_path(path: str | Path) -> Iterator[None]:
    """Put ``path`` into an OSError raised without a file name (a write or flush to an
    open file reports none), so the one-line message can say which file it was; an I/O
    error a Rust library (safetensors) reports only in its text becomes an OSError."""
    try:
        yield
    except OSError as exc:
        if exc.filename is not None or exc.errno is None:
            raise
        raise OSError(exc.errno, exc.strerror, str(path)) from exc
    except Exception as exc:
        found = _RUST_OS_ERROR.search(str(exc))
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), str(path)) from exc
