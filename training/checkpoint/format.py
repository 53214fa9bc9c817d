"""Training checkpoints: safetensors for tensors, JSON for everything else, never pickle.

Layout of one checkpoint (``CHECKPOINTS/step-00000100/``)::

    model.safetensors       parameters by name (tied weights stored once)
    optimizer.safetensors   AdamW moments by "<param name>/<state key>"
    rng.safetensors         torch CPU/CUDA generator states, numpy's key array
    state.json              step, consumed samples, optimizer hyper-parameters, loss scaler,
                            Python/numpy RNG, the config
    index.json              every file's sha256 and size, every tensor's shape and dtype

It is written into ``step-00000100.tmp/`` and renamed when complete, then
``latest.json`` is replaced atomically. Loading checks every file against
``index.json`` before reading it.

One trust path for every loader (training resume, fine-tuning bases, conversion,
``ckpt verify``): index.json is read once, bounded and never through a symbolic link or
a device, its signature is checked over those very bytes, then every listed file's size
and sha256; JSON files (state.json) are parsed from the bytes that were hashed
(:func:`read_verified_json`). A checkpoint's identity is its step, held in the signed
index and the hashed state.json: a ``step-N`` folder whose content says another step
(an older checkpoint copied or renamed over a newer one) is refused
(:func:`check_step`), as is a ``latest.json`` whose step and folder disagree.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
)
from safetensors import safe_open
from safetensors.torch import save_file

from megalith import safe_read
from megalith.errors import MegalithError
from megalith.safe_read import brief
from megalith.storage import atomic_write_json, sha256_of_file
from training.checkpoint.safe_tensors import UnsafeTensorFileError, check_safetensors
from training.checkpoint.signing import (
    SignatureError,
    check_signature_bytes,
    read_signature,
    should_sign,
    sign_directory,
)

INDEX_FORMAT = "megalith-checkpoint"
INDEX_VERSION = 1
TENSOR_FILES = ("model.safetensors", "optimizer.safetensors", "rng.safetensors")
MAX_INDEX_BYTES = 256 << 20
MAX_TENSOR_NAME = 1024  # "optimizer/<a parameter's dotted name>/exp_avg_sq"
MAX_STATE_BYTES = 64 << 20  # step, config, optimizer hyper-parameters, RNG: a few hundred KB
_STEP_DIR = re.compile(r"step-(\d+)")


class CheckpointError(MegalithError):
    """A checkpoint that is missing, incomplete, tampered with or does not fit the model."""


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


# --------------------------------------------------------------------------- save


def save_checkpoint(
    root: str | Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    param_names: list[str],
    state: dict[str, Any],
    scaler: torch.amp.GradScaler | None = None,
    keep_last: int = 3,
    sign: bool | None = None,
) -> Path:
    """Write a complete checkpoint for ``step`` and prune to the newest ``keep_last``.

    ``sign`` (``checkpoint.sign``): HMAC-sign index.json (see :mod:`training.checkpoint.signing`);
    None signs when ``MEGALITH_SIGNING_KEY`` is set.
    """
    root = Path(root)
    final = root / step_dir_name(step)
    staging = root / f"{step_dir_name(step)}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        tensors = {
            "model.safetensors": _model_tensors(model),
            "optimizer.safetensors": _optimizer_tensors(optimizer, param_names),
            "rng.safetensors": _rng_tensors(),
        }
        for name, content in tensors.items():
            save_file(content, str(staging / name))
        record = {
            **state,
            "step": step,
            "optimizer": {"param_groups": _param_groups(optimizer), "param_names": param_names},
            "scaler": scaler.state_dict() if scaler is not None and scaler.is_enabled() else None,
            "rng": _rng_json(),
        }
        (staging / "state.json").write_text(json.dumps(record, indent=2))
        _write_index(staging, tensors, step)
        if should_sign(sign):
            sign_directory(staging, "index.json")

        if final.exists():
            shutil.rmtree(final)
        staging.rename(final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # a full disk gets its space back at once
        raise
    atomic_write_json(str(root / "latest.json"), {"step": step, "path": final.name})
    _prune(root, step, keep_last)
    return final


def _model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    # named_parameters() lists a tied weight once, which safetensors requires.
    tensors = {name: p.detach().cpu().contiguous() for name, p in model.named_parameters()}
    for name, buffer in model.named_buffers():
        if _is_persistent(model, name):
            tensors[f"buffer/{name}"] = buffer.detach().cpu().contiguous()
    return tensors


def _is_persistent(model: torch.nn.Module, name: str) -> bool:
    module_name, _, buffer_name = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    return buffer_name not in module._non_persistent_buffers_set


def _optimizer_tensors(
    optimizer: torch.optim.Optimizer, names: list[str]
) -> dict[str, torch.Tensor]:
    state = optimizer.state_dict()["state"]
    tensors = {}
    for index, values in state.items():
        for key, value in values.items():
            value = value if torch.is_tensor(value) else torch.tensor(value)
            tensors[f"{names[index]}/{key}"] = value.detach().cpu().contiguous()
    return tensors


def _param_groups(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    groups = []
    for group in optimizer.state_dict()["param_groups"]:
        groups.append({k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items()})
    return groups


def _rng_tensors() -> dict[str, torch.Tensor]:
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for device, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{device}"] = state
    tensors["numpy_keys"] = torch.from_numpy(np.random.get_state()[1].astype(np.int64))
    return tensors


def _rng_json() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    _, _, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": [version, list(internal), gauss],
        "numpy": {"pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
    }


def _write_index(directory: Path, tensors: dict[str, dict[str, torch.Tensor]], step: int) -> None:
    files = {}
    for path in sorted(directory.iterdir()):
        files[path.name] = {"sha256": sha256_of_file(str(path)), "bytes": path.stat().st_size}
    index = {
        "format": INDEX_FORMAT,
        "version": INDEX_VERSION,
        "step": step,  # the identity the signature covers (older indexes: state.json's)
        "files": files,
        "tensors": {
            file: {
                name: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
                for name, t in content.items()
            }
            for file, content in tensors.items()
        },
    }
    (directory / "index.json").write_text(json.dumps(index, indent=2))


def _prune(root: Path, step: int, keep_last: int) -> None:
    """Keep the newest ``keep_last`` checkpoints up to ``step``, the one just written.

    Later ones are left alone: they belong to an earlier run in the same directory, or
    to a save that was killed before it could update latest.json; either way they are
    not older than the current checkpoint, and the run overwrites them as it gets there.
    """
    complete = {}
    for path in root.glob("step-*"):
        number = path.name.removeprefix("step-")
        if path.is_dir() and number.isdigit() and int(number) <= step:
            complete[int(number)] = path
    for old in sorted(complete)[:-keep_last]:
        shutil.rmtree(complete[old], ignore_errors=True)


# --------------------------------------------------------------------------- load


def latest_checkpoint(root: str | Path) -> Path | None:
    root = Path(root)
    pointer = root / "latest.json"
    if not pointer.exists() and not pointer.is_symlink():
        return _newest_complete(root)
    path = root / read_latest_pointer(pointer)[1]
    if path.is_symlink():
        raise CheckpointError(f"{pointer} points to {path}, a symbolic link; expected a folder")
    if not path.is_dir():
        raise CheckpointError(f"{pointer} points to {path}, which does not exist")
    return path


def read_latest_pointer(pointer: str | Path, data: bytes | None = None) -> tuple[int, str]:
    """``(step, folder name)`` of a ``latest.json`` (read here unless its ``data`` is
    given), refused unless the name is ``step-N`` of that very step."""
    try:
        if data is None:
            data = safe_read.read_bytes_bounded(pointer, 64 << 10, allow_symlink=False)
        record = safe_read.loads_json(data, str(pointer))
        step = safe_read.field(record, "step", int, str(pointer), minimum=0)
        name = safe_read.confined_name(record.get("path"), str(pointer), "path")
    except safe_read.UnsafeFileError as exc:
        raise CheckpointError(
            f"{pointer}: not a valid pointer to the latest checkpoint ({exc})"
        ) from None
    if name != step_dir_name(step):
        raise CheckpointError(
            f"{pointer}: step {step} but path {name!r}; expected {step_dir_name(step)!r} "
            "(the pointer was edited, or an older checkpoint renamed)"
        )
    return step, name


def _newest_complete(root: Path) -> Path | None:
    """A kill between renaming a checkpoint into place and writing latest.json leaves
    no pointer: fall back to the newest complete step directory (one with an index)."""
    complete = [
        p
        for p in root.glob("step-*")
        if not p.is_symlink() and p.is_dir() and (p / "index.json").is_file()
    ]
    complete = [p for p in complete if p.name.removeprefix("step-").isdigit()]
    return max(complete, key=lambda p: int(p.name.removeprefix("step-")), default=None)


def verify_checkpoint(path: str | Path, require_signature: bool = False) -> dict[str, Any]:
    """Check the signature (when required or present and the key is set), then every
    file against index.json and the step against the folder's name; returns the index."""
    return verify_checkpoint_state(path, require_signature)[0]


