"""Read a PyTorch distributed checkpoint (DCP: ``.metadata`` + ``*.distcp``) without running
code the files name.

DCP's own reader unpickles ``.metadata`` with plain ``pickle.load``, so a crafted file runs
whatever it names. Here ``.metadata`` goes through :class:`MetadataUnpickler`, which resolves
only DCP's metadata dataclasses (and the planner dataclasses DCP stores beside them), their
enums, ``torch.Size``, ``pathlib.PosixPath`` and torch's dtypes, layouts and memory formats; any other global is an
error before anything is constructed. Each tensor chunk is then a ``torch.save`` payload at
the byte range the metadata names inside a ``.distcp`` file, read with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
import pathlib
import pickle
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint import filesystem, metadata, planner

from megalith.errors import MegalithError

METADATA_FILE = ".metadata"
# The largest .metadata read (a 70B model's is a few MB).
MAX_METADATA_BYTES = 256 << 20
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)
_LAYOUTS = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}


def _layout(name: str) -> torch.layout:
    """Stand-in for ``torch.serialization._get_layout``: a lookup, nothing else."""
    if name not in _LAYOUTS:
        raise pickle.UnpicklingError(f"unknown torch layout {name!r}")
    return _LAYOUTS[name]


# module -> names in it that the unpickler may resolve (each an inert class or value).
_ALLOWED: dict[str, dict[str, Any]] = {
    "torch.distributed.checkpoint.metadata": {
        name: getattr(metadata, name)
        for name in (
            "Metadata",
            "StorageMeta",
            "MetadataIndex",
            "TensorProperties",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    },
    "torch.distributed.checkpoint.planner": {
        name: getattr(planner, name)
        for name in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo": filesystem._StorageInfo},
    "torch.serialization": {"_get_layout": _layout},
    "torch": {"Size": torch.Size},
    # StorageMeta.checkpoint_id, as DCP's own FileSystemWriter records it: a path value
    "pathlib": {"PosixPath": pathlib.PosixPath},
    "pathlib._local": {"PosixPath": pathlib.PosixPath},
}


class DcpError(MegalithError):
    """A distributed checkpoint that cannot be read safely; names the file and the reason."""


class MetadataUnpickler(pickle.Unpickler):
    """Unpickler for DCP ``.metadata``: resolves only :data:`_ALLOWED` and torch's dtypes,
    layouts and memory formats (values, not callables)."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, {}):
            return _ALLOWED[module][name]
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_VALUES):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in DCP metadata")


def read_metadata(directory: Path) -> metadata.Metadata:
    """``directory/.metadata`` through :class:`MetadataUnpickler`."""
    path = directory / METADATA_FILE
    if path.is_symlink() or not path.is_file():
        raise DcpError(f"{path}: missing or not a plain file")
    if path.stat().st_size > MAX_METADATA_BYTES:
        raise DcpError(f"{path}: larger than {MAX_METADATA_BYTES} bytes")
    try:
        meta = MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
    except Exception as exc:  # refused globals and malformed streams alike
        raise DcpError(f"{path}: not read: {exc}") from None
    if not isinstance(meta, metadata.Metadata) or not isinstance(meta.storage_data, dict):
        raise DcpError(f"{path}: not a DCP Metadata object")
    return meta


def _chunk(directory: Path, info: Any, key: str) -> Tensor:
    """One chunk: the torch.save payload at ``info``'s byte range of its .distcp file."""
    if not isinstance(info, filesystem._StorageInfo) or info.transform_descriptors:
        raise DcpError(f"{directory}: storage of {key} is not a plain byte range")
    relative = Path(str(info.relative_path))
    file = directory / relative
    if relative.name != str(relative) or file.is_symlink() or not file.is_file():
        raise DcpError(f"{directory}: {key} names {relative}, not a file in this directory")
    with file.open("rb") as stream:
        stream.seek(int(info.offset))
        payload = stream.read(int(info.length))
    try:
        tensor = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise DcpError(f"{file}: {key} not loaded with weights_only=True: {exc}") from None
    if not isinstance(tensor, Tensor):
        raise DcpError(f"{file}: {key} is a {type(tensor).__name__}, not a tensor")
    return tensor


def read_tensors(directory: Path, keys: set[str] | None = None) -> dict[str, Tensor]:
    """Every tensor (or those in ``keys``) of the DCP checkpoint in ``directory``, whole:
    its chunks placed at their offsets."""
    meta = read_metadata(directory)
    # No tensor is allocated larger than the data files could fill (a crafted size).
    budget = sum(f.stat().st_size for f in directory.glob("*.distcp") if f.is_file())
    out: dict[str, Tensor] = {}
    for key, item in meta.state_dict_metadata.items():
        if not isinstance(item, metadata.TensorStorageMetadata) or (keys and key not in keys):
            continue
        dtype = item.properties.dtype
        numel = torch.Size(item.size).numel()
        if numel * dtype.itemsize > budget:
            raise DcpError(
                f"{directory}: {key} of size {list(item.size)} exceeds the .distcp files"
            )
        whole = torch.empty(tuple(item.size), dtype=dtype)
        covered = 0
        for chunk in item.chunks:
            index = metadata.MetadataIndex(key, chunk.offsets)
            if index not in meta.storage_data:
                raise DcpError(f"{directory}: no storage for {key} at {list(chunk.offsets)}")
            tensor = _chunk(directory, meta.storage_data[index], key)
            if tuple(tensor.shape) != tuple(chunk.sizes) or tensor.dtype != dtype:
                raise DcpError(f"{directory}: {key} chunk is {list(tensor.shape)}, not {chunk}")
            _place(whole, tensor, chunk.offsets, f"{directory}: {key}")
            covered += tensor.numel()
        if covered != whole.numel():
            raise DcpError(f"{directory}: chunks of {key} cover {covered} of {whole.numel()}")
        out[key] = whole
    return out


def _place(whole: Tensor, chunk: Tensor, offsets: Any, what: str) -> None:
    """Copy ``chunk`` into ``whole`` at ``offsets``, refusing a chunk that does not fit."""
    if len(offsets) != whole.dim() or any(
        start < 0 or start + size > limit
        for start, size, limit in zip(offsets, chunk.shape, whole.shape, strict=True)
    ):
        raise DcpError(f"{what}: chunk at {list(offsets)} falls outside {list(whole.shape)}")
    view = whole
    for dim, (start, size) in enumerate(zip(offsets, chunk.shape, strict=True)):
        view = view.narrow(dim, start, size)
    view.copy_(chunk)
