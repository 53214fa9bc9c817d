"""A fine-tune's base weights as a lazy, read-only mapping: tensors are read one box at a
time, so a TP/FSDP rank reads only the rows and columns it holds and never the model.

:class:`BaseTensors` is a ``Mapping[str, Tensor]`` (``base[name]`` reads the whole
tensor, as code that wants whole tensors expects) with :meth:`BaseTensors.read` for a
box ``[start, stop)`` per dim. Its sources:

- :class:`SafetensorsTensors`: a model package's ``model.safetensors`` (already
  verified: every file's sha256, the signature, the header), read through
  ``safe_open(...).get_slice(name)[rows]``;
- :class:`CheckpointTensors`: a v2 sharded checkpoint through its
  :class:`~training.checkpoint.sharded_reader.ShardReader` (only the shards a box
  overlaps, each file checked against index.json before its first read);
- :class:`TensorDict`: tensors already in memory (a v1 checkpoint's single file, tests);
- :class:`MergedAdapters`: a LoRA run's checkpoint seen with its adapters folded into
  the base weights (``W + scale · B A``, merged whole one weight at a time, then cut).

Every read is counted in :attr:`BaseTensors.stats` (bytes and the largest one), so a
test can see what a rank took.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import safe_open
from torch import Tensor

from training.checkpoint.sharded_reader import (
    ShardReader,
    model_weight_names,
    read_box,
)
from training.finetune.lora import is_adapter_param, merge_tensors

Box = tuple[tuple[int, int], ...]


@dataclass
class ReadStats:
    """What a :class:`BaseTensors` has materialized: bytes in all and the largest read."""

    reads: int = 0
    bytes: int = 0
    largest_bytes: int = 0

    def add(self, tensor: Tensor) -> None:
        self.reads += 1
        self.bytes += tensor.nbytes
        self.largest_bytes = max(self.largest_bytes, tensor.nbytes)


class BaseTensors(Mapping[str, Tensor]):
    """Named tensors read lazily; subclasses give names, shapes and :meth:`_read`."""

    def __init__(self, keep: Any = None) -> None:
        self.stats = ReadStats()
        self._keep = keep  # e.g. the temporary directory the files live in

    def shape(self, name: str) -> tuple[int, ...]:
        raise NotImplementedError

    def names(self) -> list[str]:
        raise NotImplementedError

    def _read(self, name: str, box: Box) -> Tensor:
        raise NotImplementedError

    def read(self, name: str, box: Box | None = None) -> Tensor:
        """Box ``box`` of tensor ``name`` (the whole tensor when None), a new tensor."""
        if name not in self.names():
            raise KeyError(name)
        shape = self.shape(name)
        box = tuple((0, n) for n in shape) if box is None else tuple(box)
        tensor = self._read(name, box)
        self.stats.add(tensor)
        return tensor

    def close(self) -> None:
        """Release open files (and a kept temporary directory)."""

    def __getitem__(self, name: str) -> Tensor:
        return self.read(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


class TensorDict(BaseTensors):
    """Tensors already in memory (each read is a copy, so callers may keep it)."""

    def __init__(self, tensors: Mapping[str, Tensor]) -> None:
        super().__init__()
        self._tensors = dict(tensors)

    def names(self) -> list[str]:
        return list(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._tensors[name].shape)

    def _read(self, name: str, box: Box) -> Tensor:
        return self._tensors[name][_slices(box)].clone()


class SafetensorsTensors(BaseTensors):
    """One safetensors file, each box read through ``get_slice`` (verified beforehand)."""

    def __init__(self, path: Path, keep: Any = None) -> None:
        super().__init__(keep)
        self.path = path
        self._handle = safe_open(str(path), framework="pt")
        self._names = list(self._handle.keys())
        self._slices = {name: self._handle.get_slice(name) for name in self._names}

    def names(self) -> list[str]:
        return self._names

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slices[name].get_shape())

    def _read(self, name: str, box: Box) -> Tensor:
        if not box:
            return self._handle.get_tensor(name)
        return self._slices[name][_slices(box)].contiguous()

    def close(self) -> None:
        self._slices.clear()
        self._handle = None
        self._keep = None


class CheckpointTensors(BaseTensors):
    """A v2 checkpoint's model tensors, each box from the shards it overlaps."""

    def __init__(self, reader: ShardReader) -> None:
        super().__init__()
        self.reader = reader
        self._names = model_weight_names(reader)

    def names(self) -> list[str]:
        return self._names

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.reader.index["tensors"][name]["shape"])

    def _read(self, name: str, box: Box) -> Tensor:
        return read_box(self.reader, name, box)

    def close(self) -> None:
        self.reader.close()


class MergedAdapters(BaseTensors):
    """``inner`` (a LoRA run's weights) with each ``X.lora.a``/``X.lora.b`` pair folded
    into ``X.weight`` and left out; a merged weight is merged whole (as
    :func:`~training.finetune.lora.merge_tensors` does, so the values are the same bits)
    and then cut, one weight at a time."""

    def __init__(self, inner: BaseTensors, scale: float) -> None:
        super().__init__()
        self.inner, self.scale = inner, scale
        self._names = [n for n in inner.names() if not is_adapter_param(n)]
        self._adapted = {
            f"{n.removesuffix('.lora.a')}.weight" for n in inner.names() if n.endswith(".lora.a")
        }

    def names(self) -> list[str]:
        return self._names

    def shape(self, name: str) -> tuple[int, ...]:
        return self.inner.shape(name)

    def _read(self, name: str, box: Box) -> Tensor:
        if name not in self._adapted:
            return self.inner.read(name, box)
        module = name.removesuffix(".weight")
        parts = {
            key: self.inner.read(key) for key in (name, f"{module}.lora.a", f"{module}.lora.b")
        }
        return merge_tensors(parts, self.scale)[name][_slices(box)].clone()

    def close(self) -> None:
        self.inner.close()


__all__ = [
    "BaseTensors",
    "CheckpointTensors",
    "MergedAdapters",
    "ReadStats",
    "SafetensorsTensors",
    "TensorDict",
]