def verify_checkpoint_state(
    path: str | Path, require_signature: bool = False
) -> tuple[dict[str, Any], dict[str, Any]]:
    """:func:`verify_checkpoint`, also returning state.json parsed from its hashed bytes."""
    path = Path(path)
    index = read_signed_index(path, require_signature)
    index_path = path / "index.json"
    check_index_tables(index, index_path)
    for name, expected in index["files"].items():
        _check_file(path / name, expected)
    for required in (*TENSOR_FILES, "state.json"):
        if required not in index["files"]:
            raise CheckpointError(f"{index_path}: does not list {required}")
    state = read_verified_json(path / "state.json", index)
    check_state(state, str(path / "state.json"))
    step = state.get("step")
    if "step" in index and index["step"] != step:
        raise CheckpointError(
            f"{path}: index.json says step {brief(index['step'])}, state.json {brief(step)}"
        )
    check_step(path, step)
    return index, state


def read_signed_index(path: Path, require_signature: bool) -> dict[str, Any]:
    """index.json's bytes, read once (bounded, a regular file, no symbolic link), their
    signature checked, then parsed: the bytes checked are the bytes used."""
    index_path = path / "index.json"
    try:
        data = safe_read.read_bytes_bounded(index_path, MAX_INDEX_BYTES, allow_symlink=False)
    except FileNotFoundError:
        raise CheckpointError(
            f"{index_path} is missing: {path} is not a complete checkpoint"
        ) from None
    except safe_read.UnsafeFileError as exc:
        raise CheckpointError(str(exc)) from None
    try:
        check_signature_bytes(
            read_signature(path),
            "index.json",
            data,
            require_signature,
            str(path / "signature.json"),
        )
        index = safe_read.loads_json(data, str(index_path))
    except (SignatureError, safe_read.UnsafeFileError) as exc:
        raise CheckpointError(str(exc)) from None
    if not isinstance(index, dict):
        raise CheckpointError(f"{index_path}: expected a JSON object at the top")
    return index


