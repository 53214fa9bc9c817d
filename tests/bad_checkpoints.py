"""A corpus of crafted bad inputs for the loaders (see tests/test_security.py).

Each defect is a function ``defect(directory, manifest, marker)`` that damages a
freshly written, sound checkpoint directory in place (``manifest``: the name of its
sha256 manifest, ``marker``: a path that must never come to exist) and returns the
words the loader's error must contain. Loaders are described in test_security.py;
a new format (the v2 sharded checkpoint) adds one ``Target`` there.
"""

from __future__ import annotations

from pathlib import Path


class WritesMarker:
    """Unpickling this object creates ``marker``: proof that a loader ran pickled code."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))
