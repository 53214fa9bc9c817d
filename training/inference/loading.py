"""Load the model a server serves: a registered version by alias or number, or a local package.

``models:/NAME@ALIAS`` is resolved to a version number first and that exact version is
downloaded (``registry.models.load_registered_model`` checks every file's sha256), so a
reload that races with an alias move still loads one consistent version. The package is
then loaded with ``training.models.package.load_model_package`` (which checks the
checksums and the tokenizer id again) and the download is removed: weights and
tokenizer live in memory.

The content id is the sha256 of the package's ``checksums.json``: it names the exact
files served, whatever path or registry they came from (the registry tags each version
with the same digest as ``megalith.package.checksums_sha256``).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from megalith.errors import MegalithError
from preprocessing.tokenizer import Tokenizer, load_tokenizer
from training.families import Generator, model_family
from training.mlflow_store.registered import (
    MODELS_SCHEME,
    is_registry_uri,
    load_registered_model,
    resolve_model_version,
)
from training.models.gpt import GPTModel
from training.models.package import CHECKSUMS_FILE, load_model_package, sha256_file
from training.models.t5 import T5Model


class ModelSourceError(MegalithError):
    """A model source that is neither a registry URI nor a model package directory."""


@dataclass(frozen=True)
class ModelInfo:
    """What ``GET /v1/model`` reports about the model being served."""

    source: str  # as given: models:/NAME@ALIAS, models:/NAME/VERSION or a directory
    name: str
    version: int | None  # None for a local package
    alias: str | None
    content_id: str  # sha256 of checksums.json
    max_positions: int
    loaded_at: float  # Unix time

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ServedModel:
    model: GPTModel | T5Model
    tokenizer: Tokenizer
    info: ModelInfo

    @property
    def generator(self) -> Generator:
        """The decode loops and prompt conventions of the model's family."""
        return model_family(self.model.config).generator

    @property
    def seq2seq(self) -> bool:
        """A T5: the prompt is the encoder's input and the answer a new text, not a
        continuation of the prompt."""
        return self.generator.seq2seq

    def prompt_ids(self, text: str) -> list[int]:
        """A plain prompt's tokens as this kind of model was trained to read them."""
        return self.generator.prompt_ids(self.tokenizer, text)

    def chat_prompt_ids(self, templated: list[int]) -> list[int]:
        """A chat's templated prompt as this kind of model was fine-tuned to read it."""
        return self.generator.chat_prompt(self.tokenizer, templated)

    def text(self, prompt_ids: list[int], new_ids: list[int]) -> str:
        """The answer's text: a T5's decoded output, or what a GPT's tokens add to the prompt."""
        return self.generator.answer_text(self.tokenizer, prompt_ids, new_ids)


def source_version(source: str, *, tracking_uri: str | None = None) -> int | None:
    """The registry version ``source`` points at now (None for a local package)."""
    if not is_registry_uri(source):
        return None

    return resolve_model_version(source, tracking_uri=tracking_uri)[1]


def load_served_model(
    source: str, *, tracking_uri: str | None = None, device: torch.device | str = "cpu"
) -> ServedModel:
    """Load ``source`` (a registry URI or a package directory) for serving, verified."""
    if is_registry_uri(source):
        return _load_registered(source, tracking_uri, device)
    package = Path(source)
    if not package.is_dir():
        raise ModelSourceError(
            f"{source}: expected models:/NAME@ALIAS, models:/NAME/VERSION or a model "
            "package directory"
        )
    return _load_package(package, source, package.resolve().name, None, None, device)


def _load_registered(
    source: str, tracking_uri: str | None, device: torch.device | str
) -> ServedModel:
    name, version = resolve_model_version(source, tracking_uri=tracking_uri)
    alias = source.split("@", 1)[1].rstrip("/") if "@" in source else None
    download = Path(tempfile.mkdtemp(prefix="megalith-serve-"))
    try:
        package = load_registered_model(
            f"{MODELS_SCHEME}{name}/{version}", download, tracking_uri=tracking_uri
        )
        return _load_package(package, source, name, version, alias, device)
    finally:
        shutil.rmtree(download, ignore_errors=True)


def _load_package(
    package: Path,
    source: str,
    name: str,
    version: int | None,
    alias: str | None,
    device: torch.device | str,
) -> ServedModel:
    model, config, tokenizer_path = load_model_package(package, device)
    # Read the bytes now: a registry download is deleted once loaded.
    tokenizer = load_tokenizer(str(tokenizer_path))
    if model_family(config).generator.seq2seq and tokenizer.pad_id is None:
        raise ModelSourceError(
            f"{source}: a T5 package whose tokenizer has no <|pad|> token (the decoder's start)"
        )
    info = ModelInfo(
        source=source,
        name=name,
        version=version,
        alias=alias,
        content_id=sha256_file(package / CHECKSUMS_FILE),
        max_positions=config.max_position_embeddings,
        loaded_at=time.time(),
    )
    return ServedModel(model, tokenizer, info)