def check_index_tables(index: dict[str, Any], index_path: Path) -> None:
    """v1's ``files`` and ``tensors`` tables are of the shapes the loaders index into."""
    if index.get("format") != INDEX_FORMAT or index.get("version") != INDEX_VERSION:
        raise CheckpointError(
            f"{index_path}: not a Megalith checkpoint index (version {INDEX_VERSION})"
        )
    files, tensors = index.get("files"), index.get("tensors")
    if not isinstance(files, dict) or not isinstance(tensors, dict):
        raise CheckpointError(f"{index_path}: has no 'files' and 'tensors' tables")
    for name, expected in files.items():
        _safe_name(name, index_path)
        check_file_entry(expected, f"{index_path}: files[{name!r}]")
    for file, content in tensors.items():
        _safe_name(file, index_path)
        if not isinstance(content, dict):
            raise CheckpointError(f"{index_path}: tensors[{file!r}] is not an object")
        for name, meta in content.items():
            shape = meta.get("shape") if isinstance(meta, dict) else None
            if len(name) > MAX_TENSOR_NAME:
                raise CheckpointError(
                    f"{index_path}: tensor name {brief(name)} is longer than {MAX_TENSOR_NAME}"
                )
            if (
                not isinstance(shape, list)
                or not all(isinstance(n, int) and not isinstance(n, bool) for n in shape)
                or not isinstance(meta.get("dtype"), str)
            ):
                raise CheckpointError(
                    f"{index_path}: tensor {brief(name)} of {file}: expected a 'shape' list of "
                    "integers and a 'dtype' string"
                )


