"""The bottom layer every stage may import: the config tree, errors, storage and safe-read
helpers. It imports no stage package (preprocessing, training, evaluation, registry, deploy,
pipelines)."""

from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

try:
    __version__ = version("megalith")
except PackageNotFoundError:  # running from a source tree without installing
    __version__ = "0+source"

# The folder that holds the project's packages (megalith/, training/, ...): the checkout,
# or site-packages for an installed copy.
CODE_ROOT = Path(__file__).resolve().parents[1]
