"""The user-facing error base and storage-fault helpers live in :mod:`preprocessing.errors`,
the lowest stage, so preprocessing need not import training; re-exported here for training
and the layers above."""

from preprocessing.errors import (
    STORAGE_ERRNOS,
    MegalithError,
    naming_path,
    storage_error_message,
)

__all__ = ["STORAGE_ERRNOS", "MegalithError", "naming_path", "storage_error_message"]