def check_file_entry(entry: Any, where: str) -> None:
    """One ``files`` entry: ``{"bytes": int >= 0, "sha256": 64 hex digits}``."""
    try:
        safe_read.field(entry, "bytes", int, where, minimum=0)
        digest = safe_read.field(entry, "sha256", str, where)
    except safe_read.UnsafeFileError as exc:
        raise CheckpointError(str(exc)) from None
    if not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise CheckpointError(f"{where}: 'sha256' is not 64 lowercase hex digits")


def _check_file(file: Path, expected: dict[str, Any]) -> None:
    if file.is_symlink():
        raise CheckpointError(f"{file}: a symbolic link; checkpoint files must be regular files")
    if not file.exists():
        raise CheckpointError(f"{file}: missing (listed in index.json)")
    if not file.is_file():
        raise CheckpointError(f"{file}: not a regular file (a device, pipe or folder)")
    if file.stat().st_size != expected["bytes"]:
        raise CheckpointError(
            f"{file}: {file.stat().st_size} bytes, index.json says {expected['bytes']}"
        )
    if sha256_of_file(str(file)) != expected["sha256"]:
        raise CheckpointError(f"{file}: sha256 does not match index.json (modified or corrupted)")


def read_verified_json(file: Path, index: dict[str, Any]) -> dict[str, Any]:
    """A JSON object file of a checkpoint, parsed from bytes whose size and sha256 match
    the index: read at most the listed size (never a symlink or a device), then hashed."""
    expected = index["files"].get(file.name)
    if expected is None:
        raise CheckpointError(f"{file}: not listed in index.json")
    limit = min(expected["bytes"], MAX_STATE_BYTES)
    try:
        data = safe_read.read_bytes_bounded(file, limit, allow_symlink=False)
        if len(data) != expected["bytes"] or hashlib.sha256(data).hexdigest() != expected["sha256"]:
            raise CheckpointError(
                f"{file}: size or sha256 does not match index.json (modified or corrupted)"
            )
        value = safe_read.loads_json(data, str(file))
    except FileNotFoundError:
        raise CheckpointError(f"{file}: missing (listed in index.json)") from None
    except safe_read.UnsafeFileError as exc:
        raise CheckpointError(str(exc)) from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{file}: expected a JSON object")
    return value


Number = StrictInt | StrictFloat


class _Loose(BaseModel):
    model_config = ConfigDict(extra="allow")


class _NumpyRng(_Loose):
    pos: StrictInt = Field(ge=0, le=624)
    has_gauss: StrictInt
    cached_gaussian: Number


class _Rng(_Loose):
    python: tuple[StrictInt, list[StrictInt], Number | None]
    numpy: _NumpyRng
    numpy_keys: list[StrictInt] | None = Field(default=None, min_length=624, max_length=624)
    torch_cpu: StrictStr | None = None
    torch_cuda: StrictStr | None = None


