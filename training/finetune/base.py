"""The starting point of a fine-tune: whole base weights, their model config and lineage.

``finetune.base`` may name (checked in this order):

- ``models:/NAME@ALIAS`` or ``models:/NAME/VERSION``: a registered model. The alias is
  resolved to a version first and that version downloaded (so a moving alias cannot
  change the weights between the two) and verified (``registry.models``);
- a Megalith checkpoint: a ``step-*`` directory (``index.json``) or a checkpoints root
  (its latest complete step), format v1 or v2, verified against its index. Only the
  model weights are taken (the optimizer, step and data position start afresh); a
  LoRA run's checkpoint gives its adapters merged into the base weights;
- a model package directory (``config.json`` with ``"format": "megalith-model-package"``);
- a Hugging Face Llama/GPT-2 directory (any other ``config.json``), imported through
  :func:`training.interop.hf.import_hf` into a temporary package.

Every source ends as the same :class:`BaseWeights`: the single-device tensors (the
parameters, a tied output head once) as a lazy mapping
(:class:`~training.finetune.base_tensors.BaseTensors`: files verified up front, each
tensor read only when asked, and only the box asked, so a TP/FSDP rank reads its share
and never holds the model) and a :class:`ModelConfig`. Its ``content_id`` is the sha256
of the tensors themselves (names, dtypes, shapes, bytes in name order), so the same
weights have the same id whichever format they came in; it is computed when first asked
(rank 0's lineage), one tensor at a time.
"""

from __future__ import annotations

import functools
import hashlib
import json
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from torch import Tensor

from megalith import safe_read
from megalith.config import (
    ConfigError,
    LoRAConfig,
    MegalithConfig,
    ModelConfig,
    format_validation_error,
)
from megalith.errors import MegalithError
from megalith.storage import sha256_of_file
from training.checkpoint.sharded_index import latest_sharded_checkpoint
from training.checkpoint.sharded_reader import open_model_weights
from training.finetune.base_tensors import (
    BaseTensors,
    CheckpointTensors,
    MergedAdapters,
    SafetensorsTensors,
    TensorDict,
)
from training.finetune.lora import is_adapter_param
from training.interop.hf import import_hf
from training.mlflow_store.registered import load_registered_model, resolve_model_version
from training.mlflow_store.runs import resolve_tracking_uri
from training.models.package import (
    PACKAGE_FORMAT,
    WEIGHTS_FILE,
    read_package_model_config,
    tokenizer_file,
    verify_model_package,
    verify_package_weights,
)
from training.models.weights_check import checked_meta_model

# Model keys that change how the model runs, not what its weights are: a recipe may set
# them to other values than the base's.
RUNTIME_KEYS = frozenset(
    {
        "backend",
        "attention_backend",
        "dropout",
        "activation_checkpointing",
        "loss_chunk_tokens",
        "fp32_residual",
        "moe_aux_loss_coeff",
        "moe_capacity_factor",
        "init_std",
    }
)


class BaseModelError(MegalithError):
    """A ``finetune.base`` that cannot be read; the message names the path and what was expected."""


@dataclass
class BaseWeights:
    """Base weights (read lazily) and what they are."""

    uri: str  # finetune.base as given
    kind: str  # checkpoint | package | registered | hf
    config: ModelConfig
    tensors: BaseTensors
    tokenizer_path: Path | None = None  # packages, registered models, HF imports
    tokenizer_id: str | None = None
    details: dict[str, str] = field(default_factory=dict)  # registered name/version, step

    @functools.cached_property
    def content_id(self) -> str:
        """sha256 of the tensors (:func:`content_id`), read one at a time."""
        return content_id(self.tensors)

    def lineage(self) -> dict[str, str]:
        """``megalith.base.*`` tags: what the fine-tune started from."""
        tags = {
            "megalith.base.uri": self.uri,
            "megalith.base.kind": self.kind,
            "megalith.base.content_id": self.content_id,
        }
        tags.update({f"megalith.base.{k}": v for k, v in self.details.items()})
        if self.tokenizer_id:
            tags["megalith.base.tokenizer_id"] = self.tokenizer_id
        return tags


