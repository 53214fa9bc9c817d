"""Training: config schema, models, parallelism, data loading, optimizer, trainer, checkpoints."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("megalith")
except PackageNotFoundError:  # running from a source tree without installing
    __version__ = "0+source"