class _Optimizer(_Loose):  # each group's settings: saved_param_groups, against the optimizer
    param_groups: list[dict[str, Any]]
    param_names: list[StrictStr] | None = None


class _Scaler(_Loose):
    scale: Number
    growth_factor: Number
    backoff_factor: Number
    growth_interval: StrictInt
    growth_tracker: StrictInt = Field(alias="_growth_tracker")


class _State(_Loose):
    """What the loaders read from state.json; the rest (config, layout) is kept as is."""

    step: StrictInt = Field(ge=0)
    consumed_samples: StrictInt = Field(ge=0)
    optimizer: _Optimizer
    rng: _Rng
    scaler: _Scaler | None = None
    config: dict[str, Any] | None = None
    model_config_: dict[str, Any] | None = Field(default=None, alias="model_config")


def check_state(state: dict[str, Any], where: str) -> None:
    """state.json's fields are of the types the loaders restore (types only: a crafted
    one names its first bad key instead of failing inside torch, numpy or random)."""
    try:
        _State.model_validate(state)
    except ValidationError as exc:
        first = exc.errors()[0]
        key = ".".join(str(part) for part in first["loc"]) or "(root)"
        raise CheckpointError(f"{where}: key {brief(key, 80)}: {first['msg']}") from None
    if len(state["rng"]["python"][1]) != 625:
        raise CheckpointError(f"{where}: key rng.python: not a Python random state")


def check_step(path: str | Path, step: Any) -> None:
    """A checkpoint in a ``step-N`` folder must hold step N (its signed identity): a
    mismatch is an older checkpoint copied or renamed over a newer one."""
    name = str(path).rstrip("/").rsplit("/", 1)[-1]
    match = _STEP_DIR.fullmatch(name)
    if not isinstance(step, int) or isinstance(step, bool):
        raise CheckpointError(f"{path}: its index and state.json name no integer step")
    if match and int(match.group(1)) != step:
        raise CheckpointError(
            f"{path}: holds step {step}, but its folder names step {int(match.group(1))}: "
            "an older checkpoint was copied or renamed over this one; refusing it"
        )


def load_checkpoint(
    path: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    param_names: list[str],
    scaler: torch.amp.GradScaler | None = None,
    restore_rng: bool = True,
    shard: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
    require_signature: bool = False,
) -> dict[str, Any]:
    """Restore model, optimizer, loss scaler and RNG from a verified checkpoint; returns state.json.

    ``shard(param_name, whole_tensor)`` gives this rank's part of a saved tensor (a
    parameter or one of its optimizer moments), for a model split by tensor parallelism.
    """
    path = Path(path)
    index, state = verify_checkpoint_state(path, require_signature=require_signature)
    model_tensors = read_checkpoint_tensors(path / "model.safetensors", index)
    if shard is not None:
        model_tensors = {name: shard(name, t) for name, t in model_tensors.items()}
    load_model_tensors(model, model_tensors, path)
    if optimizer is not None:
        moments = read_checkpoint_tensors(path / "optimizer.safetensors", index)
        if shard is not None:
            moments = {key: shard(key.rpartition("/")[0], t) for key, t in moments.items()}
        _load_optimizer(
            optimizer,
            moments,
            state,
            param_names,
            path,
        )
    if scaler is not None and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    if restore_rng:
        restore_rng_state(read_checkpoint_tensors(path / "rng.safetensors", index), state["rng"])
    return state