def content_id(tensors: Mapping[str, Tensor]) -> str:
    """sha256 over the tensors in name order: each name, dtype, shape, then its bytes
    (a :class:`BaseTensors` reads them one at a time)."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        header = json.dumps([name, str(tensor.dtype), list(tensor.shape)])
        digest.update(header.encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def load_base(
    uri: str,
    *,
    tracking_uri: str | None = None,
    workdir: str | Path | None = None,
    require_signature: bool = False,
) -> BaseWeights:
    """Read ``finetune.base`` (see the module docstring) into a :class:`BaseWeights`.

    ``tracking_uri``: the MLflow store of ``models:/`` URIs; ``workdir``: where a
    registered model is downloaded or an HF directory imported (a new temporary
    directory when None); ``require_signature`` (``checkpoint.require_signature``):
    refuse an unsigned checkpoint or package base (a Hugging Face directory has no
    manifest to sign, so it is refused too)."""
    if uri.startswith("models:/"):
        return _registered(uri, tracking_uri, workdir, require_signature)
    path = Path(uri)
    if not path.is_dir():
        raise BaseModelError(
            f"finetune.base {uri!r}: not a directory nor a models:/NAME@ALIAS URI; expected a "
            "checkpoint, a model package, a registered model or a Hugging Face directory"
        )
    if _present(path / "index.json") or _present(path / "latest.json") or _has_steps(path):
        return _checkpoint(uri, path, require_signature)
    config_json = path / "config.json"
    if not config_json.is_file():
        raise BaseModelError(
            f"finetune.base {uri!r}: has neither index.json/latest.json/step-* (a checkpoint) "
            "nor config.json (a model package or a Hugging Face directory)"
        )
    if _is_package(config_json):
        return _package(uri, path, "package", require_signature=require_signature)
    if require_signature:
        raise BaseModelError(
            f"finetune.base {uri!r}: a Hugging Face directory carries no signature and "
            "signatures are required (checkpoint.require_signature); import it into a "
            "signed model package first (megalith import hf, with a signing key set)"
        )
    return _hf(uri, path, workdir)


def _present(path: Path) -> bool:
    """Whatever is there (a link or a pipe too): the checkpoint reader refuses what is
    not a regular file, naming it, rather than this guess skipping it."""
    return path.exists() or path.is_symlink()


def _has_steps(path: Path) -> bool:
    return any(p.is_dir() and p.name.startswith("step-") for p in path.iterdir())


def _is_package(config_json: Path) -> bool:
    """Only to pick the reader: bounded, a regular file (the package reader hashes it)."""
    try:
        meta = safe_read.read_json(config_json, max_bytes=1 << 20, allow_symlink=False)
    except safe_read.UnsafeFileError as exc:
        raise BaseModelError(str(exc)) from None
    return isinstance(meta, dict) and meta.get("format") == PACKAGE_FORMAT


def _package(
    uri: str,
    path: Path,
    kind: str,
    details: dict[str, str] | None = None,
    keep_tokenizer: bool = True,
    require_signature: bool = False,
    keep: Any = None,
) -> BaseWeights:
    # every file's sha256 checked, the signature when required or present, and the
    # weights' header against config.json; the tensors are read later, box by box
    meta = verify_model_package(path, require_signature=require_signature)
    verify_package_weights(path, meta)
    tokenizer = path / tokenizer_file(meta, path)
    return BaseWeights(
        uri=uri,
        kind=kind,
        config=read_package_model_config(path),
        tensors=SafetensorsTensors(path / WEIGHTS_FILE, keep=keep),
        tokenizer_path=tokenizer if keep_tokenizer else None,
        tokenizer_id=sha256_of_file(str(tokenizer)),
        details=details or {},
    )


def _registered(
    uri: str, tracking_uri: str | None, workdir: str | Path | None, require_signature: bool
) -> BaseWeights:
    tracking_uri = tracking_uri or resolve_tracking_uri(None, Path.cwd())
    name, version = resolve_model_version(uri, tracking_uri=tracking_uri)
    details = {"name": name, "version": str(version)}
    root, keep = _workdir(workdir)
    pinned = f"models:/{name}/{version}"
    package = load_registered_model(pinned, root / "base", tracking_uri=tracking_uri)
    return _package(
        uri,
        package,
        "registered",
        details,
        keep_tokenizer=workdir is not None,
        require_signature=require_signature,
        keep=keep,
    )


def _hf(uri: str, path: Path, workdir: str | Path | None) -> BaseWeights:
    root, keep = _workdir(workdir)
    package = import_hf(path, root / "base-from-hf", overwrite=True)
    return _package(uri, package, "hf", keep_tokenizer=workdir is not None, keep=keep)


def _workdir(workdir: str | Path | None) -> tuple[Path, tempfile.TemporaryDirectory | None]:
    """``workdir``, or a temporary directory that the base's tensors keep (their file is
    read lazily) and that goes with them; only a given workdir lends its tokenizer."""
    if workdir is not None:
        Path(workdir).mkdir(parents=True, exist_ok=True)
        return Path(workdir), None
    tmp = tempfile.TemporaryDirectory(prefix="megalith-base-")
    return Path(tmp.name), tmp


def _checkpoint(uri: str, path: Path, require_signature: bool) -> BaseWeights:
    """Model weights through the checkpoint's verified path (signature, each file's sha256
    before its first read, the step of the folder or of latest.json); state.json from its
    hashed bytes. A v2 checkpoint is read box by box, a v1 (one file) whole."""
    if not _present(path / "index.json"):  # a checkpoints root: its latest step
        latest = latest_sharded_checkpoint(str(path))
        if latest is None:
            raise BaseModelError(f"finetune.base {uri!r}: no complete checkpoint in {path}")
        path = Path(latest)
    opened, state = open_model_weights(path, require_signature)
    tensors = TensorDict(opened) if isinstance(opened, dict) else CheckpointTensors(opened)
    config = _model_config(state, path)
    if any(is_adapter_param(name) for name in tensors):
        tensors = MergedAdapters(tensors, _lora_scale(state, path))
    # state.json's sizes against the weights, before the fine-tune builds the model from them
    shapes = {name: list(tensors.shape(name)) for name in tensors}
    checked_meta_model(config, shapes, f"{path / 'state.json'}: model_config and the weights")
    details = {"step": str(state.get("step", ""))}
    return BaseWeights(uri, "checkpoint", config, tensors, details=details)


def _lora_scale(state: dict[str, Any], path: Path) -> float:
    """alpha / rank of the LoRA run that wrote the checkpoint (its config in state.json)."""
    finetune = (state.get("config") or {}).get("finetune")
    lora = finetune.get("lora") if isinstance(finetune, dict) else None
    try:
        if not isinstance(lora, dict) or not {"rank", "alpha"} <= lora.keys():
            raise ValueError("no rank and alpha")
        config = LoRAConfig.model_validate(lora)
    except (ValueError, ValidationError):
        raise BaseModelError(
            f"{path}: holds LoRA adapters but state.json has no valid finetune.lora "
            "(rank and alpha)"
        ) from None
    return config.alpha / config.rank


def _model_config(state: dict[str, Any], path: Path) -> ModelConfig:
    if not isinstance(state.get("model_config"), dict):
        raise BaseModelError(
            f"{path / 'state.json'}: has no model_config; this checkpoint cannot be a base"
        )
    try:
        return ModelConfig.model_validate(state["model_config"])
    except ValidationError as exc:
        raise BaseModelError(
            format_validation_error(exc, f"{path / 'state.json'}: model_config")
        ) from None


def finetune_model_config(config: MegalithConfig, base: ModelConfig) -> ModelConfig:
    """The model to fine-tune: the base's, with the recipe's runtime keys.

    Raises naming every ``model`` key the recipe sets (not None) to a value other than
    the base's, other than :data:`RUNTIME_KEYS`."""
    recipe = config.model
    conflicts = []
    for key in sorted(recipe.model_fields_set - RUNTIME_KEYS):
        value = getattr(recipe, key)
        if value is not None and value != getattr(base, key):
            conflicts.append(f"model.{key} = {value!r} (the base has {getattr(base, key)!r})")
    if conflicts:
        raise ConfigError(
            f"finetune.base {config.finetune.base}: the config's model keys conflict with the "
            f"base model: {'; '.join(conflicts)}. The architecture comes from the base: remove "
            "these keys from the recipe or pick a matching base"
        )
    updates = {key: getattr(recipe, key) for key in recipe.model_fields_set & RUNTIME_KEYS}
    model = base.model_copy(update=updates)
    if config.data.seq_length > model.max_position_embeddings:
        raise ConfigError(
            f"data.seq_length {config.data.seq_length} exceeds the base model's "
            f"max_position_embeddings {model.max_position_embeddings}"
        )
    return model


def check_data_matches(base: BaseWeights, tokenizer_id: str, vocab_size: int, where: str) -> None:
    """The training data must be tokenized with the base's tokenizer (when the base
    names one) and fit its vocabulary: every id below the base's ``vocab_size`` (an imported
    model's table need not be padded, GPT-2's 50,257 ids are no multiple of 128)."""
    if base.tokenizer_id and tokenizer_id != base.tokenizer_id:
        raise ConfigError(
            f"{where} was tokenized with tokenizer {tokenizer_id[:12]}..., the base model "
            f"{base.uri} uses {base.tokenizer_id[:12]}...; tokenize the fine-tuning data with "
            "the base's tokenizer file"
        )
    if vocab_size > base.config.vocab_size:
        raise ConfigError(
            f"{where}: its vocabulary ({vocab_size}) is larger than the base model's "
            f"vocab_size {base.config.vocab_size}"
        )


__all__ = [
    "BaseWeights",
    "BaseModelError",
    "check_data_matches",
    "content_id",
    "finetune_model_config",
    "load_base",
]
