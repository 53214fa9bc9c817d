"""Model packages: one directory holding everything needed to run a trained model.

::

    model.safetensors   every tensor of the state dict once (tied aliases left out), contiguous
    config.json         {"format", "format_version", "megalith_version", "dtype",
                         "model": ModelConfig, "tokenizer": {"file", "id", "kind"},
                         "lineage": {tag: value} of a fine-tune (optional),
                         "training_data": {"manifests", "manifest_sha256", "split", "seed"}
                         of a trained model (optional: packages before it, imports)}
    tokenizer.model     the SentencePiece model, or
    tokenizer.json      the Hugging Face tokenizer ("kind" sentencepiece or hf); its id is
                        the sha256 of its bytes
    checksums.json      {"files": {name: sha256}} for each file above

Saving writes a temporary sibling directory and renames it into place. Loading
checks every sha256 first, then validates ``config.json`` through ``ModelConfig``,
then compares the safetensors header (names, shapes, dtypes) with the model before
reading any tensor. Nothing is unpickled: JSON and safetensors only.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from megalith import __version__, safe_read
from megalith.config import DataConfig, ModelConfig, format_validation_error
from megalith.errors import MegalithError, naming_path
from megalith.storage import sha256_of_file
from preprocessing.tokenizer import (
    HFTokenizer,
    SentencePieceTokenizer,
    TokenizerError,
    load_tokenizer,
)
from training.checkpoint.safe_tensors import UnsafeTensorFileError, check_safetensors
from training.checkpoint.signing import (
    SIGNATURE_FILE,
    SignatureError,
    check_signature_bytes,
    read_signature,
    should_sign,
    sign_directory,
)
from training.models.gpt import GPTModel
from training.models.t5 import T5Model
from training.models.weights_check import WeightsMismatchError, checked_meta_model

PACKAGE_FORMAT = "megalith-model-package"
FORMAT_VERSION = 1
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.model"  # a package written before tokenizer.json names none
TOKENIZER_FILES = (SentencePieceTokenizer.file_name, HFTokenizer.file_name)
CHECKSUMS_FILE = "checksums.json"
REQUIRED_FILES = (WEIGHTS_FILE, CONFIG_FILE)  # and the tokenizer file config.json names
MAX_JSON_BYTES = 1 << 20

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
SAFETENSORS_NAMES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


class ModelPackageError(MegalithError):
    """A model package that cannot be used; the message names the file at fault."""


class PackageFileError(ModelPackageError):
    """A file that is missing, unreadable, not a plain file, or not listed in checksums.json."""


class PackageChecksumError(ModelPackageError):
    """A file whose sha256 differs from the one in checksums.json."""


class PackageConfigError(ModelPackageError):
    """A config.json (or checksums.json) that is not what this version writes."""


class PackageTensorError(ModelPackageError):
    """Tensors whose names, shapes or dtypes do not match the model the config describes."""


@dataclass(frozen=True)
class TrainingData:
    """What a model trained on: its shard sets (manifest URLs and the sha256 of each
    manifest, the shard set's content id) and the train/valid/test shares that decided
    which documents it saw (``seed`` orders samples; it does not move documents)."""

    manifests: tuple[str, ...]
    manifest_sha256: tuple[str, ...]
    split: tuple[float, float, float]
    seed: int

    @classmethod
    def of(cls, data: DataConfig) -> TrainingData:
        urls = tuple(source.record_file for source in data.training_sources())
        digests = tuple(sha256_of_file(url, data.storage_options) for url in urls)
        return cls(urls, digests, tuple(data.split), data.seed)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def model_tensors(model: nn.Module) -> dict[str, Tensor]:
    """The state dict to save: tied aliases left out, every tensor detached and contiguous."""
    aliases = model.tied_weights
    return {
        name: tensor.detach().contiguous()
        for name, tensor in model.state_dict().items()
        if name not in aliases
    }


def sha256_file(path: Path) -> str:
    return sha256_of_file(str(path))


def save_model_package(
    model: GPTModel | T5Model,
    config: ModelConfig,
    tokenizer_path: str | Path,
    out_dir: str | Path,
    *,
    overwrite: bool = False,
    sign: bool | None = None,
    lineage: dict[str, str] | None = None,
    training_data: TrainingData | None = None,
) -> Path:
    """Write ``model`` as a package at ``out_dir`` (atomically: temp dir, then rename).

    ``tokenizer_path``: any tokenizer :func:`~preprocessing.tokenizer.load_tokenizer` reads;
    the package keeps its bytes as ``tokenizer.model`` or ``tokenizer.json`` (a GPT-2
    vocab.json + merges.txt pair as the ``tokenizer.json`` built from them).
    ``sign``: HMAC-sign checksums.json (:mod:`training.checkpoint.signing`); None: when the key is set.
    ``lineage``: what the model was made from (a fine-tune's base and data,
    :mod:`training.finetune`), kept as config.json's ``"lineage"``. ``training_data``:
    the shard sets and split it trained on, so evaluation can hold out the same documents.
    """
    out_dir = Path(out_dir)
    tokenizer_path = Path(tokenizer_path)
    kernels = {"backend"}  # a run may build auto's kernels as torch or te: same weights
    if config.model_dump(exclude=kernels) != model.config.model_dump(exclude=kernels):
        raise ValueError("config does not describe this model (differs from model.config)")
    if not tokenizer_path.is_file():
        raise PackageFileError(f"tokenizer {tokenizer_path} is not a file")
    tokenizer_name, tokenizer_bytes, tokenizer_kind = _tokenizer_to_store(tokenizer_path)
    if out_dir.exists() and not overwrite:
        raise PackageFileError(f"{out_dir} already exists (pass overwrite=True to replace it)")
    dtype = _model_dtype(model)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        tensors = {name: t.cpu() for name, t in model_tensors(model).items()}
        with naming_path(out_dir / WEIGHTS_FILE):  # a full disk: one line naming the file
            save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / tokenizer_name).write_bytes(tokenizer_bytes)
        meta = {
            "format": PACKAGE_FORMAT,
            "format_version": FORMAT_VERSION,
            "megalith_version": __version__,
            "dtype": dtype,
            "model": config.model_dump(mode="json"),
            "tokenizer": {
                "file": tokenizer_name,
                "id": sha256_file(tmp / tokenizer_name),
                "kind": tokenizer_kind,
            },
        }
        if lineage:
            meta["lineage"] = dict(lineage)
        if training_data is not None:
            meta["training_data"] = training_data.to_json()
        _write_json(tmp / CONFIG_FILE, meta)
        files = (*REQUIRED_FILES, tokenizer_name)
        checksums = {name: sha256_file(tmp / name) for name in files}
        _write_json(tmp / CHECKSUMS_FILE, {"files": checksums})
        if should_sign(sign):
            sign_directory(tmp, CHECKSUMS_FILE)
        for name in (*files, CHECKSUMS_FILE):
            _fsync(tmp / name)
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _tokenizer_to_store(path: Path) -> tuple[str, bytes, str]:
    """``(file name in the package, bytes, kind)``: a ``.json`` tokenizer (a tokenizer.json,
    a GPT-2 *vocab.json + *merges.txt) is loaded, checked and stored as its tokenizer.json;
    anything else is a SentencePiece model, copied as it is (read when the package is used)."""
    if path.suffix != ".json":
        return SentencePieceTokenizer.file_name, path.read_bytes(), SentencePieceTokenizer.kind
    try:
        tokenizer = load_tokenizer(str(path))
    except TokenizerError as exc:
        raise PackageFileError(str(exc)) from None
    return tokenizer.file_name, tokenizer.model_bytes, tokenizer.kind


def verify_model_package(
    package_dir: str | Path, require_signature: bool = False
) -> dict[str, Any]:
    """Check the signature (see :func:`training.checkpoint.signing.check_signature`), every file's
    sha256 and config.json; returns config.json's content."""
    package_dir = Path(package_dir)
    if not package_dir.is_dir():
        raise PackageFileError(f"model package {package_dir} is not a directory")
    checksums = _read_checksums(package_dir, require_signature)
    for name, expected in checksums.items():
        actual = sha256_file(_plain_file(package_dir, name))
        if actual != expected:
            raise PackageChecksumError(
                f"{package_dir / name}: sha256 {actual} does not match {expected} in "
                f"{CHECKSUMS_FILE}; the file was changed or damaged"
            )
    meta = _read_meta(package_dir)
    name = tokenizer_file(meta, package_dir)
    if name not in checksums:
        raise PackageFileError(
            f"{package_dir / CHECKSUMS_FILE}: {name} is not listed; the package is incomplete"
        )
    tokenizer_id = sha256_file(package_dir / name)
    if meta["tokenizer"].get("id") != tokenizer_id:
        raise PackageConfigError(
            f"{package_dir / CONFIG_FILE}: tokenizer id does not match {name} "
            f"(sha256 {tokenizer_id})"
        )
    return meta


def package_tokenizer_path(package_dir: str | Path) -> Path:
    """The tokenizer file of a package (``tokenizer.model`` or ``tokenizer.json``), as its
    config.json names it; nothing else is checked."""
    package_dir = Path(package_dir)
    return package_dir / tokenizer_file(_read_meta(package_dir), package_dir)


def tokenizer_file(meta: dict[str, Any], package_dir: Path) -> str:
    """The tokenizer's file name in a package, from its config.json (``meta``)."""
    name = meta["tokenizer"].get("file", TOKENIZER_FILE)
    if name not in TOKENIZER_FILES:
        raise PackageConfigError(
            f"{package_dir / CONFIG_FILE}: tokenizer file {safe_read.brief(name)} is not one of "
            f"{list(TOKENIZER_FILES)}"
        )
    return name


def load_model_package(
    package_dir: str | Path,
    device: torch.device | str = "cpu",
    *,
    dtype: torch.dtype | None = None,
    require_signature: bool = False,
) -> tuple[GPTModel | T5Model, ModelConfig, Path]:
    """Verify and load a package; returns ``(model in eval mode, config, tokenizer path)``:
    a :class:`GPTModel` or :class:`T5Model` by the config's ``family``.

    The model is built in the dtype it was saved in, then cast to ``dtype`` if given.
    """
    package_dir = Path(package_dir)
    meta = verify_model_package(package_dir, require_signature=require_signature)
    config, model = _checked_meta_model(package_dir, meta)
    weights_path = package_dir / WEIGHTS_FILE
    try:
        tensors = load_file(str(weights_path), device=str(device))
    except SafetensorError as exc:
        raise PackageTensorError(f"{weights_path}: cannot read tensors: {exc}") from None

    model.to_empty(device=device)
    model.tie_weights()
    for alias, source in model.tied_weights.items():
        tensors[alias] = tensors[source]
    model.load_state_dict(tensors, strict=True)
    if dtype is not None:
        model.to(dtype)
    return model.eval(), config, package_dir / tokenizer_file(meta, package_dir)


def read_training_data(package_dir: str | Path) -> TrainingData | None:
    """The shard sets and split a package's model trained on; ``None`` if it records none
    (written before packages recorded it, or imported from another framework)."""
    path = Path(package_dir) / CONFIG_FILE
    record = safe_read.field(
        _read_meta(Path(package_dir)), "training_data", dict, str(path), default=None
    )
    if record is None:
        return None
    source = f"{path}: training_data"
    manifests = safe_read.field(record, "manifests", list, source)
    digests = safe_read.field(record, "manifest_sha256", list, source)
    split = safe_read.field(record, "split", list, source)
    if (
        len(manifests) != len(digests)
        or not all(isinstance(v, str) for v in (*manifests, *digests))
        or len(split) != 3
        or not all(isinstance(v, int | float) and not isinstance(v, bool) and v >= 0 for v in split)
    ):
        raise PackageConfigError(
            f"{source}: expected manifests and manifest_sha256 (strings, one per shard set) "
            "and three non-negative split shares"
        )
    seed = safe_read.field(record, "seed", int, source)
    return TrainingData(tuple(manifests), tuple(digests), tuple(map(float, split)), seed)


def read_package_model_config(package_dir: str | Path) -> ModelConfig:
    """The architecture a package holds, from its ``config.json`` alone (no weights read)."""
    path = Path(package_dir) / CONFIG_FILE
    try:
        return ModelConfig.model_validate(_read_meta(Path(package_dir))["model"])
    except ValidationError as exc:
        raise PackageConfigError(format_validation_error(exc, f"{path}: model")) from None


def verify_package_weights(package_dir: str | Path, meta: dict[str, Any]) -> None:
    """Check model.safetensors' header (bounded sizes, names, shapes, dtypes) against the
    model ``meta`` (config.json, from :func:`verify_model_package`) describes, reading no tensor."""
    _checked_meta_model(Path(package_dir), meta)


def _checked_meta_model(
    package_dir: Path, meta: dict[str, Any]
) -> tuple[ModelConfig, GPTModel | T5Model]:
    """The config and its model on the meta device, once the config is valid (sizes within
    the schema's limits) and agrees with model.safetensors' header: block counts and
    embedding before the model is built, then every tensor's name, shape and dtype."""
    config_path = package_dir / CONFIG_FILE
    try:
        config = ModelConfig.model_validate(meta["model"])
    except ValidationError as exc:
        raise PackageConfigError(format_validation_error(exc, f"{config_path}: model")) from None
    weights_path = package_dir / WEIGHTS_FILE
    header = _read_header(weights_path)
    shapes = {name: shape for name, (shape, _) in header.items()}
    try:
        model = checked_meta_model(config, shapes, f"{config_path} and {weights_path}")
    except WeightsMismatchError as exc:
        raise PackageTensorError(str(exc)) from None
    model.to(DTYPES[meta["dtype"]])
    _check_dtypes(weights_path, header, model)
    return config, model


def _read_header(path: Path) -> dict[str, tuple[list[int], str]]:
    """``{name: (shape, safetensors dtype)}``: our own bounded header check, so nothing is
    allocated before sizes are known sound."""
    try:
        return {
            name: (shape, SAFETENSORS_NAMES.get(dtype, dtype))
            for name, (shape, dtype) in check_safetensors(path).items()
        }
    except UnsafeTensorFileError as exc:
        raise PackageTensorError(str(exc)) from None


def _check_dtypes(path: Path, header: dict[str, tuple[list[int], str]], model: nn.Module) -> None:
    for name, tensor in model_tensors(model).items():
        want = SAFETENSORS_DTYPES[tensor.dtype]
        if header[name][1] != want:
            raise PackageTensorError(
                f"{path}: tensor {name} is {header[name][1]}, the package's dtype is {want}"
            )


def _read_checksums(package_dir: Path, require_signature: bool) -> dict[str, str]:
    """checksums.json from bytes read once, whose signature is checked over those very
    bytes before they are parsed (no swap between the check and the use)."""
    path = package_dir / CHECKSUMS_FILE
    try:
        raw = safe_read.read_bytes_bounded(path, MAX_JSON_BYTES, allow_symlink=False)
        check_signature_bytes(
            read_signature(package_dir), CHECKSUMS_FILE, raw, require_signature,
            str(package_dir / SIGNATURE_FILE),
        )  # fmt: skip
        data = safe_read.loads_json(raw, str(path))
    except FileNotFoundError:
        raise PackageFileError(f"{path}: missing; the package is incomplete") from None
    except SignatureError as exc:
        raise ModelPackageError(str(exc)) from None
    except safe_read.UnsafeFileError as exc:
        raise PackageConfigError(str(exc)) from None
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in files.items()
    ):
        raise PackageConfigError(f'{path}: expected {{"files": {{name: sha256}}}}')
    for name in files:
        if name in (".", "..") or Path(name).name != name or "\\" in name:
            raise PackageConfigError(f"{path}: {name!r} is not a plain file name in the package")
    for name in REQUIRED_FILES:
        if name not in files:
            raise PackageFileError(f"{path}: {name} is not listed; the package is incomplete")
    return files