def check_tensor_file(file: Path, index: dict[str, Any]) -> dict[str, tuple[list[int], str]]:
    """Check ``file``'s safetensors header (sizes bounded, see :mod:`training.checkpoint.safe_tensors`)
    against index.json's names, shapes and dtypes without reading any tensor."""
    expected = index["tensors"].get(file.name, {})
    try:  # bound every size and compare with the index before anything is allocated
        header = check_safetensors(file)
    except UnsafeTensorFileError as exc:
        raise CheckpointError(str(exc)) from None
    if set(header) != set(expected):
        raise CheckpointError(
            f"{file}: tensor names differ from index.json (missing "
            f"{brief(sorted(set(expected) - set(header))[:5], 300)}, unexpected "
            f"{brief(sorted(set(header) - set(expected))[:5], 300)})"
        )
    for name, (shape, dtype) in header.items():
        if {"shape": shape, "dtype": dtype} != expected[name]:
            raise CheckpointError(
                f"{file}: tensor {name} is {dtype}{shape}, index.json says "
                f"{brief(expected[name], 300)}"
            )
    return header


def read_checkpoint_tensors(file: Path, index: dict[str, Any]) -> dict[str, torch.Tensor]:
    expected = index["tensors"].get(file.name, {})
    check_tensor_file(file, index)
    tensors = {}
    with safe_open(str(file), framework="pt") as handle:
        if set(handle.keys()) != set(expected):
            raise CheckpointError(f"{file}: tensor names differ from index.json")
        for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
            tensor = handle.get_tensor(name)
            meta = expected[name]
            if (
                list(tensor.shape) != meta["shape"]
                or str(tensor.dtype).removeprefix("torch.") != meta["dtype"]
            ):
                raise CheckpointError(
                    f"{file}: tensor {name} is {tuple(tensor.shape)} {tensor.dtype}, index.json says {meta}"
                )
            tensors[name] = tensor
    return tensors


def load_model_tensors(
    model: torch.nn.Module, tensors: dict[str, torch.Tensor], path: Path
) -> None:
    params = dict(model.named_parameters())
    expected = set(params) | {
        f"buffer/{n}" for n, _ in model.named_buffers() if _is_persistent(model, n)
    }
    if set(tensors) != expected:
        missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
        raise CheckpointError(
            f"{path}: model tensors do not match the model (missing {missing[:5]}, unexpected {extra[:5]})"
        )
    buffers = dict(model.named_buffers())
    targets = {
        name: buffers[name.removeprefix("buffer/")] if name.startswith("buffer/") else params[name]
        for name in tensors
    }
    # Check every shape before copying any, so a refused checkpoint leaves the model as it was.
    for name, tensor in tensors.items():
        if targets[name].shape != tensor.shape:
            raise CheckpointError(
                f"{path}: {name} has shape {tuple(tensor.shape)}, the model expects {tuple(targets[name].shape)}"
            )
    with torch.no_grad():
        for name, tensor in tensors.items():
            targets[name].copy_(_like(targets[name], tensor))


def _load_optimizer(optimizer, tensors, state, param_names, path) -> None:
    where = f"{path}/state.json"
    record = safe_read.field(state, "optimizer", dict, where)
    if safe_read.field(record, "param_names", list, where) != param_names:
        raise CheckpointError(f"{path}: optimizer parameters differ from the model's")
    saved = saved_param_groups(state, optimizer, where)
    if [group.get("params") for group in saved] != optimizer_group_indices(optimizer):
        raise CheckpointError(f"{path}: optimizer parameter groups differ from the model's")
    per_param: dict[int, dict[str, torch.Tensor]] = {}
    position = {name: i for i, name in enumerate(param_names)}
    for key, tensor in tensors.items():
        name, _, state_key = key.rpartition("/")
        if name not in position:
            raise CheckpointError(f"{path}: optimizer tensor {brief(key)} names no parameter")
        per_param.setdefault(position[name], {})[state_key] = tensor
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, values in per_param.items():
        for key, tensor in values.items():
            if tensor.shape == params[index].shape:  # moments, not the step count
                values[key] = _like(params[index], tensor)
    optimizer.load_state_dict({"state": per_param, "param_groups": saved})


KERNEL_SETTINGS = ("fused", "foreach", "capturable", "differentiable")  # how, not what


def saved_param_groups(state: Any, optimizer, where: str) -> list[dict[str, Any]]:
    """state.json's optimizer groups, one per group of ``optimizer``, each setting typed like
    the live optimizer's (a string ``lr`` or a NaN ``eps`` would fail the first step, or
    train on garbage). Settings the live groups lack are dropped, ``params`` kept, and the
    kernel switches (:data:`KERNEL_SETTINGS`) stay this process's: a checkpoint saved by a
    CPU run would otherwise turn a GPU run's fused step off, and with it the clipping
    folded into the step."""
    record = safe_read.field(state, "optimizer", dict, where)
    groups = safe_read.field(record, "param_groups", list, where)
    if len(groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"{where}: {len(groups)} optimizer parameter groups, this model's optimizer has "
            f"{len(optimizer.param_groups)}"
        )
    checked = []
    for number, (saved, live) in enumerate(zip(groups, optimizer.param_groups, strict=True)):
        if not isinstance(saved, dict):
            raise CheckpointError(f"{where}: optimizer group {number} is {brief(saved)}")
        group = {
            key: value if key in KERNEL_SETTINGS else saved.get(key, value)
            for key, value in live.items()
            if key != "params"
        }
        for key, value in group.items():
            if not _same_kind(value, live[key]):
                raise CheckpointError(
                    f"{where}: optimizer group {number} {key} is {brief(value)}; expected "
                    f"{brief(live[key])}'s kind"
                )
        checked.append({**group, "params": saved.get("params")})
    return checked


def _same_kind(value: Any, like: Any) -> bool:
    if isinstance(like, bool) or like is None:  # switches such as fused: None, True, False
        return value is None or isinstance(value, bool)
    if isinstance(like, (int, float)):
        return (
            isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        )
    if isinstance(like, (list, tuple)):
        return (
            isinstance(value, (list, tuple))
            and len(value) == len(like)
            and all(_same_kind(v, w) for v, w in zip(value, like, strict=True))
        )
    return isinstance(value, type(like))


def _like(target: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """A whole saved tensor in the target's layout: this rank's shard when the target is
    a DTensor (FSDP), computed locally from the whole tensor every rank has read."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(target, DTensor):
        return tensor
    return distribute_tensor(
        tensor.to(target.device), target.device_mesh, target.placements, src_data_rank=None
    )


def optimizer_group_indices(optimizer) -> list[list[int]]:
    """Each group's parameter positions as ``state_dict()`` numbers them, without calling it
    (a sharded optimizer's ``state_dict`` is collective)."""
    indices, start = [], 0
    for group in optimizer.param_groups:
        indices.append(list(range(start, start + len(group["params"]))))
        start += len(group["params"])
    return indices


def restore_rng_state(tensors: dict[str, torch.Tensor], saved: dict[str, Any]) -> None:
    """Every generator from a checkpoint; a state of the wrong size or kind (a crafted
    rng.safetensors or state.json) is a CheckpointError, not torch's or numpy's."""
    try:
        _restore_rng_state(tensors, saved)
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise CheckpointError(
            f"the checkpoint's RNG state is not one this version writes: {brief(str(exc), 120)}"
        ) from None


def _restore_rng_state(tensors: dict[str, torch.Tensor], saved: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    if torch.cuda.is_available() and "torch_cuda_0" in tensors:
        # Rank 0 wrote every device's generator, but only its own (device 0) advanced;
        # every rank draws alike, so that state is this rank's device's.
        torch.cuda.set_rng_state(tensors["torch_cuda_0"])
    version, internal, gauss = saved["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy = saved["numpy"]
    keys = tensors["numpy_keys"].numpy().astype(np.uint32)
    np.random.set_state(
        ("MT19937", keys, numpy["pos"], numpy["has_gauss"], numpy["cached_gaussian"])
    )


def _safe_name(name: str, source: Path) -> str:
    try:
        return safe_read.confined_name(name, str(source))
    except safe_read.UnsafeFileError as exc:
        raise CheckpointError(str(exc)) from None