def _read_meta(package_dir: Path) -> dict[str, Any]:
    path = package_dir / CONFIG_FILE
    meta = _read_json(path)
    if not isinstance(meta, dict) or meta.get("format") != PACKAGE_FORMAT:
        raise PackageConfigError(f"{path}: not a {PACKAGE_FORMAT} config")
    if meta.get("format_version") != FORMAT_VERSION:
        raise PackageConfigError(
            f"{path}: format_version {meta.get('format_version')!r}; this version reads "
            f"{FORMAT_VERSION}"
        )
    if meta.get("dtype") not in DTYPES:
        raise PackageConfigError(
            f"{path}: dtype {meta.get('dtype')!r} is not one of {list(DTYPES)}"
        )
    if not isinstance(meta.get("model"), dict) or not isinstance(meta.get("tokenizer"), dict):
        raise PackageConfigError(f"{path}: expected 'model' and 'tokenizer' sections")
    return meta


def _plain_file(package_dir: Path, name: str) -> Path:
    path = package_dir / name
    if path.is_symlink() or not path.is_file():
        raise PackageFileError(f"{path}: missing or not a plain file; the package is incomplete")
    return path


def _read_json(path: Path) -> dict[str, Any]:
    _plain_file(path.parent, path.name)
    try:
        return safe_read.read_json(path, MAX_JSON_BYTES, allow_symlink=False, expect=dict)
    except safe_read.UnsafeFileError as exc:
        raise PackageConfigError(str(exc)) from None


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_dir(tmp: Path, out_dir: Path) -> None:
    if not out_dir.exists():
        tmp.rename(out_dir)
        return
    old = out_dir.parent / f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}"
    out_dir.rename(old)
    tmp.rename(out_dir)
    shutil.rmtree(old, ignore_errors=True)


def _model_dtype(model: nn.Module) -> str:
    dtypes = {p.dtype for p in model.parameters()}
    names = [name for name, dt in DTYPES.items() if {dt} == dtypes]
    if not names:
        raise ValueError(
            f"parameters must share one of {list(DTYPES)}, got {sorted(map(str, dtypes))}"
        )
    return names[0]
